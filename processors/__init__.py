"""Processors: consumer-group members that read topics and write topics, on the one skeleton
(agl_stream/kafka/processor.py).

- ``rollouts``: the rollout processor (``agl-stream processor``): folds rollout events, answers
  claims and watches, runs the watchdog, writes state and replies.
- ``ingress``: tasks from external systems -> enqueue events.
- ``triplets``: the triplet builder: an attempt's spans -> one triplet record.
- ``batcher``: triplet records -> training batches.

Who writes and reads each topic: topics/topics.toml (docs/architecture.md renders it).
"""

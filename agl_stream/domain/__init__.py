"""The pure domain: the rules of the store, the traces and the training data, as functions and
plain state machines over the records in ``agl_stream.models``.

Nothing here does I/O (no Kafka, ClickHouse, HTTP, files or processes): every module is tested
without any, and a contract in ``pyproject.toml`` ([tool.importlinter]) keeps it that way.

- ``fold``: a rollout's state after an event (the store's transition table);
- ``rollout_core``: the rollout processor's state and every decision of a batch (claims, queue,
  admission, retention, watchdog deadlines), under its Kafka shell in ``processors/rollouts.py``;
- ``watchdog``: timeouts and unresponsive attempts as events;
- ``queue``: which queued rollout a claim gets;
- ``adapter``: spans -> trace tree -> RL triplets;
- ``trace_collector``: an attempt's spans gathered until they are complete;
- ``batching``: triplet records -> training batches (groups, staleness);
- ``ingress``: task requests -> rollout events, and why a request is refused;
- ``replay``: historical spans -> triplet records (offline RL);
- ``llm_calls``: LLM requests and responses -> spans;
- ``export``: finished rollouts' LLM calls -> chat conversations and preference pairs;
- ``dead_letters``: reading, counting and resubmitting dead letters.
"""

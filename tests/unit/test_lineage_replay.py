"""Lineage, "a replay can rebuild the same batch": the live builder's path and `agl-stream
replay`'s (PartitionReplay, spans read from their bytes) make the same samples from the same spans
(token ids, logprobs, mask and the span ids each sample was built from), and a batch rebuilt
from its members (the (rollout_id, attempt_id) list the batches and batch_samples rows keep)
has the same batch id, the digest of those members. Pure: no broker, no engine."""

from __future__ import annotations

import pytest

from agl_stream.domain.adapter import AdapterConfig
from agl_stream.domain.batching import Batcher, BatchPolicy, batch_id_of
from agl_stream.domain.fold import fold
from agl_stream.domain.replay import PartitionReplay, ReplaySettings, canonical
from agl_stream.domain.trace_collector import TraceCollector, spans_by_attempt, triplet_record
from agl_stream.models import RolloutEvent, RolloutState, Span, TripletBatch, TripletRecord
from agl_stream.wire.codec import Codec
from tests.replay_history import AttemptHistory, attempt_history, span_values

ATTEMPTS = 8
CALLS = 3


def _histories() -> list[AttemptHistory]:
    return [attempt_history(i, calls=CALLS, groups=2, prompt_tokens=12, response_tokens=4) for i in range(ATTEMPTS)]


def _live_records(histories: list[AttemptHistory], codec: Codec, adapter: AdapterConfig) -> list[TripletRecord]:
    """What the triplet builder writes to agl.triplets: validated span models, its collector, its
    triplet_record, in the order attempts become ready."""
    collector: TraceCollector[int] = TraceCollector(max_spans=1 << 62, remember=1 << 62)
    states: dict[str, RolloutState] = {}
    for event in (e for h in histories for e in h.events):
        decoded = codec.decode(codec.encode(event), RolloutEvent)
        state = fold(states.get(decoded.rollout_id), decoded).state
        assert state is not None
        states[decoded.rollout_id] = state
        collector.add_state(state, -1, 0.0)
    records = []
    for offset, value in enumerate(v for h in histories for v in span_values(h, codec, 2)):
        name, datum = codec.decode_dict(value)
        spans = [Span.model_validate(d) for d in (datum["spans"] if name == "agl.SpanBatch" else [datum])]
        for group in spans_by_attempt(spans):
            for attempt in collector.add_spans(group, offset, 0.0)[0]:
                records.append(triplet_record(attempt.finished, attempt.spans, adapter, None)[0])
    return records


def _replayed_records(histories: list[AttemptHistory], codec: Codec, adapter: AdapterConfig) -> list[TripletRecord]:
    """What `agl-stream replay` writes for one partition holding the same history."""
    derivation = PartitionReplay(0, ReplaySettings(adapter=adapter), {}, codec)
    for offset, event in enumerate(e for h in histories for e in h.events):
        derivation.add_event(offset, codec.encode(event))
    for offset, value in enumerate(v for h in histories for v in span_values(h, codec, 2)):
        derivation.add_spans(offset, value)
    return [codec.decode(r.value, TripletRecord) for r in canonical(derivation.finish())]


def _batches(records: list[TripletRecord]) -> list[TripletBatch]:
    """Whole GRPO groups of 4: the batcher decides by order and counts alone (no linger)."""
    batcher = Batcher(BatchPolicy(max_rollouts=4, group_size=4, linger_s=None, max_group_wait_s=None), partition=0)
    return [b for offset, r in enumerate(records) for b in batcher.add(r, offset, 1.0)]


def _samples(batch: TripletBatch) -> list[tuple[object, ...]]:
    """What the trainer reads of a batch, row by row (records in order, their samples in order)."""
    return [
        (
            r.rollout_id,
            r.attempt_id,
            t.prompt_token_ids,
            t.response_token_ids,
            t.response_logprobs,
            t.response_mask,
            t.span_ids,
            t.reward,
            r.final_reward,
        )
        for r in batch.records
        for t in r.triplets
    ]


@pytest.mark.parametrize("aggregation", ["transition", "trajectory"])
def test_a_replay_of_a_batchs_spans_rebuilds_its_samples_and_its_batch_id(aggregation: str) -> None:
    codec = Codec.default()
    adapter = AdapterConfig(aggregation=aggregation)  # type: ignore[arg-type]
    histories = _histories()
    live = _batches(_live_records(histories, codec, adapter))
    replayed = {(r.rollout_id, r.attempt_id): r for r in _replayed_records(histories, codec, adapter)}
    assert len(live) == 2 and sum(len(b.records) for b in live) == ATTEMPTS == len(replayed)

    for batch in live:
        # Rebuilt from its members, as the batches row lists them: the same samples, the same id.
        members = [replayed[(r.rollout_id, r.attempt_id)] for r in batch.records]
        assert batch_id_of(members) == batch.batch_id
        rebuilt = batch.model_copy(update={"records": members})
        assert _samples(rebuilt) == _samples(batch)

    # Each sample names the LLM-call spans it was built from, in call order, and together the
    # samples of an attempt name each of its calls once.
    calls = {
        (h.rollout_id, s["attempt_id"]): [x["span_id"] for x in h.spans if x["name"] == "openai.chat.completion"]
        for h in histories
        for s in h.spans[:1]
    }
    for batch in live:
        for record in batch.records:
            named = [span_id for t in record.triplets for span_id in t.span_ids]
            assert named == calls[(record.rollout_id, record.attempt_id)]
            assert all(t.calls == len(t.span_ids) for t in record.triplets)


def test_the_batcher_given_the_replayed_records_in_order_makes_the_same_batches() -> None:
    """`agl-stream batcher --input-topic <replay topic>`: the same policy over the same records
    in the same order decides the same batches (ids are digests of members, not of time)."""
    codec = Codec.default()
    adapter = AdapterConfig()
    histories = _histories()
    live = _batches(_live_records(histories, codec, adapter))
    again = _batches(_replayed_records(histories, codec, adapter))
    assert [b.batch_id for b in again] == [b.batch_id for b in live]
    assert [_samples(b) for b in again] == [_samples(b) for b in live]

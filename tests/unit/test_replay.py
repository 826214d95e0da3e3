"""The replay's pure parts: ranges, times, settings identity, span views, reward override, order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agl_stream.domain.adapter import AdapterConfig, extract_triplets
from agl_stream.domain.adapter.span_decoder import SpanRecordDecoder
from agl_stream.domain.replay import (
    PartitionReplay,
    ReplayError,
    ReplaySettings,
    RewardError,
    canonical,
    load_reward,
    new_reward,
    out_record,
    output_digest,
    parse_offset_ranges,
    parse_time,
    replay_topic,
    resolve_ranges,
    with_reward,
)
from agl_stream.errors import MalformedRecordError
from agl_stream.models import Span, TripletRecord
from agl_stream.wire.codec import Codec
from agl_stream.wire.span_records import span_dict_records
from tests.replay_history import attempt_history, span_values


def test_offset_ranges_parse_and_combine() -> None:
    assert parse_offset_ranges(["0:100-200", "1:5-", "2:-7"]) == {0: (100, 200), 1: (5, None), 2: (None, 7)}
    assert parse_offset_ranges(starts=["3:10"], ends=["3:20"]) == {3: (10, 20)}
    for bad in (["0:200-100"], ["x:1-2"], ["0:1-2", "0:3-4"]):
        with pytest.raises(ReplayError):
            parse_offset_ranges(bad)


def test_ranges_resolve_against_history_offsets_and_times() -> None:
    begin, end = {0: 0, 1: 10}, {0: 50, 1: 40}
    assert resolve_ranges(begin, end) == {0: (0, 50), 1: (10, 40)}
    assert resolve_ranges(begin, end, {1: (0, 20)}) == {1: (10, 20)}  # only named partitions
    # offsets_for_times: None means no record at or after that time
    assert resolve_ranges(begin, end, None, {0: 30, 1: None}, {0: 45, 1: None}) == {0: (30, 45), 1: (40, 40)}
    with pytest.raises(ReplayError):
        resolve_ranges(begin, end, {7: (0, 1)})


def test_times_are_epoch_or_iso() -> None:
    assert parse_time("1767225600.5") == 1767225600.5
    assert parse_time("2026-01-01T00:00:00Z") == parse_time("2026-01-01T00:00:00") == 1767225600.0
    with pytest.raises(ReplayError):
        parse_time("yesterday")


def test_names_and_reward_references_are_checked() -> None:
    assert replay_topic("agl", "exp-1") == "agl.triplets.replay.exp-1"
    for name in ("", "Exp", "a/b", "a.b"):
        with pytest.raises(ReplayError):
            replay_topic("agl", name)
    assert load_reward("math:fabs") is not None
    for ref in ("math", "no_such_module_x:f", "math:no_such_fn"):
        with pytest.raises(ReplayError):
            load_reward(ref)


def test_settings_digest_depends_on_what_derives_records_only() -> None:
    a = ReplaySettings()
    assert a.digest() == ReplaySettings().digest()
    assert a.digest() != ReplaySettings(reward="m:f").digest()
    assert a.digest() != ReplaySettings(adapter=AdapterConfig(reward_match="first_sibling")).digest()


def test_spans_read_from_bytes_give_the_adapter_what_validated_spans_give() -> None:
    codec = Codec.default()
    history = attempt_history(7)
    [(_, record)] = span_dict_records(history.spans, codec)
    lean = SpanRecordDecoder(codec).decode(record)
    spans = [Span.model_validate(d) for d in history.spans]
    assert extract_triplets(lean, AdapterConfig()) == extract_triplets(spans, AdapterConfig())
    bad = span_dict_records([{**history.spans[0], "span_id": ""}], codec)[0][1]
    with pytest.raises(MalformedRecordError, match="span_id '' is not 1 to 128 characters"):
        SpanRecordDecoder(codec).decode(bad)
    # An id that is not OpenTelemetry's hex (the seed's users write such) is read the codec's way.
    text_ids = span_dict_records(
        [{**s, "trace_id": "t1", "span_id": f"s{i}"} for i, s in enumerate(history.spans)], codec
    )
    assert [s.span_id for s in SpanRecordDecoder(codec).decode(text_ids[0][1])] == [
        f"s{i}" for i in range(len(history.spans))
    ]


def test_a_partition_derives_the_records_of_the_codec_path() -> None:
    """PartitionReplay (bytes read into LeanSpans, records written without fastavro) against
    the same steps done with validated models and the codec, on single spans and batches."""
    from agl_stream.domain.fold import fold
    from agl_stream.domain.trace_collector import TraceCollector, spans_by_attempt, triplet_record
    from agl_stream.models import RolloutEvent, RolloutState

    codec = Codec.default()
    histories = [attempt_history(i, groups=3, vocab=151_936 if i % 2 else 64) for i in range(12)]
    events = [codec.encode(event) for h in histories for event in h.events]
    values = [v for i, h in enumerate(histories) for v in span_values(h, codec, None if i % 3 == 0 else 4)]
    derivation = PartitionReplay(2, ReplaySettings(), {}, codec)
    for offset, value in enumerate(events):
        derivation.add_event(offset, value)
    for offset, value in enumerate(values):
        derivation.add_spans(offset, value)
    derivation.add_spans(len(values), b"not a span")
    got = derivation.finish()
    assert derivation.decoder.codec_records == 1 and derivation.decoder.fast_records == len(values)
    assert derivation.tally.malformed_spans.count == 1 and derivation.tally.spans == 120

    collector: TraceCollector[int] = TraceCollector(max_spans=1 << 62, remember=1 << 62)
    states: dict[str, RolloutState] = {}
    for value in events:
        event = codec.decode(value, RolloutEvent)
        state = fold(states.get(event.rollout_id), event).state
        assert state is not None
        states[event.rollout_id] = state
        collector.add_state(state, -1, 0.0)
    expected = []
    for offset, value in enumerate(values):
        name, datum = codec.decode_dict(value)
        spans = [Span.model_validate(d) for d in (datum["spans"] if name == "agl.SpanBatch" else [datum])]
        for group in spans_by_attempt(spans):
            for attempt in collector.add_spans(group, offset, 0.0)[0]:
                record, _ = triplet_record(attempt.finished, attempt.spans, AdapterConfig(), None)
                expected.append(out_record((2, 0, offset), record, codec.encode(record), ReplaySettings().digest()))
    assert len(got) == len(expected) == 12
    assert output_digest(canonical(got)) == output_digest(canonical(expected))


def _record(final: float | None, sources: list[str | None]) -> TripletRecord:
    triplets = [
        {
            "prompt_token_ids": [1],
            "response_token_ids": [2],
            "reward": 1.0 if s else None,
            "metadata": {"reward_source": s},
        }
        for s in sources
    ]
    return TripletRecord.model_validate(
        {
            "rollout_id": "ro-1",
            "attempt_id": "at-1",
            "group_id": "g",
            "triplets": triplets,
            "final_reward": final,
            "finish_time": 1.0,
        }
    )


def test_a_new_reward_replaces_the_final_one_where_it_was_used() -> None:
    record = with_reward(_record(1.0, ["first_occurrence", "final_reward"]), 0.5, to_last=True)
    assert record.final_reward == 0.5
    assert [t.reward for t in record.triplets] == [1.0, 0.5]  # a matched reward span stays
    assert record.triplets[1].metadata["reward_source"] == "replay_reward"
    open_last = with_reward(_record(None, ["first_occurrence", None]), 0.5, to_last=True)
    assert open_last.triplets[-1].reward == 0.5
    assert with_reward(_record(None, [None]), 0.5, to_last=False).triplets[0].reward is None


def test_reward_functions_fail_per_attempt() -> None:
    assert new_reward(lambda spans: 1, []) == 1.0
    assert new_reward(lambda spans: None, []) is None
    bad: list[Callable[[list[Span]], Any]] = [
        lambda spans: 1 / 0,
        lambda spans: "high",
        lambda spans: float("nan"),
        lambda spans: True,
    ]
    for fn in bad:
        with pytest.raises(RewardError):
            new_reward(fn, [])


def test_output_order_and_digest_are_canonical() -> None:
    codec = Codec.default()
    records = [_record(float(i), [None]).model_copy(update={"rollout_id": f"ro-{i}"}) for i in range(3)]
    outs = [out_record((i % 2, 10 - i, 0), r, codec.encode(r), "s") for i, r in enumerate(records)]
    ordered = canonical(outs)
    assert [o.position for o in ordered] == [(0, 8, 0), (0, 10, 0), (1, 9, 0)]
    assert output_digest(ordered) == output_digest(canonical(reversed(outs)))
    assert output_digest(ordered) != output_digest(ordered[:2])
    assert outs[0].timestamp_ms == 1000 and dict(outs[0].headers)["agl-replay-attempt"] == b"ro-0/at-1"

"""The replay's pure parts: ranges, times, settings identity, span views, reward override, order."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agl_stream.codec import Codec
from agl_stream.domain.adapter import AdapterConfig, extract_triplets
from agl_stream.domain.replay import (
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
    span_view,
    with_reward,
)
from agl_stream.errors import MalformedRecordError
from agl_stream.models import Span, TripletRecord
from producers.replay_history import attempt_history


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


def test_span_views_give_the_adapter_what_validated_spans_give() -> None:
    codec = Codec.default()
    history = attempt_history(7)
    dicts = [codec.decode_dict(codec.encode_dict("agl.Span", s))[1] for s in history.spans]
    views = [span_view(dict(d)) for d in dicts]
    spans = [Span.model_validate(d) for d in dicts]
    assert extract_triplets(views, AdapterConfig()) == extract_triplets(spans, AdapterConfig())
    with pytest.raises(MalformedRecordError):
        span_view({**dicts[0], "span_id": "XYZ"})


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

"""Trajectory aggregation: the calls of one attempt -> training samples, token for token.

Hand-built multi-turn traces (token ids chosen by hand, so every expected sequence is written
out), the reasons a call starts a new sample, logprobs alignment, lineage, the wire shape of
the new Triplet fields and the adapter's ``aggregation`` setting.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest

from agl_stream.domain.adapter import (
    BRANCH,
    DRIFT,
    REWRITTEN,
    AdapterConfig,
    aggregate_triplets,
    break_reason,
    extract_triplets,
)
from agl_stream.domain.adapter.lean import lean_span
from agl_stream.domain.adapter.triplet_encoder import TripletRecordEncoder
from agl_stream.models import Span, Triplet, TripletRecord
from agl_stream.resources import resource_path
from agl_stream.wire.codec import Codec
from agl_stream.wire.contract import Contract, check_compatible
from agl_stream.wire.semconv import POLICY_VERSION

SYSTEM = [1, 2, 3]
USER = [10, 11]
PROMPT = SYSTEM + USER  # the first call's prompt


def call(
    prompt: list[int],
    response: list[int],
    *,
    span: str,
    logprobs: list[float] | None = None,
    reward: float | None = None,
) -> Triplet:
    return Triplet(
        prompt_token_ids=prompt,
        response_token_ids=response,
        response_logprobs=logprobs,
        reward=reward,
        metadata={"span_id": span, "response_id": f"r-{span}"},
        span_ids=[span],
    )


def three_turns() -> list[Triplet]:
    """A 3-turn tool-using trace: call, tool result, call, tool result + user turn, call."""
    c1 = call(PROMPT, [20, 21, 22], span="s1", logprobs=[-0.1, -0.2, -0.3])
    tool1 = [30, 31]
    c2_prompt = [*PROMPT, 20, 21, 22, *tool1]
    c2 = call(c2_prompt, [23, 24], span="s2", logprobs=[-0.4, -0.5])
    tool2_and_user = [32, 33, 34, 12]
    c3_prompt = [*c2_prompt, 23, 24, *tool2_and_user]
    c3 = call(c3_prompt, [25], span="s3", logprobs=[-0.6], reward=1.0)
    return [c1, c2, c3]


# ---------------------------------------------------------------------------------------------
# trajectory mode: merging
# ---------------------------------------------------------------------------------------------


def test_three_turns_with_tool_results_merge_into_one_sample_token_for_token() -> None:
    samples, breaks = aggregate_triplets(three_turns(), "trajectory")
    assert breaks == Counter()
    assert len(samples) == 1
    sample = samples[0]
    assert sample.prompt_token_ids == [1, 2, 3, 10, 11]
    assert sample.response_token_ids == [20, 21, 22, 30, 31, 23, 24, 32, 33, 34, 12, 25]
    assert sample.response_mask == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    assert sample.response_logprobs == [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5, 0.0, 0.0, 0.0, 0.0, -0.6]
    assert sample.span_ids == ["s1", "s2", "s3"]
    assert sample.calls == 3
    assert sample.reward == 1.0  # the last call's
    assert sample.metadata == {"span_id": "s3", "response_id": "r-s3"}
    # The whole sequence is the last call's prompt and response: nothing lost, nothing added.
    calls = three_turns()
    assert sample.prompt_token_ids + sample.response_token_ids == (
        calls[-1].prompt_token_ids + calls[-1].response_token_ids
    )


def test_a_call_with_nothing_inserted_merges_with_an_empty_gap() -> None:
    c1 = call(PROMPT, [20], span="a")
    c2 = call([*PROMPT, 20], [21, 22], span="b")  # the agent continued its own response
    (sample,), breaks = aggregate_triplets([c1, c2], "trajectory")
    assert breaks == Counter()
    assert sample.response_token_ids == [20, 21, 22]
    assert sample.response_mask == [1, 1, 1]


def test_a_single_call_is_one_sample_with_an_all_ones_mask() -> None:
    c1 = call(PROMPT, [20, 21], span="a", reward=0.5)
    (sample,), breaks = aggregate_triplets([c1], "trajectory")
    assert breaks == Counter()
    assert sample.prompt_token_ids == PROMPT and sample.response_token_ids == [20, 21]
    assert sample.response_mask == [1, 1]
    assert sample.span_ids == ["a"] and sample.calls == 1 and sample.reward == 0.5


def test_empty_input_gives_no_samples_in_either_mode() -> None:
    assert aggregate_triplets([], "trajectory") == ([], Counter())
    assert aggregate_triplets([], "transition") == ([], Counter())


# ---------------------------------------------------------------------------------------------
# trajectory mode: why a call starts a new sample
# ---------------------------------------------------------------------------------------------


def test_retokenisation_drift_starts_a_new_sample() -> None:
    c1 = call(PROMPT, [20, 21, 22], span="a")
    # The next prompt holds the first response retokenised ([20, 21, 22] -> [20, 99]) plus a tool result.
    c2_prompt = [*PROMPT, 20, 99, 30, 31]
    c2 = call(c2_prompt, [23], span="b")
    c3 = call([*c2_prompt, 23, 32], [24], span="c")  # continues the new sample
    samples, breaks = aggregate_triplets([c1, c2, c3], "trajectory")
    assert breaks == Counter({DRIFT: 1})
    assert [s.span_ids for s in samples] == [["a"], ["b", "c"]]
    assert samples[0].prompt_token_ids == PROMPT and samples[0].response_token_ids == [20, 21, 22]
    assert samples[0].response_mask == [1, 1, 1]
    assert samples[1].prompt_token_ids == c2_prompt
    assert samples[1].response_token_ids == [23, 32, 24]
    assert samples[1].response_mask == [1, 0, 1]


def test_a_truncated_context_starts_a_new_sample() -> None:
    c1 = call(PROMPT, [20, 21], span="a")
    c2_prompt = [*PROMPT, 20, 21, 30, 31, 32, 33]
    c2 = call(c2_prompt, [22, 23], span="b")
    # The agent drops the first exchange (keeps system + user) and adds a summary token: shorter.
    c3_prompt = [*PROMPT, 40, 41]
    c3 = call(c3_prompt, [24], span="c")
    samples, breaks = aggregate_triplets([c1, c2, c3], "trajectory")
    assert breaks == Counter({REWRITTEN: 1})
    assert [s.span_ids for s in samples] == [["a", "b"], ["c"]]
    assert samples[0].response_token_ids == [20, 21, 30, 31, 32, 33, 22, 23]
    assert samples[0].response_mask == [1, 1, 0, 0, 0, 0, 1, 1]
    assert samples[1].prompt_token_ids == c3_prompt and samples[1].response_mask == [1]


def test_a_retried_call_is_a_rewritten_context() -> None:
    c1 = call(PROMPT, [20, 21], span="a")
    retry = call(PROMPT, [22, 23], span="b")  # same prompt again: shorter than prompt + response
    samples, breaks = aggregate_triplets([c1, retry], "trajectory")
    assert breaks == Counter({REWRITTEN: 1})
    assert [s.response_token_ids for s in samples] == [[20, 21], [22, 23]]


def test_a_sub_agent_branches_and_the_main_agent_after_it_branches_again() -> None:
    main1 = call(PROMPT, [20, 21], span="m1")
    main2_prompt = [*PROMPT, 20, 21, 30]
    main2 = call(main2_prompt, [22], span="m2")
    sub = call([1, 2, 7, 8, 9], [50, 51], span="sub")  # shares the chat template's first tokens only
    main3 = call([*main2_prompt, 22, 31], [23], span="m3")  # continues m2, not the sub-agent
    samples, breaks = aggregate_triplets([main1, main2, sub, main3], "trajectory")
    assert breaks == Counter({BRANCH: 2})
    assert [s.span_ids for s in samples] == [["m1", "m2"], ["sub"], ["m3"]]
    assert samples[0].response_token_ids == [20, 21, 30, 22]
    assert samples[0].response_mask == [1, 1, 0, 1]
    assert samples[1].prompt_token_ids == [1, 2, 7, 8, 9] and samples[1].response_mask == [1, 1]
    assert samples[2].prompt_token_ids == [*main2_prompt, 22, 31]


def test_break_reason_rule() -> None:
    sequence = [1, 2, 3, 4, 5, 6]  # first prompt [1, 2, 3], then [4, 5, 6]
    assert break_reason(sequence, 3, [1, 2, 3, 4, 5, 6]) is None
    assert break_reason(sequence, 3, [1, 2, 3, 4, 5, 6, 7]) is None
    assert break_reason(sequence, 3, [1, 2, 3, 4, 9, 6, 7]) == DRIFT  # first prompt kept, not shorter
    assert break_reason(sequence, 3, [1, 2, 3, 4, 9, 6]) == DRIFT
    assert break_reason(sequence, 3, [1, 2, 3, 9]) == REWRITTEN  # first prompt kept, shorter
    assert break_reason(sequence, 3, [1, 2, 3, 4, 5]) == REWRITTEN
    assert break_reason(sequence, 3, [1, 2, 9, 4, 5, 6, 7]) == BRANCH  # first prompt not kept
    assert break_reason(sequence, 3, [8]) == BRANCH
    assert break_reason(sequence, 3, []) == BRANCH


# ---------------------------------------------------------------------------------------------
# logprobs, rewards, lineage
# ---------------------------------------------------------------------------------------------


def test_logprobs_are_none_when_any_merged_call_lacks_them() -> None:
    c1, c2, c3 = three_turns()
    without = c2.model_copy(update={"response_logprobs": None})
    (sample,), _ = aggregate_triplets([c1, without, c3], "trajectory")
    assert sample.response_logprobs is None
    assert sample.response_mask == [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    misaligned = c3.model_copy(update={"response_logprobs": [-0.6, -0.7]})  # 2 for 1 token
    (sample,), _ = aggregate_triplets([c1, c2, misaligned], "trajectory")
    assert sample.response_logprobs is None


def test_logprobs_line_up_with_the_response_tokens() -> None:
    (sample,), _ = aggregate_triplets(three_turns(), "trajectory")
    assert sample.response_logprobs is not None and sample.response_mask is not None
    assert len(sample.response_logprobs) == len(sample.response_token_ids) == len(sample.response_mask)
    generated = [lp for lp, m in zip(sample.response_logprobs, sample.response_mask, strict=True) if m == 1]
    assert generated == [lp for c in three_turns() for lp in c.response_logprobs or []]
    assert all(lp == 0.0 for lp, m in zip(sample.response_logprobs, sample.response_mask, strict=True) if m == 0)


def test_each_sample_takes_its_last_calls_reward() -> None:
    c1 = call(PROMPT, [20], span="a", reward=0.25)
    c2 = call([*PROMPT, 20, 30], [21], span="b")  # merged: no reward of its own
    c3 = call([5, 6], [22], span="c", reward=0.75)  # branch
    samples, _ = aggregate_triplets([c1, c2, c3], "trajectory")
    assert [s.reward for s in samples] == [None, 0.75]


def test_records_without_span_ids_take_the_span_id_of_their_metadata() -> None:
    old = [c.model_copy(update={"span_ids": []}) for c in three_turns()]
    (sample,), _ = aggregate_triplets(old, "trajectory")
    assert sample.span_ids == ["s1", "s2", "s3"]


# ---------------------------------------------------------------------------------------------
# transition mode, and a property over random traces
# ---------------------------------------------------------------------------------------------


def test_transition_mode_is_the_calls_unchanged() -> None:
    calls = three_turns()
    samples, breaks = aggregate_triplets(calls, "transition")
    assert samples == calls and breaks == Counter()
    assert all(s.response_mask is None and s.calls == 1 for s in samples)


def test_an_unknown_aggregation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate_triplets(three_turns(), "episode")  # type: ignore[arg-type]


def _random_trace(rng: random.Random) -> list[Triplet]:
    """Calls that mostly continue the conversation, sometimes drift, truncate or branch."""
    calls: list[Triplet] = []
    context = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
    for index in range(rng.randint(0, 8)):
        roll = rng.random()
        if calls and roll < 0.1:
            context = [rng.randrange(100) for _ in range(rng.randint(1, 6))]  # another agent
        elif calls and roll < 0.2 and len(context) > 2:
            context = context[: rng.randint(1, len(context) - 1)]  # truncated
        elif calls and roll < 0.3:
            context[rng.randrange(len(context))] += 1000  # drift
        prompt = list(context)
        response = [1000 + rng.randrange(100) for _ in range(rng.randint(1, 4))]
        calls.append(call(prompt, response, span=f"s{index}", logprobs=[-rng.random() for _ in response]))
        context = prompt + response + [2000 + rng.randrange(100) for _ in range(rng.randint(0, 3))]
    return calls


@pytest.mark.parametrize("seed", range(200))
def test_generated_tokens_are_exactly_the_calls_responses(seed: int) -> None:
    calls = _random_trace(random.Random(seed))
    samples, breaks = aggregate_triplets(calls, "trajectory")
    generated = [
        token for s in samples for token, m in zip(s.response_token_ids, s.response_mask or [], strict=True) if m == 1
    ]
    assert generated == [token for c in calls for token in c.response_token_ids]
    assert [span for s in samples for span in s.span_ids] == [c.span_ids[0] for c in calls]
    assert sum(s.calls for s in samples) == len(calls)
    assert sum(breaks.values()) == max(len(samples) - 1, 0)
    for sample in samples:  # each sample's sequence is its last call's whole context
        last = calls[[c.span_ids[0] for c in calls].index(sample.span_ids[-1])]
        assert sample.prompt_token_ids + sample.response_token_ids == (last.prompt_token_ids + last.response_token_ids)
    assert aggregate_triplets(calls, "trajectory") == (samples, breaks)  # deterministic


# ---------------------------------------------------------------------------------------------
# The adapter's setting, and the wire
# ---------------------------------------------------------------------------------------------


def _llm_span(span_id: str, start: float, prompt: list[int], response: list[int]) -> dict[str, Any]:
    return {
        "rollout_id": "ro-1",
        "attempt_id": "at-1",
        "sequence_id": int(start),
        "trace_id": "t1",
        "span_id": span_id,
        "parent_id": None,
        "name": "openai.chat.completion",
        "start_time": start,
        "end_time": start + 0.5,
        "attributes": {"prompt_token_ids": prompt, "response_token_ids": response, "gen_ai.response.id": span_id},
    }


def _spans() -> list[Span]:
    datums = [
        _llm_span("c1", 1, PROMPT, [20, 21]),
        _llm_span("c2", 2, [*PROMPT, 20, 21, 30], [22]),
        _llm_span("c3", 3, [7, 8], [23]),
    ]
    return [Span.model_validate(d) for d in datums]


def test_the_adapter_fills_span_ids_and_keeps_one_triplet_per_call_by_default() -> None:
    result = extract_triplets(_spans())
    assert AdapterConfig().aggregation == "transition"
    assert [t.span_ids for t in result.triplets] == [["c1"], ["c2"], ["c3"]]
    assert all(t.response_mask is None and t.calls == 1 for t in result.triplets)
    assert result.breaks == Counter()


def test_the_adapter_merges_calls_with_aggregation_trajectory() -> None:
    result = extract_triplets(_spans(), AdapterConfig(aggregation="trajectory"))
    assert [t.span_ids for t in result.triplets] == [["c1", "c2"], ["c3"]]
    assert result.triplets[0].response_token_ids == [20, 21, 30, 22]
    assert result.triplets[0].response_mask == [1, 1, 0, 1]
    assert result.breaks == Counter({BRANCH: 1})
    assert result.triplets == aggregate_triplets(extract_triplets(_spans()).triplets).samples


TRIPLET_RECORD_BEFORE_MASKS = "schemas/history/TripletRecord.d2b8b01ba418cc72.avsc"
"""The TripletRecord release before response masks and lineage (it carries the mode)."""


def test_records_written_before_masks_and_lineage_read_with_defaults() -> None:
    old_schema = json.loads(resource_path(TRIPLET_RECORD_BEFORE_MASKS).read_text())
    old_triplet = next(f for f in old_schema["fields"] if f["name"] == "triplets")["type"]["items"]
    assert {f["name"] for f in old_triplet["fields"]} == {
        "prompt_token_ids",
        "response_token_ids",
        "response_logprobs",
        "reward",
        "metadata",
        "prompt_extra",
        "response_extra",
    }
    writer = Codec(Contract.from_schemas([old_schema]), models={})
    datum = {
        "rollout_id": "ro-1",
        "attempt_id": "at-1",
        "group_id": "g",
        "triplets": [
            {
                "prompt_token_ids": [1, 2],
                "response_token_ids": [3],
                "response_logprobs": [-0.5],
                "reward": 1.0,
                "metadata": {"span_id": "s1"},
            }
        ],
        "finish_time": 1.0,
    }
    data = writer.encode_dict("agl.TripletRecord", datum)
    record = Codec.default().decode(data, TripletRecord)
    (triplet,) = record.triplets
    assert triplet.prompt_token_ids == [1, 2] and triplet.response_logprobs == [-0.5]
    assert triplet.response_mask is None and triplet.span_ids == [] and triplet.calls == 1
    # ... and aggregate with the lineage their metadata gives.
    assert aggregate_triplets(record.triplets).samples[0].span_ids == ["s1"]


def test_new_records_round_trip_and_old_readers_skip_the_new_fields() -> None:
    (sample,), _ = aggregate_triplets(three_turns(), "trajectory")
    record = TripletRecord(rollout_id="ro-1", attempt_id="at-1", group_id="g", triplets=[sample], finish_time=1.0)
    data = Codec.default().encode(record)
    assert Codec.default().decode(data, TripletRecord) == record
    current = Codec.default().contract.schema("TripletRecord").expanded
    old_schema = json.loads(resource_path(TRIPLET_RECORD_BEFORE_MASKS).read_text())
    old_reader = Codec(Contract.from_schemas([old_schema], [current]), models={})  # new snapshot shipped first
    name, old = old_reader.decode_dict(data)
    assert name == "agl.TripletRecord"
    assert old["triplets"][0]["response_token_ids"] == sample.response_token_ids
    assert "response_mask" not in old["triplets"][0]


# ---------------------------------------------------------------------------------------------
# Off-policy data: the serving version of every call, and the engine's logprobs
# ---------------------------------------------------------------------------------------------

TRIPLET_BEFORE_VERSIONS = "schemas/history/Triplet.63631660c0e2087c.avsc"
"""The Triplet release before per-call serving versions (it has masks and lineage)."""


def _served(span_id: str, start: float, prompt: list[int], response: list[int], version: Any) -> dict[str, Any]:
    """An LLM call as the proxy records it: the engine's logprobs and the serving version."""
    datum = _llm_span(span_id, start, prompt, response)
    logprobs: list[dict[str, Any]] = [
        {"token": f"t{t}", "logprob": -0.01 * t, "bytes": None, "top_logprobs": []} for t in response
    ]
    datum["attributes"]["logprobs.content"] = json.dumps(logprobs)
    if version is not None:
        datum["attributes"][POLICY_VERSION] = version
    return datum


def _served_spans(versions: tuple[Any, Any, Any] = (3, 4, 4)) -> list[Span]:
    datums = [
        _served("c1", 1, PROMPT, [20, 21], versions[0]),
        _served("c2", 2, [*PROMPT, 20, 21, 30, 31], [22], versions[1]),  # two tool tokens inserted
        _served("c3", 3, [*PROMPT, 20, 21, 30, 31, 22, 32], [23, 24], versions[2]),
    ]
    return [Span.model_validate(d) for d in datums]


def test_every_call_keeps_the_version_that_served_it_in_transition_mode() -> None:
    result = extract_triplets(_served_spans())
    assert [t.policy_versions for t in result.triplets] == [[3], [4], [4]]
    assert [t.response_logprobs for t in result.triplets] == [[-0.2, -0.21], [-0.22], [-0.23, -0.24]]
    assert not result.issues


def test_a_merged_sample_keeps_one_version_per_call_and_logprobs_for_every_response_token() -> None:
    (sample,) = extract_triplets(_served_spans(), AdapterConfig(aggregation="trajectory")).triplets
    assert sample.calls == 3 and sample.policy_versions == [3, 4, 4]
    assert sample.response_token_ids == [20, 21, 30, 31, 22, 32, 23, 24]
    assert sample.response_mask == [1, 1, 0, 0, 1, 0, 1, 1]
    # the engine's logprob on every generated token, the 0.0 placeholder on every inserted one
    assert sample.response_logprobs == [-0.2, -0.21, 0.0, 0.0, -0.22, 0.0, -0.23, -0.24]


def test_a_call_without_a_version_or_with_a_malformed_one_is_none_and_the_rest_stand() -> None:
    result = extract_triplets(_served_spans((None, "4", -1)), AdapterConfig(aggregation="trajectory"))
    (sample,) = result.triplets
    assert sample.policy_versions == [None, None, None]
    assert sample.response_logprobs is not None  # the sample and its logprobs stand
    assert [i.split(": ", 1)[1] for i in result.issues] == [
        f"policy version dropped: {POLICY_VERSION} '4' is not a non-negative integer",
        f"policy version dropped: {POLICY_VERSION} -1 is not a non-negative integer",
    ]


def test_the_replays_lean_spans_carry_the_version_too() -> None:
    # The replay reads spans from record bytes keeping only the adapter's keys (lean.py): the
    # version must be one of them, or a replay would lose it.
    spans = _served_spans()
    lean = [lean_span(s) for s in spans]
    assert [s.attributes[POLICY_VERSION] for s in lean] == [3, 4, 4]
    assert extract_triplets(lean).triplets == extract_triplets(spans).triplets


def test_aggregating_records_written_before_versions_gives_none_per_call() -> None:
    old = [c.model_copy(update={"policy_versions": []}) for c in three_turns()]
    (sample,), _ = aggregate_triplets(old, "trajectory")
    assert sample.policy_versions == [None, None, None] and sample.calls == 3
    versioned = [c.model_copy(update={"policy_versions": [v]}) for c, v in zip(three_turns(), (5, 5, 6), strict=True)]
    (sample,), _ = aggregate_triplets(versioned, "trajectory")
    assert sample.policy_versions == [5, 5, 6]


def test_triplets_written_before_versions_read_with_none_and_old_readers_skip_them() -> None:
    old_schema = json.loads(resource_path(TRIPLET_BEFORE_VERSIONS).read_text())
    assert "policy_versions" not in {f["name"] for f in old_schema["fields"]}
    current = Codec.default().contract.schema("Triplet").expanded
    check_compatible(old_schema, current)  # both directions
    writer = Codec(Contract.from_schemas([old_schema]), models={})
    old_datum = {"prompt_token_ids": [1], "response_token_ids": [2], "metadata": {}, "span_ids": ["s"]}
    data = writer.encode_dict("agl.Triplet", old_datum)
    assert Codec.default().decode(data, Triplet).policy_versions == []
    new = Triplet(prompt_token_ids=[1], response_token_ids=[2, 3], calls=2, policy_versions=[None, 7])
    encoded = Codec.default().encode(new)
    assert Codec.default().decode(encoded, Triplet) == new
    old_reader = Codec(Contract.from_schemas([old_schema], [current]), models={})
    _, read = old_reader.decode_dict(encoded)
    assert "policy_versions" not in read and read["calls"] == 2


def test_the_fast_record_encoder_writes_versions_as_the_codec_does() -> None:
    samples = extract_triplets(_served_spans((2, None, 9)), AdapterConfig(aggregation="trajectory")).triplets
    record = TripletRecord(rollout_id="ro-1", attempt_id="at-1", group_id="g", triplets=samples, finish_time=1.0)
    encoder = TripletRecordEncoder(Codec.default())
    assert encoder.fast and encoder.encode(record) == Codec.default().encode(record)
    assert Codec.default().decode(encoder.encode(record), TripletRecord).triplets[0].policy_versions == [2, None, 9]

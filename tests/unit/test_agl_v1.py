"""Agent Lightning 1.0's protocol mapped onto the store (agl_stream/domain/agl_v1.py): pure rules."""

from __future__ import annotations

import math
from typing import Any

import pytest

from agl_stream.agent.emitters import get_reward_value
from agl_stream.domain import agl_v1
from agl_stream.domain.agl_v1 import EventCreate, RolloutCreate, StatusPatch, TransitionConflict
from agl_stream.domain.llm_calls import CHAT, LLMCall, build_span, error_of_status


def _created(**fields: Any) -> tuple[Any, dict[str, Any]]:
    create = RolloutCreate.model_validate({"input": {"data_id": "d1", "q": 1}, **fields})
    rollout = agl_v1.new_rollout(create, "abc", 100.0)
    return rollout, agl_v1.view(rollout, None)


def test_a_created_rollout_reads_back_as_1_0_wrote_it() -> None:
    config = {"timeout_seconds": 60, "local": {"agent_class": "m:A", "env_map": {"Q": "input.q"}}}
    rollout, view = _created(is_train=False, config=config, metadata={"batch_idx": 3, "tag": "x"})
    assert rollout.mode == "val" and rollout.status == "queuing" and agl_v1.is_v1(rollout)
    assert rollout.config.timeout_seconds is None and rollout.config.max_attempts == 1  # 1.0's controller decides
    assert view == {
        "rollout_id": "abc",
        "input": {"data_id": "d1", "q": 1},
        "is_train": False,
        "config": {**config, "k8s": None},
        "metadata": {"batch_idx": 3, "sample_idx_in_batch": None, "tag": "x"},
        "status": {
            "state": "queuing",
            "k8s_job_name": None,
            "last_attempt_id": None,
            "error_message": None,
            "version": 1,
            "created_at": 100.0,
            "updated_at": 100.0,
        },
    }
    assert agl_v1.data_id_of(rollout.input) == "d1" and agl_v1.data_id_of([1]) == ""


def test_the_store_status_and_the_patches_decide_the_state() -> None:
    assert agl_v1.state_of("running", {}) == "queuing"  # spans arrived before the controller's PATCH
    assert agl_v1.state_of("running", {"state": "running"}) == "running"
    assert agl_v1.state_of("preparing", {"state": "running"}) == "running"
    assert agl_v1.state_of("succeeded", {"state": "running"}) == "succeeded"
    assert agl_v1.state_of("cancelled", {"state": "running"}) == "failed"
    rollout, _ = _created()
    cancelled = rollout.model_copy(update={"status": "cancelled", "end_time": 150.0})
    view = agl_v1.view(cancelled, {agl_v1.V1_KEY: {"state": "running", "version": 2, "updated_at": 120.0}})
    assert view["status"]["state"] == "failed" and "cancelled" in view["status"]["error_message"]
    assert view["status"]["updated_at"] == 150.0 and view["status"]["version"] == 2


def test_patches_follow_1_0s_transitions() -> None:
    running = agl_v1.patched("r", "queuing", {}, StatusPatch(state="running", last_attempt_id="0"), 5.0)
    assert running == ("running", {"state": "running", "last_attempt_id": "0", "version": 2, "updated_at": 5.0})
    _, lifecycle = running
    status, done = agl_v1.patched("r", "running", lifecycle, StatusPatch(state="failed", error_message="x"), 6.0)  # type: ignore[misc]
    assert status == "failed" and done["error_message"] == "x" and done["version"] == 3
    assert agl_v1.patched("r", "running", lifecycle, StatusPatch(k8s_job_name="job-1"), 7.0) == (
        None,
        {**lifecycle, "k8s_job_name": "job-1", "version": 3, "updated_at": 7.0},
    )
    assert agl_v1.patched("r", "queuing", {}, StatusPatch(), 5.0) is None
    for state, target in [("running", "running"), ("queuing", "succeeded"), ("failed", "running")]:
        with pytest.raises(TransitionConflict, match=f"cannot transition {state} -> {target}"):
            agl_v1.patched("r", state, {}, StatusPatch(state=target), 5.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StatusPatch.model_validate({"colour": "red"})


def test_posted_events_are_spans_and_a_reward_is_scored() -> None:
    span = agl_v1.event_span("r", "0", 4, EventCreate(event_type="reward", data={"value": 0.25, "source": "s"}), 9.0)
    assert get_reward_value(span) == 0.25 and span.sequence_id == 4
    [event] = agl_v1.events_of([span])
    assert event == {
        "event_type": "reward",
        "rollout_id": "r",
        "attempt_id": "0",
        "timestamp": 9.0,
        "data": {"value": 0.25, "source": "s"},
    }
    for value in (True, "1", None):  # not a number: kept as the event, not scored
        odd = agl_v1.event_span("r", "0", 5, EventCreate(event_type="reward", data={"value": value}), 9.0)
        assert get_reward_value(odd) is None and agl_v1.events_of([odd])[0]["data"] == {"value": value}
    note = agl_v1.event_span("r", "0", 6, EventCreate(event_type="note", data={"x": [1, {"y": None}]}), 9.0)
    assert agl_v1.events_of([note])[0]["data"] == {"x": [1, {"y": None}]}


def test_a_proxy_span_reads_back_as_a_model_request_and_its_triplet() -> None:
    request = {
        "model": "m",
        "temperature": 0.5,
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
        ],
    }
    response = {
        "id": "cmpl-1",
        "model": "m",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "2"},
                "finish_reason": "stop",
                "token_ids": [7, 8],
                "logprobs": {"content": [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}]},
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    call = LLMCall(CHAT, request, 10.0, 10.25, response=response, backend="http://b/v1", policy_version=3)
    span = build_span(call, rollout_id="r", attempt_id="0", sequence_id=1)
    [event] = agl_v1.events_of([span])
    data = event["data"]
    assert event["event_type"] == "model_request" and data["request"]["messages"] == [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    assert data["request"]["temperature"] == 0.5 and data["status"] == "ok" and data["http_status"] == 200
    assert data["server"] == {"model": "m", "endpoint": "http://b/v1", "version": 3}
    assert data["latency_ms"] == 250.0 and data["usage"]["total_tokens"] == 5
    [triplet] = agl_v1.triplet_events([event])
    assert triplet["data"] == {
        "prompt_token_ids": [1, 2, 3],
        "response_token_ids": [7, 8],
        "response_log_probs": [-0.5, -1.0],
        "server": {"model": "m", "version": 3},
        "http_status": 200,
        "status": "ok",
    }
    failed = build_span(
        LLMCall(CHAT, request, 1.0, 2.0, error=error_of_status(503, "down")),
        rollout_id="r",
        attempt_id="0",
        sequence_id=2,
    )
    [bad] = agl_v1.triplet_events(agl_v1.events_of([failed]))
    assert (
        bad["data"]["status"] == "error"
        and bad["data"]["http_status"] == 503
        and bad["data"]["response_token_ids"] == []
    )


def _request(prompt: Any, answer: list[int], logprobs: Any = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"token_ids": answer}
    if logprobs is not None:
        choice["logprobs"] = logprobs
    return {"event_type": "model_request", "data": {"response": {"prompt_token_ids": prompt, "choices": [choice]}}}


def test_the_triplet_view_keeps_the_last_request_per_prompt_and_every_one_without_ids() -> None:
    events = [
        _request([1, 2], [3]),
        {"event_type": "reward", "data": {"value": 1, "message": "dropped", "reason": "kept"}},
        _request([1, 2], [4]),
        _request([], [5]),
        _request([], [6]),
        _request([True, 2], [7]),  # a bool is not a token id
        _request([True, 2], [8]),
    ]
    kept = agl_v1.triplet_events(events)
    assert [e["data"].get("response_token_ids") for e in kept] == [None, [4], [5], [6], [7], [8]]
    assert kept[0]["data"] == {"value": 1, "reason": "kept"}


@pytest.mark.parametrize(
    ("logprobs", "expected"),
    [
        ({"content": [{"logprob": -1}, {"logprob": -2.5}]}, [-1.0, -2.5]),
        ({"token_logprobs": [-0.5]}, [-0.5]),
        ({"content": [{"logprob": -1}, {"token": "x"}]}, None),
        ({"content": [{"logprob": math.inf}]}, None),
        ({"content": [{"logprob": "nan"}]}, None),
        ("nonsense", None),
    ],
)
def test_logprobs_are_all_finite_or_none(logprobs: Any, expected: list[float] | None) -> None:
    [event] = agl_v1.triplet_events([_request([1], [2], logprobs)])
    assert event["data"]["response_log_probs"] == expected


def test_routed_experts_go_when_asked() -> None:
    event = _request([1], [2])
    event["data"]["routed_experts"] = "AAAA"
    [trimmed] = agl_v1.triplet_events([event])
    assert trimmed["data"]["routed_experts"] == "AAAA"
    [without] = agl_v1.without_routed_experts([trimmed])
    assert "routed_experts" not in without["data"] and trimmed["data"]["routed_experts"] == "AAAA"


def test_ids_a_caller_may_choose() -> None:
    assert RolloutCreate(rollout_id="0f" * 16).rollout_id == "0f" * 16
    for bad in ("", "../etc", "a b", "x" * 129, "-lead"):
        with pytest.raises(ValueError):
            RolloutCreate(rollout_id=bad)

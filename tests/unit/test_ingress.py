"""The pure ingress rules: validation, ids, the enqueue event, new / already enqueued / conflict."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest

from agl_stream.domain.fold import fold
from agl_stream.domain.ingress import (
    AlreadyEnqueued,
    HeldRequest,
    IngressLimits,
    InvalidTaskRequestError,
    KeyMismatchError,
    RecentRequests,
    RequestConflictError,
    TaskRequestTooLargeError,
    check_key,
    classify,
    decode_request,
    enqueue_event,
    event_id_for,
    held_from_rows,
    input_digest,
    is_copy,
    legacy_rollout_id_for,
    line_request_id,
    request_from_json,
    request_from_line,
    rollout_id_for,
    stored_for,
    stored_rollouts_query,
    validate_request,
)
from agl_stream.errors import MalformedRecordError, NotSingleObjectEncodedError, RecordTypeError
from agl_stream.ids import is_rollout_id
from agl_stream.models import RolloutEnqueued, TaskRequest, Worker
from agl_stream.wire.codec import Codec

CODEC = Codec.default()
LIMITS = IngressLimits(max_input_bytes=1000, max_metadata_bytes=100)


def _request(**overrides: Any) -> dict[str, Any]:
    datum: dict[str, Any] = {
        "request_id": "req-1",
        "input": {"question": "2+2?"},
        "mode": "train",
        "resources_id": None,
        "config": {"timeout_seconds": 30.0, "unresponsive_seconds": None, "max_attempts": 2, "retry_condition": []},
        "metadata": {"source": "crm"},
        "request_time": 1.5,
    }
    datum.update(overrides)
    return datum


# Two request ids whose first 48 bits of SHA-256 agree (found by a birthday search over
# "legacy-<n>", about a minute of CPU): the first version gave both rollout ro-ffa9082b3c38.
COLLIDING = ("legacy-4100084", "legacy-39543213")


def test_rollout_id_is_the_documented_digest() -> None:
    expected = "ro-" + hashlib.sha256(b"req-1").hexdigest()[:32]
    assert rollout_id_for("req-1") == expected and len(expected) == 35
    assert is_rollout_id(expected)
    assert rollout_id_for("réq-ü") == "ro-" + hashlib.sha256("réq-ü".encode()).hexdigest()[:32]
    assert rollout_id_for("req-1") != rollout_id_for("req-2")
    assert event_id_for("req-1") == event_id_for("req-1") != event_id_for("req-2")
    assert rollout_id_for("order-1234") == "ro-71983129e5088fcbbb2be5a2e186253a"  # docs/contract.md
    # The first version's ids: 12 hex of the same digest, still rollout ids.
    assert legacy_rollout_id_for("req-1") == expected[:15] and is_rollout_id(expected[:15])


@pytest.mark.parametrize("value", ["ro-" + "a" * 20, "ro-" + "A" * 32, "ro-" + "a" * 33, "ro-", "rx-" + "a" * 32])
def test_other_shapes_are_no_rollout_ids(value: str) -> None:
    assert not is_rollout_id(value)


def test_colliding_request_ids_of_the_first_version_get_distinct_rollouts() -> None:
    a, b = COLLIDING
    assert a != b and legacy_rollout_id_for(a) == legacy_rollout_id_for(b)
    assert rollout_id_for(a) != rollout_id_for(b)


def _req(request_id: str = "req-1", **overrides: Any) -> TaskRequest:
    return validate_request(_request(request_id=request_id, **overrides), LIMITS)


def test_a_new_request_is_new() -> None:
    assert classify(_req(), None) is None


def test_a_copy_is_already_enqueued_not_an_error() -> None:
    request = _req()
    answer = classify(_req(request_time=99.0, metadata={"other": 1}), HeldRequest.of(request))
    assert answer == AlreadyEnqueued("req-1", rollout_id_for("req-1"))
    assert str(answer).startswith("already enqueued: request_id 'req-1' is rollout ro-")
    # Known from ClickHouse only (the input, no request id): the same answer.
    assert classify(request, HeldRequest(rollout_id_for("req-1"), input_digest(request.input))) == answer


def test_a_reused_request_id_with_another_input_is_refused() -> None:
    held = HeldRequest.of(_req())
    with pytest.raises(RequestConflictError, match=r"was already enqueued as rollout ro-.* with a different input"):
        classify(_req(input={"question": "3+3?"}), held)
    stored = HeldRequest(held.rollout_id, held.input_digest)  # as ClickHouse tells it
    with pytest.raises(RequestConflictError, match="different input"):
        classify(_req(input="other"), stored)


def test_a_collision_of_rollout_ids_is_refused_even_with_the_same_input() -> None:
    first = _req("req-1")
    # What the rollout holds names another request id (as a collision in 128 bits would).
    held = HeldRequest(rollout_id_for("req-2"), input_digest(first.input), hashlib.sha256(b"req-1").digest())
    with pytest.raises(RequestConflictError, match="rollout id collision: request_id 'req-2' derives rollout"):
        classify(_req("req-2"), held)


def test_a_legacy_rollout_counts_only_with_the_same_input() -> None:
    a, b = COLLIDING
    legacy = HeldRequest(legacy_rollout_id_for(a), input_digest(_req(a).input), legacy=True)
    assert classify(_req(a), legacy) == AlreadyEnqueued(a, legacy_rollout_id_for(a))
    # Another request that collided with it in 48 bits is new: its own 32-hex id is free.
    assert classify(_req(b, input="another task"), legacy) is None


def test_stored_rollouts_query_and_rows() -> None:
    sql, parameters = stored_rollouts_query("agl", ["req-1", "req-2"])
    assert "FROM agl.rollouts FINAL" in sql and "SHA256(input)" in sql
    expected = {rollout_id_for(i) for i in ("req-1", "req-2")} | {legacy_rollout_id_for(i) for i in ("req-1", "req-2")}
    assert set(parameters["ids"]) == expected and parameters["digest"] == 16
    # ClickHouse hashes the stored JSON text, which is the codec's: the same digest as here.
    text = json.dumps({"question": "2+2?"}, sort_keys=True, separators=(",", ":"))
    row_digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    held = held_from_rows([[rollout_id_for("req-1"), row_digest], [legacy_rollout_id_for("req-2"), row_digest]])
    assert held[rollout_id_for("req-1")] == HeldRequest(rollout_id_for("req-1"), input_digest({"question": "2+2?"}))
    assert held[legacy_rollout_id_for("req-2")].legacy
    assert stored_for(held, "req-1") is held[rollout_id_for("req-1")]
    assert stored_for(held, "req-2") is held[legacy_rollout_id_for("req-2")]
    assert stored_for(held, "req-3") is None


def test_valid_request_passes_unchanged() -> None:
    request = validate_request(_request(), LIMITS)
    assert request.input == {"question": "2+2?"}
    assert request.config is not None and request.config.max_attempts == 2
    assert request.metadata == {"source": "crm"}


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"request_id": ""}, "request_id must be 1 to 128"),
        ({"request_id": "has space"}, "printable ASCII"),
        ({"request_id": "x" * 129}, "request_id must be 1 to 128"),
        ({"request_id": 7}, "request_id must be a string"),
        ({"mode": "prod"}, "mode must be one of train, val, test"),
        ({"metadata": ["a"]}, "metadata must be a JSON object"),
        ({"input": float("nan")}, "input is not valid JSON"),
        ({"config": {"max_attempts": 0}}, "max_attempts must be an integer from 1"),
        ({"config": {"max_attempts": True}}, "max_attempts"),
        ({"config": {"timeout_seconds": 0}}, "timeout_seconds must be a positive number"),
        ({"config": {"unresponsive_seconds": -1.0}}, "unresponsive_seconds"),
        ({"config": {"timeout_seconds": float("inf")}}, "timeout_seconds"),
        ({"config": {"retry_condition": ["succeeded"]}}, "retry_condition may hold only failed, timeout, unresponsive"),
        ({"config": {"retry_condition": ["boom"]}}, "'boom'"),
        ({"config": "fast"}, "config must be an object"),
        ({"request_time": float("nan")}, "request_time must be a finite number"),
        ({"extra": 1}, "extra: Extra inputs are not permitted"),
    ],
)
def test_invalid_requests_are_refused_with_the_reason(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidTaskRequestError, match=match):
        validate_request(_request(**overrides), LIMITS)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(InvalidTaskRequestError) as caught:
        validate_request(_request(mode="x", config={"max_attempts": 0}), LIMITS)
    assert "mode" in str(caught.value) and "max_attempts" in str(caught.value)


def test_missing_input_is_refused() -> None:
    datum = _request()
    del datum["input"]
    with pytest.raises(InvalidTaskRequestError, match="input is missing"):
        validate_request(datum, LIMITS)


def test_size_limits_count_json_bytes() -> None:
    # {"q":"..."} is 8 bytes of framing: exactly at the limit passes, one more byte does not.
    validate_request(_request(input={"q": "x" * (1000 - 8)}), LIMITS)
    with pytest.raises(TaskRequestTooLargeError, match="input is 1,001 bytes of JSON, over the 1,000-byte limit"):
        validate_request(_request(input={"q": "x" * (1000 - 7)}), LIMITS)
    with pytest.raises(TaskRequestTooLargeError, match="metadata is"):
        validate_request(_request(metadata={"k": "é" * 60}), LIMITS)  # 2 bytes per character


def test_decode_request_from_avro_bytes() -> None:
    data = CODEC.encode(TaskRequest.model_validate(_request()))
    assert decode_request(CODEC, data, LIMITS).request_id == "req-1"
    with pytest.raises(NotSingleObjectEncodedError):
        decode_request(CODEC, b"{json: no}", LIMITS)
    with pytest.raises(MalformedRecordError):
        decode_request(CODEC, data[:-3], LIMITS)
    with pytest.raises(RecordTypeError, match=r"agl\.task-requests carries only task requests"):
        decode_request(CODEC, CODEC.encode(Worker(worker_id="w")), LIMITS)
    # Avro enums and types are checked by the decoder; config sanity by the rules.
    bad = CODEC.encode_dict("agl.TaskRequest", {**_request(), "config": {**_request()["config"], "max_attempts": 0}})
    with pytest.raises(InvalidTaskRequestError, match="max_attempts"):
        decode_request(CODEC, bad, LIMITS)


def test_key_must_be_the_request_id() -> None:
    request = validate_request(_request(), LIMITS)
    check_key(b"req-1", request)
    with pytest.raises(KeyMismatchError, match="no key"):
        check_key(None, request)
    with pytest.raises(KeyMismatchError, match="is not the request_id"):
        check_key(b"other", request)


def test_enqueue_event_folds_into_a_queued_rollout() -> None:
    request = validate_request(_request(), LIMITS)
    event = enqueue_event(request, now=100.0)
    assert isinstance(event.payload, RolloutEnqueued)
    assert event.rollout_id == rollout_id_for("req-1") == event.payload.rollout.rollout_id
    result = fold(None, event)
    assert result.outcome == "applied" and result.state is not None
    rollout = result.state.rollout
    assert (rollout.status, rollout.input, rollout.mode, rollout.start_time) == (
        "queuing",
        request.input,
        "train",
        100.0,
    )
    assert rollout.config.timeout_seconds == 30.0 and rollout.metadata == {"source": "crm"}
    assert result.state is not None and result.state.attempts == []
    # The same request again: a copy, answered by the fold without a change (no dead letter).
    again = fold(result.state, enqueue_event(request, now=200.0))
    assert again.outcome == "ignored" and again.state is None and again.error is None
    assert CODEC.encode(enqueue_event(request, now=1.0)) == CODEC.encode(enqueue_event(request, now=1.0))


def test_null_config_gets_the_defaults() -> None:
    event = enqueue_event(validate_request(_request(config=None), LIMITS), now=1.0)
    assert isinstance(event.payload, RolloutEnqueued)
    assert event.payload.rollout.config.max_attempts == 1


def test_json_requests_and_file_lines() -> None:
    assert request_from_json({"input": 1}, LIMITS, default_request_id="gen").request_id == "gen"
    assert request_from_json({"input": 1, "request_id": "mine"}, LIMITS, default_request_id="gen").request_id == "mine"
    with pytest.raises(InvalidTaskRequestError, match="a task request is a JSON object"):
        request_from_json([1], LIMITS, default_request_id="gen")
    line = json.dumps({"input": {"q": 1}, "mode": "val"})
    first = request_from_line(line, 3, LIMITS)
    assert first.request_id == line_request_id(line, 3) == request_from_line(line + "\n", 3, LIMITS).request_id
    assert request_from_line(line, 4, LIMITS).request_id != first.request_id
    assert request_from_line(line, 3, LIMITS, salt="epoch-2").request_id != first.request_id
    assert len(first.request_id) <= 128
    with pytest.raises(InvalidTaskRequestError, match="not JSON"):
        request_from_line("{oops", 1, LIMITS)


def test_recent_requests_are_bounded_and_remember_what_each_rollout_holds() -> None:
    recent = RecentRequests(capacity=2)
    held = {i: HeldRequest.of(_req(i)) for i in ("a", "b", "c", "d")}
    for request_id in ("a", "b", "c"):
        recent.add(held[request_id])
    ro = {i: rollout_id_for(i) for i in held}
    assert ro["a"] not in recent and ro["b"] in recent and ro["c"] in recent and len(recent) == 2
    assert recent.held(ro["b"]) == held["b"] and recent.held(ro["a"]) is None
    recent.add(held["b"])  # refreshed: now the newest
    recent.add(held["d"])
    assert ro["b"] in recent and ro["c"] not in recent


def test_is_copy_tells_a_resent_enqueue_from_a_conflicting_one() -> None:
    """The rule the rollout processor would apply to an enqueue of a rollout it holds."""
    first = enqueue_event(_req(), 1.0).payload
    again = enqueue_event(_req(request_time=5.0, metadata={"x": 1}), 2.0).payload
    other = enqueue_event(_req(input="another task"), 2.0).payload
    another_id = enqueue_event(_req("req-2"), 2.0).payload
    assert isinstance(first, RolloutEnqueued) and isinstance(again, RolloutEnqueued)
    assert isinstance(other, RolloutEnqueued) and isinstance(another_id, RolloutEnqueued)
    assert is_copy(first.rollout, again.rollout)
    assert not is_copy(first.rollout, other.rollout)
    assert not is_copy(first.rollout, another_id.rollout)

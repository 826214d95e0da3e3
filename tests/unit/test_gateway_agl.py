"""``/v1/agl`` without a broker (consumers/gateway_agl.py, consumers/gateway_agl_shapes.py): the pure
mapping, and the answers the routes give before the store is asked (a gateway that was never run:
its store client is not up, so a valid request is answered 503 and every refusal comes from the
route itself)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from starlette.datastructures import QueryParams

from agl_stream.config import Settings
from agl_stream.store.replies import RejectedError
from consumers.gateway_agl_shapes import (
    ATTEMPT_NOT_NULL,
    ROLLOUT_NOT_NULL,
    AttemptChanges,
    Refusal,
    RolloutChanges,
    RolloutsQuery,
    SpansQuery,
    check_paging,
    explicit_changes,
    known_total,
    query_values,
    span_from_wire,
    store_refusal,
    validation_refusal,
)

BASE_URL = "http://127.0.0.1"


def seed_span(**extra: Any) -> dict[str, Any]:
    """A span as the seed's ``Span.model_dump(mode="json")`` writes it."""
    context = {"trace_id": "a" * 32, "span_id": "b" * 16, "is_remote": False, "trace_state": {}}
    return {
        "rollout_id": "ro-1",
        "attempt_id": "at-1",
        "sequence_id": 3,
        "trace_id": "a" * 32,
        "span_id": "b" * 16,
        "parent_id": None,
        "name": "step",
        "status": {"status_code": "OK", "description": None},
        "attributes": {"x": 1, "tags": ["a", "b"]},
        "events": [{"name": "ev", "attributes": {"k": "v"}, "timestamp": 1.5}],
        "links": [{"context": context, "attributes": None}],
        "start_time": 1.0,
        "end_time": 2.0,
        "context": context,
        "parent": None,
        "resource": {"attributes": {"service.name": "s"}, "schema_url": ""},
        **extra,
    }


# -- pure mapping ---------------------------------------------------------------------------------


def test_a_seed_span_maps_onto_ours_with_its_extras_dropped() -> None:
    span = span_from_wire(
        seed_span(
            kind="SpanKind.CLIENT",
            dropped_attributes=0,  # an extra the seed's model would keep
            status={"status_code": "OK", "description": None, "extra": 1},
            context={"trace_id": "a" * 32, "span_id": "b" * 16, "is_remote": False, "trace_state": {}, "x": 2},
        )
    )
    assert span.kind == "CLIENT" and span.sequence_id == 3 and span.attributes == {"x": 1, "tags": ["a", "b"]}
    assert span.links[0].attributes == {} and span.links[0].context.span_id == "b" * 16
    assert span.events[0].timestamp == 1.5 and span.status.status_code == "OK"
    assert span.resource.attributes == {"service.name": "s"}


def test_a_span_without_what_it_needs_is_refused() -> None:
    with pytest.raises(ValidationError):
        span_from_wire({k: v for k, v in seed_span().items() if k != "trace_id"})
    with pytest.raises(ValidationError):
        span_from_wire(seed_span(trace_id=""))
    with pytest.raises(ValidationError):
        span_from_wire(seed_span(span_id="s" * 129))
    # Ids need not be OpenTelemetry's hex: the seed's store takes any text.
    assert span_from_wire(seed_span(trace_id="t1", span_id="s1")).span_id == "s1"
    with pytest.raises(ValidationError):
        span_from_wire([1, 2])


@pytest.mark.parametrize(
    ("limit", "offset", "count", "total"),
    [
        (-1, 0, 0, 0),
        (-1, 0, 7, 7),
        (-1, 5, 3, 8),
        (-1, 5, 0, None),  # past the end: unknown
        (10, 0, 4, 4),
        (10, 20, 4, 24),
        (10, 0, 10, None),  # a full page: more may follow
        (1, 3, 0, None),
    ],
)
def test_a_page_tells_its_total_only_when_it_ends_before_its_limit(
    limit: int, offset: int, count: int, total: int | None
) -> None:
    assert known_total(limit, offset, count) == total


def test_paging_the_seed_refuses_is_refused() -> None:
    for limit, offset in ((0, 0), (-2, 0), (5, -1)):
        with pytest.raises(Refusal) as refused:
            check_paging(RolloutsQuery(limit=limit, offset=offset))
        assert refused.value.status == 400
    check_paging(RolloutsQuery(limit=-1, offset=0))
    check_paging(RolloutsQuery(limit=1, offset=9))


def test_only_the_fields_sent_change_and_some_cannot_be_null() -> None:
    body = RolloutChanges.model_validate({"metadata": None, "mode": "val"})
    assert explicit_changes(body, ROLLOUT_NOT_NULL) == {"metadata": None, "mode": "val"}
    with pytest.raises(Refusal, match="status cannot be null") as refused:
        explicit_changes(RolloutChanges.model_validate({"status": None}), ROLLOUT_NOT_NULL)
    assert refused.value.status == 400
    with pytest.raises(Refusal, match="metadata, worker_id cannot be null"):
        explicit_changes(AttemptChanges.model_validate({"worker_id": None, "metadata": None}), ATTEMPT_NOT_NULL)


def test_store_errors_map_to_not_found_or_rejected() -> None:
    assert store_refusal(RejectedError("unknown rollout id ro-x")) == (404, "not_found")
    assert store_refusal(RejectedError("unknown attempt id at-1 in rollout ro-x")) == (404, "not_found")
    assert store_refusal(ValueError("unknown attempt at-1 of rollout ro-x")) == (404, "not_found")
    assert store_refusal(ValueError("resources 'rs-1' do not exist")) == (404, "not_found")
    assert store_refusal(RejectedError("illegal transition succeeded -> running for attempt at-1")) == (
        400,
        "rejected",
    )
    assert store_refusal(ValueError("cannot sort Rollout by 'input'")) == (400, "rejected")


def test_query_parameters_become_fields_lists_where_lists_are_taken() -> None:
    params = QueryParams("status_in=failed&status_in=cancelled&limit=5&rollout_id_contains=ro&other=1")
    values = query_values(params, RolloutsQuery)
    assert values == {"status_in": ["failed", "cancelled"], "limit": "5", "rollout_id_contains": "ro"}
    assert RolloutsQuery.model_validate(values).limit == 5
    assert query_values(QueryParams("rollout_id=ro-1&attempt_id=latest"), SpansQuery) == {
        "rollout_id": "ro-1",
        "attempt_id": "latest",
    }


def test_validation_errors_read_like_fastapis_without_echoing_input() -> None:
    with pytest.raises(ValidationError) as error:
        RolloutsQuery.model_validate({"status_in": ["bogus"], "limit": "x"})
    refusal = validation_refusal(error.value, "query")
    assert refusal.status == 422 and refusal.kind == "invalid_request"
    assert {tuple(d["loc"]) for d in refusal.detail} == {("query", "status_in", 0), ("query", "limit")}
    assert all("input" not in d for d in refusal.detail)


# -- the routes, before the store ----------------------------------------------------------------


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from consumers.gateway import Gateway, create_app

    settings = Settings(data_dir=tmp_path_factory.mktemp("agl"), kafka_bootstrap="127.0.0.1:9", api_token=None)
    with TestClient(create_app(Gateway(settings, specs=())), base_url=BASE_URL) as test_client:
        yield test_client


def _error(response: Any, status: int, kind: str, *, route: bool = True) -> dict[str, Any]:
    """The error body; a route's carries the seed's ``detail`` too (the listener's guard does not)."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    assert body["error"] == kind and body["message"] and (not route or body["detail"]), body
    return body


def test_health_answers_as_the_seeds(client: TestClient) -> None:
    response = client.get("/v1/agl/health")
    assert response.status_code == 200 and response.json() == {"status": "ok"}


def test_bodies_that_are_not_what_a_route_takes_are_422(client: TestClient) -> None:
    body = _error(
        client.post("/v1/agl/queues/rollouts/enqueue", json={"rollouts": [{"mode": "bogus"}]}), 422, "invalid_request"
    )
    assert {tuple(d["loc"]) for d in body["detail"]} == {
        ("body", "rollouts", 0, "input"),
        ("body", "rollouts", 0, "mode"),
    }
    malformed = client.post(
        "/v1/agl/queues/rollouts/enqueue", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert _error(malformed, 422, "malformed_json")["detail"][0]["type"] == "json_invalid"
    _error(client.post("/v1/agl/queues/rollouts/enqueue"), 422, "invalid_request")
    _error(client.post("/v1/agl/waits/rollouts", json={"rollout_ids": "x"}), 422, "invalid_request")
    _error(client.post("/v1/agl/waits/rollouts", json={"rollout_ids": [], "timeout": -1}), 422, "invalid_request")
    _error(client.post("/v1/agl/resources", json={"x": {"resource_type": "nope"}}), 422, "invalid_request")
    _error(client.post("/v1/agl/spans", json={"name": "no ids"}), 422, "invalid_request")
    _error(client.get("/v1/agl/spans"), 422, "invalid_request")  # rollout_id is required
    _error(client.get("/v1/agl/rollouts", params={"status_in": "bogus"}), 422, "invalid_request")


def test_what_the_seed_refuses_with_400_is_400(client: TestClient) -> None:
    _error(client.get("/v1/agl/rollouts", params={"limit": "0"}), 400, "bad_request")
    _error(client.post("/v1/agl/rollouts/search", json={"offset": -1}), 400, "bad_request")
    _error(client.post("/v1/agl/rollouts/ro-1", json={"status": None}), 400, "bad_request")
    _error(client.post("/v1/agl/rollouts/ro-1/attempts/latest", json={"worker_id": None}), 400, "bad_request")
    _error(client.post("/v1/agl/workers/w-1", json={"heartbeat_stats": None}), 400, "bad_request")


def test_the_gateways_own_policy_still_holds(client: TestClient) -> None:
    text = client.post("/v1/agl/queues/rollouts/enqueue", content=b"{}", headers={"content-type": "text/plain"})
    _error(text, 415, "unsupported_media_type", route=False)
    assert client.get("/v1/agl/nope").status_code == 404


def test_valid_requests_wait_for_the_store_client_with_a_503(client: TestClient) -> None:
    for response in (
        client.post("/v1/agl/queues/rollouts/enqueue", json={"rollouts": [{"input": 1}]}),
        client.post("/v1/agl/queues/rollouts/dequeue"),  # no body: the seed's client sends none
        client.get("/v1/agl/rollouts/ro-1"),
        client.get("/v1/agl/statistics"),
    ):
        assert _error(response, 503, "unavailable") and response.headers["retry-after"] == "2"
    # Empty work needs no store: the seed's server answers these without asking its store.
    assert client.post("/v1/agl/queues/rollouts/enqueue", json={"rollouts": []}).status_code == 201
    assert client.post("/v1/agl/queues/rollouts/dequeue", json={"limit": 0}).json() == []

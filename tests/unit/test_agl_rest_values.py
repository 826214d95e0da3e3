"""Pure pieces of /v1/agl's hardening: finite JSON in and out, counting queries, integer ranges."""

from __future__ import annotations

import json

import pytest

from agl_stream.http_serving import FiniteJSONResponse, MalformedBodyError, all_finite, finite_or_null, parse_json
from agl_stream.store.queries import StoreQueries, count_of
from consumers.gateway_agl_shapes import Refusal, span_from_wire


def test_a_number_that_overflows_a_double_is_refused_with_the_body() -> None:
    for body in (b'{"x": 1e400}', b'[1, [2, {"y": -1E+309}]]', b'{"z": ' + b"9" * 400 + b".0}"):
        with pytest.raises(MalformedBodyError, match="not finite"):
            parse_json(body)
    assert parse_json(b'{"x": 1e300, "s": "1e400"}') == {"x": 1e300, "s": "1e400"}


def test_answers_render_stored_infinities_as_null() -> None:
    content = {"a": [1.5, float("inf")], "b": {"c": float("-inf"), "d": "x"}}
    assert not all_finite(content) and all_finite(finite_or_null(content))
    assert json.loads(bytes(FiniteJSONResponse(content).body)) == {"a": [1.5, None], "b": {"c": None, "d": "x"}}


def test_a_count_wraps_the_unpaged_query() -> None:
    query = StoreQueries().rollouts(status_in=["queuing"], rollout_id_contains="ro-")
    counted = count_of(query)
    assert counted.sql.startswith("SELECT count() AS total FROM (") and query.sql in counted.sql
    assert counted.parameters == query.parameters


def _span(**changes: object) -> dict[str, object]:
    return {
        "rollout_id": "ro-1",
        "attempt_id": "at-1",
        "sequence_id": 1,
        "trace_id": "0" * 32,
        "span_id": "0" * 16,
        "name": "s",
        **changes,
    }


@pytest.mark.parametrize(
    ("changes", "where"),
    [
        ({"sequence_id": -1}, ["body", "sequence_id"]),
        ({"sequence_id": 2**64}, ["body", "sequence_id"]),
        ({"attributes": {"big": 2**70}}, ["body", "attributes", "big"]),
        ({"events": [{"name": "e", "attributes": {"n": -(2**63) - 1}}]}, ["body", "events", 0, "attributes", "n"]),
    ],
)
def test_integers_a_record_cannot_hold_are_refused(changes: dict[str, object], where: list[object]) -> None:
    with pytest.raises(Refusal) as refused:
        span_from_wire(_span(**changes))
    assert refused.value.status == 422 and refused.value.detail[0]["loc"] == where


def test_integers_within_64_bits_pass() -> None:
    span = span_from_wire(_span(sequence_id=2**63 - 1, attributes={"n": -(2**63)}))
    assert span.attributes == {"n": -(2**63)}

"""Task ingress end to end: requests on agl.task-requests -> rollouts in ClickHouse, or agl.dlq.

Most tests use the shared stack (rollout processor, gateway with the embedded engine, ingress);
they isolate themselves by fresh request ids. The kill -9 test runs its own processor and
ingress on topics of its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import avro.io
import avro.schema
import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from agl_stream import AglStore, connect
from agl_stream.auth import auth_headers
from agl_stream.config import Settings
from agl_stream.domain.ingress import (
    WRITER,
    IngressLimits,
    enqueue_event,
    legacy_rollout_id_for,
    rollout_id_for,
    validate_request,
)
from agl_stream.kafka import admin
from agl_stream.kafka.offsets import committed_offsets, end_offsets
from agl_stream.local import monitor, stack
from agl_stream.local.processes import role_alive, role_environment, start_budget
from agl_stream.local.supervisor import RoleStatus, read_status
from agl_stream.models import LLM, DlqRecord, RolloutEnqueued, RolloutEvent, RolloutState, Worker
from agl_stream.models.rollouts import Rollout
from agl_stream.wire.codec import Codec
from tests.integration.helpers import dlq_records, read_to_end, start_role, stop_role

pytestmark = pytest.mark.asyncio

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
COLLIDING = ("legacy-4100084", "legacy-39543213")
"""Two request ids whose first 48 bits of SHA-256 agree (tests/unit/test_ingress.py)."""
CODEC = Codec.default()


# --------------------------------------------------------------------------------------------
# An external producer: the published schema file and the official avro package, no agl_stream
# --------------------------------------------------------------------------------------------


def _strip_logical_types(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {k: _strip_logical_types(v) for k, v in schema.items() if k != "logicalType"}
    if isinstance(schema, list):
        return [_strip_logical_types(v) for v in schema]
    return schema


class AvroTaskWriter:
    """What docs/contract.md tells a client in another language to do."""

    def __init__(self) -> None:
        [path] = sorted((SCHEMAS / "history").glob("TaskRequest.*.avsc"))
        text = path.read_text()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the avro package does not know logicalType json
            self.schema = avro.schema.parse(text)
            # The avro package keeps logicalType in its canonical form (the spec drops it), so
            # its fingerprint is taken without them; it must match the file name's.
            fingerprint = avro.schema.parse(json.dumps(_strip_logical_types(json.loads(text)))).fingerprint()
        assert fingerprint == bytes.fromhex(path.name.split(".")[1])[::-1]
        self.header = b"\xc3\x01" + fingerprint

    def encode(self, datum: dict[str, Any]) -> bytes:
        out = io.BytesIO()
        avro.io.DatumWriter(self.schema).write(datum, avro.io.BinaryEncoder(out))
        return self.header + out.getvalue()


def _datum(request_id: str, **overrides: Any) -> dict[str, Any]:
    datum: dict[str, Any] = {
        "request_id": request_id,
        "input": json.dumps({"question": "2+2?", "n": 4}),
        "mode": "train",
        "resources_id": None,
        "config": {"timeout_seconds": 60.0, "unresponsive_seconds": None, "max_attempts": 2, "retry_condition": []},
        "metadata": json.dumps({"source": "crm"}),
        "request_time": time.time(),
    }
    datum.update(overrides)
    return datum


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@pytest.fixture
async def store(stack_settings: Settings) -> AsyncIterator[AglStore]:
    async with connect(**stack_settings.model_dump(exclude_none=True)) as client:
        yield client


async def _produce(settings: Settings, records: Iterable[tuple[bytes | None, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=settings.bootstrap_servers, acks="all")
    await producer.start()
    try:
        futures = [await producer.send(settings.topic("task-requests"), value, key=key) for key, value in records]
        for future in futures:
            await future
    finally:
        await producer.stop()


async def _rollouts(store: AglStore, rollout_ids: list[str], *, timeout: float = 30.0) -> dict[str, Rollout]:
    """Wait until every rollout is readable from ClickHouse (through the gateway)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {r.rollout_id: r for r in await store.query_rollouts(rollout_id_in=rollout_ids)}
        if len(found) == len(set(rollout_ids)):
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"rollouts {sorted(set(rollout_ids) - set(found))} not in ClickHouse after {timeout}s")
        await asyncio.sleep(0.05)


async def _dlq(settings: Settings, keys: set[bytes], *, count: int, timeout: float = 30.0) -> list[DlqRecord]:
    """The first ``count`` DLQ records about task requests with these keys."""
    source = settings.topic("task-requests")
    return await dlq_records(settings, count, lambda r: r.source_topic == source and r.key in keys, timeout=timeout)


async def _behind(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    return any([await consumer.position(tp) < end for tp, end in ends.items()])


def _new_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


async def _ingress_caught_up(settings: Settings, *, timeout: float = 60.0) -> None:
    """Wait until the ingress committed every request on agl.task-requests as of now (so what it
    wrote for them, DLQ records included, is acknowledged: it commits after its sends)."""
    ends = await end_offsets(settings, settings.topic("task-requests"))
    group = f"{settings.topic_prefix}.{WRITER}"
    deadline = time.monotonic() + timeout
    while True:
        committed = await committed_offsets(settings, group)
        if all(committed.get(tp, 0) >= end for tp, end in ends.items()):
            return
        assert time.monotonic() < deadline, f"the ingress did not commit up to {ends} in {timeout}s: {committed}"
        await asyncio.sleep(0.05)


async def _dlq_of(settings: Settings, keys: set[bytes]) -> list[DlqRecord]:
    """Every record on agl.dlq about task requests with these keys, as of now."""
    source = settings.topic("task-requests")
    records = [CODEC.decode(r.value or b"", DlqRecord) for r in await read_to_end(settings, settings.topic("dlq"))]
    return [r for r in records if r.source_topic == source and r.key in keys]


async def _ingress_count(settings: Settings, outcome: str) -> float:
    """agl_ingress_requests_total{outcome} of the stack's ingress, from its metrics endpoint."""
    [endpoint] = [e for e in monitor.read_endpoints(settings) if e.role == "ingress" and role_alive(e.pid)]
    async with httpx.AsyncClient(headers=auth_headers(settings), trust_env=False, timeout=60) as client:
        response = await client.get(endpoint.url)
    response.raise_for_status()
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "agl_ingress_requests_total" and sample.labels.get("outcome") == outcome
    )


# --------------------------------------------------------------------------------------------
# Tests on the shared stack
# --------------------------------------------------------------------------------------------


async def test_requests_from_the_avro_package_become_rollouts(stack_settings: Settings, store: AglStore) -> None:
    writer = AvroTaskWriter()
    resources = await store.add_resources({"llm": LLM(endpoint="http://127.0.0.1:1/v1", model="m")})
    ids = [_new_id("avro") for _ in range(3)]
    datums = [
        _datum(ids[0]),
        _datum(ids[1], mode=None, config=None, metadata=None, request_time=None, input=json.dumps("just text")),
        _datum(ids[2], resources_id=resources.resources_id),
    ]
    await _produce(stack_settings, [(d["request_id"].encode(), writer.encode(d)) for d in datums])
    rollouts = await _rollouts(store, [rollout_id_for(i) for i in ids])
    first = rollouts[rollout_id_for(ids[0])]
    assert (first.status, first.input, first.mode, first.metadata) == (
        "queuing",
        {"question": "2+2?", "n": 4},
        "train",
        {"source": "crm"},
    )
    assert first.config.max_attempts == 2 and first.config.timeout_seconds == 60.0
    second = rollouts[rollout_id_for(ids[1])]
    assert (second.input, second.mode, second.config.max_attempts, second.metadata) == ("just text", None, 1, None)
    assert rollouts[rollout_id_for(ids[2])].resources_id == resources.resources_id


async def test_bad_requests_go_to_the_dlq_with_reasons(stack_settings: Settings, store: AglStore) -> None:
    writer = AvroTaskWriter()
    tag = uuid.uuid4().hex[:8]
    good = _datum(f"good-{tag}")
    cases: dict[str, tuple[bytes, str, str]] = {
        # key -> (value, error type, part of the reason)
        f"garbage-{tag}": (b"not avro at all", "NotSingleObjectEncodedError", "single-object marker"),
        f"truncated-{tag}": (writer.encode(good)[:-6], "MalformedRecordError", "not valid Avro"),
        f"fingerprint-{tag}": (
            b"\xc3\x01" + b"\x00" * 8 + writer.encode(good)[10:],
            "UnknownFingerprintError",
            "unknown writer schema",
        ),
        f"wrong-record-{tag}": (CODEC.encode(Worker(worker_id="w")), "RecordTypeError", "got a agl.Worker"),
        f"big-{tag}": (
            writer.encode(_datum(f"big-{tag}", input=json.dumps({"blob": "x" * 600_000}))),
            "TaskRequestTooLargeError",
            "over the 524,288-byte limit",
        ),
        f"config-{tag}": (
            writer.encode(
                _datum(f"config-{tag}", config={**good["config"], "max_attempts": 0, "timeout_seconds": -1.0})
            ),
            "InvalidTaskRequestError",
            "config.max_attempts must be an integer from 1",
        ),
        f"retry-{tag}": (
            writer.encode(_datum(f"retry-{tag}", config={**good["config"], "retry_condition": ["succeeded"]})),
            "InvalidTaskRequestError",
            "retry_condition may hold only",
        ),
        f"resources-{tag}": (
            writer.encode(_datum(f"resources-{tag}", resources_id="rs-000000000000")),
            "UnknownResourcesError",
            "names no snapshot",
        ),
        f"json-{tag}": (
            writer.encode(_datum(f"json-{tag}", input="{not json")),
            "MalformedRecordError",
            "JSONDecodeError",
        ),
        f"key-{tag}": (writer.encode(_datum(f"other-{tag}")), "KeyMismatchError", "is not the request_id"),
    }
    await _produce(stack_settings, [(key.encode(), value) for key, (value, _, _) in cases.items()])
    records = await _dlq(stack_settings, {k.encode() for k in cases}, count=len(cases))
    by_key = {(r.key or b"").decode(): r for r in records}
    assert set(by_key) == set(cases)
    for key, (value, error_type, reason) in cases.items():
        record = by_key[key]
        assert (record.error_type, record.processor) == (error_type, "processor.ingress"), key
        # The value itself, or its head when it is large, with the whole one's size and digest.
        assert record.value == value[: len(record.value)] and record.value_size == len(value), key
        assert record.value_sha256 == hashlib.sha256(value).hexdigest(), key
        assert reason in record.reason, (key, record.reason)
    assert "timeout_seconds must be a positive number" in by_key[f"config-{tag}"].reason  # every problem at once
    # None of them became a rollout (the request ids that decoded are the ones to check).
    refused = [f"{name}-{tag}" for name in ("big", "config", "retry", "resources", "other")]
    assert await store.query_rollouts(rollout_id_in=[rollout_id_for(i) for i in refused]) == []


async def test_copies_are_answered_and_a_reused_request_id_is_refused(
    stack_settings: Settings, store: AglStore
) -> None:
    writer = AvroTaskWriter()
    request_id = _new_id("dup")
    first = _datum(request_id, input=json.dumps({"v": 1}))
    key = request_id.encode()
    copies_before = await _ingress_count(stack_settings, "already_enqueued")
    # Two copies together (one poll), then a third after the rollout exists: answers, no DLQ.
    await _produce(stack_settings, [(key, writer.encode(first)), (key, writer.encode(first))])
    rollout_id = rollout_id_for(request_id)
    [rollout] = (await _rollouts(store, [rollout_id])).values()
    await _produce(stack_settings, [(key, writer.encode({**first, "request_time": time.time()}))])
    await _ingress_caught_up(stack_settings)
    assert await _dlq_of(stack_settings, {key}) == []
    assert await _ingress_count(stack_settings, "already_enqueued") >= copies_before + 2
    # The same request id with another input: refused, with the reason, and nothing changed.
    await _produce(stack_settings, [(key, writer.encode(_datum(request_id, input=json.dumps({"v": 2}))))])
    [record] = await _dlq(stack_settings, {key}, count=1)
    assert (record.error_type, record.processor) == ("RequestConflictError", "processor.ingress")
    assert f"request_id {request_id!r} was already enqueued as rollout {rollout_id} with a different input" in (
        record.reason
    )
    await _ingress_caught_up(stack_settings)
    assert len(await _dlq_of(stack_settings, {key})) == 1
    [again] = await store.query_rollouts(rollout_id_in=[rollout_id])
    assert again.input == {"v": 1} == rollout.input and again.start_time == rollout.start_time


async def test_a_copy_of_a_request_enqueued_under_a_legacy_id_is_answered(
    stack_settings: Settings, store: AglStore
) -> None:
    """A rollout the first version made (``ro-`` + 12 hex) still answers its request's copies; a
    request whose old id collided with it in 48 bits gets a rollout of its own."""
    writer = AvroTaskWriter()
    tag = uuid.uuid4().hex[:8]
    old_id, other_id = COLLIDING  # one legacy rollout id, ro-ffa9082b3c38
    assert legacy_rollout_id_for(old_id) == legacy_rollout_id_for(other_id)
    old = validate_request({**_datum(old_id), "input": {"q": tag}, "metadata": None}, IngressLimits())
    event = enqueue_event(old, time.time())  # what the first version wrote, under its 12-hex id
    legacy = legacy_rollout_id_for(old_id)
    assert isinstance(event.payload, RolloutEnqueued)
    rollout = event.payload.rollout.model_copy(update={"rollout_id": legacy})
    event = event.model_copy(update={"rollout_id": legacy, "payload": RolloutEnqueued(rollout=rollout)})
    producer = AIOKafkaProducer(bootstrap_servers=stack_settings.bootstrap_servers, acks="all")
    await producer.start()
    try:
        await producer.send_and_wait(stack_settings.topic("rollouts"), CODEC.encode(event), key=legacy.encode())
    finally:
        await producer.stop()
    await _rollouts(store, [legacy])
    await _produce(
        stack_settings,
        [
            (old_id.encode(), writer.encode(_datum(old_id, input=json.dumps({"q": tag})))),
            (other_id.encode(), writer.encode(_datum(other_id, input=json.dumps({"q": "other"})))),
        ],
    )
    await _rollouts(store, [rollout_id_for(other_id)])
    await _ingress_caught_up(stack_settings)
    assert await store.query_rollouts(rollout_id_in=[rollout_id_for(old_id)]) == []  # answered, not enqueued
    assert await _dlq_of(stack_settings, {old_id.encode(), other_id.encode()}) == []


async def test_post_tasks(stack_settings: Settings, store: AglStore) -> None:
    recorded = stack.read_stack(stack_settings)
    assert recorded is not None and recorded.gateway_url is not None
    ids = [_new_id("post") for _ in range(2)]
    ok_id = _new_id("ok")
    async with httpx.AsyncClient(base_url=recorded.gateway_url, timeout=30) as http:
        one = await http.post("/v1/tasks", json={"request_id": ids[0], "input": {"q": 1}, "mode": "val"})
        assert one.status_code == 202, one.text
        queued = {"request_id": ids[0], "rollout_id": rollout_id_for(ids[0]), "outcome": "queued"}
        assert one.json() == {"accepted": [queued]}
        many = await http.post("/v1/tasks", json=[{"request_id": ids[1], "input": [1, 2]}, {"input": "no id"}])
        assert many.status_code == 202, many.text
        [_, generated] = many.json()["accepted"]
        assert generated["rollout_id"] == rollout_id_for(generated["request_id"])
        bad = await http.post(
            "/v1/tasks",
            json=[
                {"request_id": ok_id, "input": 1},
                {"request_id": "has space", "input": 1},
                {"input": 1, "config": {"max_attempts": 0}},
                {"request_id": ids[0], "input": 1, "mode": "prod"},
            ],
        )
        assert bad.status_code == 422, bad.text
        body = bad.json()
        assert body["error"] == "invalid_task_requests"
        assert [(i["index"], i["error"]) for i in body["items"]] == [
            (1, "InvalidTaskRequestError"),
            (2, "InvalidTaskRequestError"),
            (3, "InvalidTaskRequestError"),
        ]
        assert "printable ASCII" in body["items"][0]["reason"] and "max_attempts" in body["items"][1]["reason"]
        assert (
            await http.post("/v1/tasks", content=b"{nope", headers={"content-type": "application/json"})
        ).status_code == 400
    rollouts = await _rollouts(store, [rollout_id_for(ids[0]), rollout_id_for(ids[1]), generated["rollout_id"]])
    assert rollouts[rollout_id_for(ids[0])].mode == "val" and rollouts[generated["rollout_id"]].input == "no id"
    # Nothing of the refused request was sent, not even its valid item.
    assert await store.query_rollouts(rollout_id_in=[rollout_id_for(ok_id)]) == []
    fresh = _new_id("fresh")
    async with httpx.AsyncClient(base_url=recorded.gateway_url, timeout=30) as http:
        # A retry once the rollout exists: answered, not sent; a new item beside it is queued.
        again = await http.post(
            "/v1/tasks", json=[{"request_id": ids[0], "input": {"q": 1}}, {"request_id": fresh, "input": 2}]
        )
        assert again.status_code == 202, again.text
        assert again.json()["accepted"] == [
            {**queued, "outcome": "already_enqueued"},
            {"request_id": fresh, "rollout_id": rollout_id_for(fresh), "outcome": "queued"},
        ]
        # The same request id with another input: 409, and nothing of the body is sent.
        other = _new_id("other")
        conflict = await http.post(
            "/v1/tasks", json=[{"request_id": other, "input": 3}, {"request_id": ids[1], "input": "changed"}]
        )
        assert conflict.status_code == 409, conflict.text
        body = conflict.json()
        assert body["error"] == "conflicting_task_requests"
        [item] = body["items"]
        assert (item["index"], item["request_id"], item["error"]) == (1, ids[1], "RequestConflictError")
        assert "with a different input" in item["reason"]
    await _rollouts(store, [rollout_id_for(fresh)])
    await _ingress_caught_up(stack_settings)
    assert await store.query_rollouts(rollout_id_in=[rollout_id_for(other)]) == []
    assert await _dlq_of(stack_settings, {ids[0].encode(), ids[1].encode()}) == []
    [kept] = await store.query_rollouts(rollout_id_in=[rollout_id_for(ids[1])])
    assert kept.input == [1, 2]


def _enqueue(settings: Settings, tasks: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "agl_stream", "enqueue", "--file", str(tasks), *args]
    environment = {**role_environment(settings), **env}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=180)


async def test_enqueue_file_again_is_already_enqueued_not_dead_letters(
    stack_settings: Settings, store: AglStore, tmp_path: Path
) -> None:
    salt = uuid.uuid4().hex
    lines = [json.dumps({"input": {"i": i}, "mode": "train"}) for i in range(20)]
    lines.insert(5, "{not json")
    lines.insert(9, json.dumps({"input": 1, "config": {"max_attempts": 0}}))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")

    def run(ids_file: Path) -> subprocess.CompletedProcess[str]:
        return _enqueue(stack_settings, tasks, "--id-salt", salt, "--ids", str(ids_file))

    def ids_of(ids_file: Path) -> list[tuple[int, str, str]]:
        records = [json.loads(line) for line in ids_file.read_text().splitlines()]
        return sorted((r["line"], r["request_id"], r["rollout_id"]) for r in records)

    first = await asyncio.to_thread(run, tmp_path / "ids1.jsonl")
    assert first.returncode == 3, first.stderr  # two refused lines
    assert "line 6" in first.stderr and "not JSON" in first.stderr
    assert "line 10" in first.stderr and "max_attempts" in first.stderr
    assert "sent 20 of 22 task requests" in first.stdout and "2 refused lines" in first.stdout, first.stdout
    sent = ids_of(tmp_path / "ids1.jsonl")
    rollout_ids = [rollout_id for _, _, rollout_id in sent]
    assert len(set(rollout_ids)) == 20
    keys = {request_id.encode() for _, request_id, _ in sent}
    # Again at once: whatever ClickHouse does not hold yet is sent, and the ingress answers it.
    second = await asyncio.to_thread(run, tmp_path / "ids2.jsonl")
    assert second.returncode == 3, second.stderr
    assert ids_of(tmp_path / "ids2.jsonl") == sent
    [(sent_again, already)] = [
        (int(m[1].replace(",", "")), int(m[2].replace(",", "")))
        for m in [__import__("re").search(r"sent ([\d,]+) of 22 .*; ([\d,]+) already enqueued", second.stdout)]
        if m is not None
    ]
    assert sent_again + already == 20, second.stdout
    # Once the rollouts are in ClickHouse, a third run sends nothing at all.
    await _rollouts(store, rollout_ids)
    third = await asyncio.to_thread(run, tmp_path / "ids3.jsonl")
    assert third.returncode == 3 and "sent 0 of 22" in third.stdout and "20 already enqueued" in third.stdout, (
        third.stdout
    )
    assert {json.loads(line)["outcome"] for line in (tmp_path / "ids3.jsonl").read_text().splitlines()} == {
        "already_enqueued"
    }
    # No dead letter for any copy, and still one rollout per line.
    await _ingress_caught_up(stack_settings)
    assert await _dlq_of(stack_settings, keys) == []
    rollouts = await store.query_rollouts(rollout_id_in=rollout_ids)
    assert sorted(r.rollout_id for r in rollouts) == sorted(rollout_ids)
    assert sorted(r.input["i"] for r in rollouts) == list(range(20))


async def test_enqueue_without_clickhouse_sends_and_the_ingress_answers_the_copies(
    stack_settings: Settings, store: AglStore, tmp_path: Path
) -> None:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"input": {"i": i}}) + "\n" for i in range(5)))
    with socket.socket() as closed:  # a gateway that is gone
        closed.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{closed.getsockname()[1]}"
    salt = uuid.uuid4().hex

    def run(ids_file: Path) -> subprocess.CompletedProcess[str]:
        return _enqueue(stack_settings, tasks, "--id-salt", salt, "--ids", str(ids_file), AGL_GATEWAY_URL=gone)

    first = await asyncio.to_thread(run, tmp_path / "ids1.jsonl")
    assert first.returncode == 0, first.stderr
    assert "sent 5 of 5" in first.stdout and "ClickHouse not asked" in first.stdout, first.stdout
    sent = [json.loads(line) for line in (tmp_path / "ids1.jsonl").read_text().splitlines()]
    await _rollouts(store, [s["rollout_id"] for s in sent])
    copies_before = await _ingress_count(stack_settings, "already_enqueued")
    second = await asyncio.to_thread(run, tmp_path / "ids2.jsonl")
    assert second.returncode == 0 and "sent 5 of 5" in second.stdout, second.stdout
    await _ingress_caught_up(stack_settings)
    assert await _dlq_of(stack_settings, {s["request_id"].encode() for s in sent}) == []
    assert await _ingress_count(stack_settings, "already_enqueued") >= copies_before + 5
    assert len(await store.query_rollouts(rollout_id_in=[s["rollout_id"] for s in sent])) == 5


async def test_enqueue_refuses_a_reused_request_id_with_another_input(
    stack_settings: Settings, store: AglStore, tmp_path: Path
) -> None:
    request_id = _new_id("reused")
    (tmp_path / "a.jsonl").write_text(json.dumps({"request_id": request_id, "input": "first task"}) + "\n")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"request_id": _new_id("fresh"), "input": 1})
        + "\n"
        + json.dumps({"request_id": request_id, "input": "another task"})
        + "\n"
    )
    first = await asyncio.to_thread(_enqueue, stack_settings, tmp_path / "a.jsonl")
    assert first.returncode == 0, first.stderr
    await _rollouts(store, [rollout_id_for(request_id)])
    second = await asyncio.to_thread(_enqueue, stack_settings, tmp_path / "b.jsonl")
    assert second.returncode == 3, (second.stdout, second.stderr)
    assert "line 2" in second.stderr and "with a different input" in second.stderr, second.stderr
    assert "sent 1 of 2" in second.stdout and "1 refused lines" in second.stdout, second.stdout
    [rollout] = await store.query_rollouts(rollout_id_in=[rollout_id_for(request_id)])
    assert rollout.input == "first task"


async def test_enqueue_without_a_broker_says_so_in_one_line(stack_settings: Settings, tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text(json.dumps({"input": 1}) + "\n")
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    for bootstrap in (f"127.0.0.1:{port}", "no-such-host.invalid:9092"):
        result = await asyncio.to_thread(_enqueue, stack_settings, tmp_path / "t.jsonl", AGL_KAFKA_BOOTSTRAP=bootstrap)
        assert result.returncode == 1, (result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr  # no traceback, no "Unclosed producer"
        assert lines[0].startswith(f"error: cannot reach Kafka at {bootstrap}"), lines
        assert result.stdout == ""


async def test_enqueue_interrupted_prints_what_it_sent(stack_settings: Settings, tmp_path: Path) -> None:
    salt = uuid.uuid4().hex
    tasks = tmp_path / "many.jsonl"
    # More than it can send before the interrupt lands, however slowly this test polls (a
    # quiet machine sent 100,000 in 66 s while a loaded poll waited).
    lines = 300_000
    tasks.write_text("".join(json.dumps({"input": {"n": i}}) + "\n" for i in range(lines)))
    # Topics of its own, which no ingress reads: what it sends never reaches the shared stack's
    # queue, where the tests that claim (the seed's client and runner) would wade through it.
    settings = stack_settings.model_copy(update={"topic_prefix": f"i{uuid.uuid4().hex[:10]}"})
    await admin.apply(settings)
    topic = settings.topic("task-requests")
    before = sum((await end_offsets(settings, topic)).values())
    command = [sys.executable, "-m", "agl_stream", "enqueue", "--file", str(tasks), "--id-salt", salt]
    process = await asyncio.create_subprocess_exec(
        *command,
        "--batch-size",
        "100",
        env=role_environment(settings),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        # Interrupt once its first batch of 100 was acknowledged: the broker holds a 101st record
        # (a batch is sent only after the one before it was acknowledged).
        deadline = time.monotonic() + 120
        while sum((await end_offsets(settings, topic)).values()) - before <= 100:
            assert process.returncode is None, await process.communicate()
            assert time.monotonic() < deadline, "enqueue sent nothing in 120 s"
            await asyncio.sleep(0.05)
        process.send_signal(signal.SIGINT)
        raw_out, raw_err = await asyncio.wait_for(process.communicate(), timeout=120)
    finally:
        if process.returncode is None:
            process.kill()
            await process.communicate()
    out, err = raw_out.decode(), raw_err.decode()
    assert process.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    [line] = [line for line in out.splitlines() if line.startswith("interrupted: sent ")]
    sent = int(line.split()[2].replace(",", ""))
    assert 100 <= sent < lines, line
    assert line.endswith("run the same command again to resume"), line


# --------------------------------------------------------------------------------------------
# kill -9 of the ingress mid-stream
# --------------------------------------------------------------------------------------------


async def _states_until(settings: Settings, expected: set[str], timeout: float) -> list[RolloutState]:
    consumer = AIOKafkaConsumer(
        settings.topic("rollout-state"), bootstrap_servers=settings.bootstrap_servers, auto_offset_reset="earliest"
    )
    await consumer.start()
    states: list[RolloutState] = []
    try:
        deadline = time.monotonic() + timeout
        while {s.rollout.rollout_id for s in states} != expected and time.monotonic() < deadline:
            for messages in (await consumer.getmany(timeout_ms=200)).values():
                states.extend(CODEC.decode(m.value, RolloutState) for m in messages if m.value is not None)
        # Whatever else is there already (a second creation would be a second version-1 state).
        ends = await consumer.end_offsets(list(consumer.assignment()))
        while await _behind(consumer, ends):
            for messages in (await consumer.getmany(timeout_ms=200)).values():
                states.extend(CODEC.decode(m.value, RolloutState) for m in messages if m.value is not None)
    finally:
        await consumer.stop()
    return states


async def test_kill_9_mid_stream_loses_and_duplicates_nothing(settings: Settings) -> None:
    await admin.apply(settings)
    writer = AvroTaskWriter()
    total = 600
    request_ids = [f"kill-{i:04d}" for i in range(total)]
    processor = start_role(settings, "processor", log_name="processor")
    ingress = start_role(settings, "ingress", log_name="ingress")
    group = f"{settings.topic_prefix}.processor.ingress"
    try:

        async def produce_slowly() -> None:
            for start in range(0, total, 50):
                chunk = request_ids[start : start + 50]
                await _produce(settings, [(i.encode(), writer.encode(_datum(i))) for i in chunk])

        producing = asyncio.create_task(produce_slowly())
        deadline = time.monotonic() + start_budget(settings, "ingress")
        while sum((await committed_offsets(settings, group)).values()) < 100:
            assert time.monotonic() < deadline, "the ingress committed nothing within its start budget"
            assert not producing.done() or producing.exception() is None
            await asyncio.sleep(0.02)
        ingress.kill()  # SIGKILL, mid-stream: requests keep arriving
        ingress.wait()
        await producing
        ingress = start_role(settings, "ingress", log_name="ingress")
        deadline = time.monotonic() + start_budget(settings, "ingress")
        while sum((await committed_offsets(settings, group)).values()) < total:
            assert time.monotonic() < deadline, "the restarted ingress did not commit every request"
            await asyncio.sleep(0.05)
        expected = {rollout_id_for(i) for i in request_ids}
        states = await _states_until(settings, expected, timeout=60)
    finally:
        stop_role(ingress)
        stop_role(processor)
    created = [s.rollout.rollout_id for s in states if s.version == 1]
    assert sorted(created) == sorted(expected)  # every request exactly one rollout
    assert {s.rollout.status for s in states} == {"queuing"}
    enqueues = await _enqueue_events(settings)
    assert set(enqueues) == expected and len(enqueues) == total


async def _enqueue_events(settings: Settings) -> dict[str, int]:
    """Enqueue events per rollout id on agl.rollouts (re-sends after the kill are allowed there)."""
    counts: dict[str, int] = {}
    for record in await read_to_end(settings, settings.topic("rollouts")):
        event = CODEC.decode(record.value or b"", RolloutEvent)
        counts[event.rollout_id] = counts.get(event.rollout_id, 0) + 1
    return counts


async def test_a_repeat_after_the_processor_forgot_its_rollout_is_still_answered(settings: Settings) -> None:
    """The rollout processor forgets finished rollouts; ClickHouse does not, and the ingress asks it
    (the rollout's metadata changed meanwhile: a copy is told by its input)."""
    short = settings.model_copy(update={"finished_retention_s": 0.1, "gateway_port": 0})
    await asyncio.to_thread(stack.up, short)
    try:
        running = stack.local_stack_settings(short)
        writer = AvroTaskWriter()
        request_id = _new_id("late")
        key, rollout_id = request_id.encode(), rollout_id_for(request_id)
        async with connect(**running.model_dump(exclude_none=True)) as store:
            await _produce(running, [(key, writer.encode(_datum(request_id)))])
            await _rollouts(store, [rollout_id])
            await store.update_rollout(rollout_id, status="succeeded")
            # Each update is an event on the rollout's partition; once the retention has passed,
            # the processor forgets the finished rollout and refuses updates of it.
            deadline = time.monotonic() + 30
            while True:
                try:
                    await store.update_rollout(rollout_id, metadata={"poke": time.monotonic()})
                except ValueError:
                    break
                assert time.monotonic() < deadline, "the processor never forgot the finished rollout"
            # A new ingress process: nothing of the first copy in its memory. The stack's
            # supervisor starts it again.
            recorded = stack.read_stack(short)
            assert recorded is not None
            os.kill(recorded.pids["ingress"], signal.SIGKILL)
            restart_deadline = time.monotonic() + start_budget(short, "ingress")
            while (read_status(short.run_dir).get("ingress") or RoleStatus()).restarts < 1:
                assert time.monotonic() < restart_deadline, "the supervisor did not start the ingress again"
                await asyncio.sleep(0.05)  # polling the supervisor's status file
            await _produce(running, [(key, writer.encode(_datum(request_id)))])
            await _ingress_caught_up(running)
            assert await _dlq_of(running, {key}) == []  # an answer ("already enqueued"), no dead letter
            assert await _ingress_count(running, "already_enqueued") == 1  # the restarted ingress's count
            [rollout] = await store.query_rollouts(rollout_id_in=[rollout_id])
            assert rollout.status == "succeeded"
        events = await _rollout_events(running, rollout_id)
        enqueued = [e for e in events if isinstance(e.payload, RolloutEnqueued)]
        assert len(enqueued) == 1  # the repeat never reached agl.rollouts
    finally:
        await asyncio.to_thread(stack.down, short)


async def _rollout_events(settings: Settings, rollout_id: str) -> list[RolloutEvent]:
    records = await read_to_end(settings, settings.topic("rollouts"))
    return [CODEC.decode(r.value or b"", RolloutEvent) for r in records if r.key == rollout_id.encode()]

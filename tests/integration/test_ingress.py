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

from agl_stream import AglStore, connect, stack
from agl_stream.codec import Codec
from agl_stream.config import Settings
from agl_stream.domain.ingress import rollout_id_for
from agl_stream.kafka import admin
from agl_stream.kafka.offsets import committed_offsets
from agl_stream.models import LLM, DlqRecord, RolloutEnqueued, RolloutEvent, RolloutState, Worker
from agl_stream.models.rollouts import Rollout
from agl_stream.processes import role_environment
from agl_stream.supervisor import RoleStatus, read_status
from tests.integration.helpers import dlq_records, read_to_end, start_role, stop_role

pytestmark = pytest.mark.asyncio

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
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


async def test_duplicates_make_one_rollout_and_are_recorded(stack_settings: Settings, store: AglStore) -> None:
    writer = AvroTaskWriter()
    request_id = _new_id("dup")
    first = _datum(request_id, input=json.dumps({"v": 1}))
    key = request_id.encode()
    # Two copies together (one poll), then a third, with other content, after the rollout exists.
    await _produce(stack_settings, [(key, writer.encode(first)), (key, writer.encode(first))])
    rollout_id = rollout_id_for(request_id)
    [rollout] = (await _rollouts(store, [rollout_id])).values()
    await _produce(stack_settings, [(key, writer.encode(_datum(request_id, input=json.dumps({"v": 2}))))])
    records = await _dlq(stack_settings, {key}, count=2)
    assert [r.error_type for r in records] == ["DuplicateRequestError"] * 2
    assert all(
        f"duplicate request: request_id {request_id!r} was already enqueued as rollout {rollout_id}" in r.reason
        for r in records
    )
    [again] = await store.query_rollouts(rollout_id_in=[rollout_id])
    assert again.input == {"v": 1} == rollout.input and again.start_time == rollout.start_time


async def test_post_tasks(stack_settings: Settings, store: AglStore) -> None:
    recorded = stack.read_stack(stack_settings)
    assert recorded is not None and recorded.gateway_url is not None
    ids = [_new_id("post") for _ in range(2)]
    ok_id = _new_id("ok")
    async with httpx.AsyncClient(base_url=recorded.gateway_url, timeout=30) as http:
        one = await http.post("/v1/tasks", json={"request_id": ids[0], "input": {"q": 1}, "mode": "val"})
        assert one.status_code == 202, one.text
        assert one.json() == {"accepted": [{"request_id": ids[0], "rollout_id": rollout_id_for(ids[0])}]}
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


async def test_enqueue_file_twice_makes_no_duplicates(
    stack_settings: Settings, store: AglStore, tmp_path: Path
) -> None:
    salt = uuid.uuid4().hex
    lines = [json.dumps({"input": {"i": i}, "mode": "train"}) for i in range(20)]
    lines.insert(5, "{not json")
    lines.insert(9, json.dumps({"input": 1, "config": {"max_attempts": 0}}))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(lines) + "\n")
    env = role_environment(stack_settings)

    def run(ids_file: Path) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "agl_stream", "enqueue", "--file", str(tasks), "--id-salt", salt]
        return subprocess.run([*command, "--ids", str(ids_file)], env=env, capture_output=True, text=True, timeout=120)

    first = await asyncio.to_thread(run, tmp_path / "ids1.jsonl")
    assert first.returncode == 1, first.stderr  # two bad lines
    assert "line 6" in first.stderr and "not JSON" in first.stderr
    assert "line 10" in first.stderr and "max_attempts" in first.stderr
    assert "sent 20 of 22 task requests" in first.stdout and "2 bad lines" in first.stdout
    sent = [json.loads(line) for line in (tmp_path / "ids1.jsonl").read_text().splitlines()]
    rollout_ids = [s["rollout_id"] for s in sent]
    assert len(set(rollout_ids)) == 20
    await _rollouts(store, rollout_ids)
    second = await asyncio.to_thread(run, tmp_path / "ids2.jsonl")
    assert second.returncode == 1 and "sent 20 of 22" in second.stdout
    assert [json.loads(line) for line in (tmp_path / "ids2.jsonl").read_text().splitlines()] == sent
    # The rerun's 20 requests are refused as duplicates; still one rollout per line.
    records = await _dlq(stack_settings, {s["request_id"].encode() for s in sent}, count=20)
    assert {r.error_type for r in records} == {"DuplicateRequestError"}
    rollouts = await store.query_rollouts(rollout_id_in=rollout_ids)
    assert sorted(r.rollout_id for r in rollouts) == sorted(rollout_ids)
    assert sorted(r.input["i"] for r in rollouts) == list(range(20))


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
        deadline = time.monotonic() + 60
        while sum((await committed_offsets(settings, group)).values()) < 100:
            assert time.monotonic() < deadline, "the ingress committed nothing within 60 s"
            assert not producing.done() or producing.exception() is None
            await asyncio.sleep(0.02)
        ingress.kill()  # SIGKILL, mid-stream: requests keep arriving
        ingress.wait()
        await producing
        ingress = start_role(settings, "ingress", log_name="ingress")
        deadline = time.monotonic() + 60
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


async def test_a_repeat_after_the_processor_forgot_its_rollout_is_still_refused(settings: Settings) -> None:
    """The rollout processor forgets finished rollouts; ClickHouse does not, and the ingress asks it."""
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
            restart_deadline = time.monotonic() + 60
            while (read_status(short.run_dir).get("ingress") or RoleStatus()).restarts < 1:
                assert time.monotonic() < restart_deadline, "the supervisor did not start the ingress again"
                await asyncio.sleep(0.05)  # polling the supervisor's status file
            await _produce(running, [(key, writer.encode(_datum(request_id)))])
            [record] = await _dlq(running, {key}, count=1)
            assert record.error_type == "DuplicateRequestError" and rollout_id in record.reason
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

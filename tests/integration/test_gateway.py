"""The gateway as a process: real broker, real embedded engine, reads through its HTTP API.

Records are produced the way the processor, the trainer and the workers write them; a query
fenced on their offsets sees them at once (no retries here: the fence is the synchronisation).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError
from aiokafka.structs import RecordMetadata

from agl_stream.config import Settings
from agl_stream.errors import FenceTimeoutError, QueryError, ReadSideError
from agl_stream.kafka import admin
from agl_stream.kafka.io import make_consumer, make_producer
from agl_stream.kafka.offsets import committed_offsets, end_offsets
from agl_stream.local.processes import start_budget
from agl_stream.models import (
    LLM,
    AglModel,
    Attempt,
    ResourcesUpdate,
    Rollout,
    RolloutState,
    Worker,
)
from agl_stream.store.queries import (
    Query,
    StoreQueries,
    attempt_from_row,
    resources_from_row,
    rollout_from_row,
    statistics_from_row,
    worker_from_row,
)
from agl_stream.store.readside import GATEWAY_FILE, GatewayReadSide, fence_of, read_gateway_file
from agl_stream.wire.codec import Codec
from consumers.gateway import AppliedOffsets, jsonable
from consumers.sink_specs import ROLLOUT_STATE, SPECS, sinks_group_id
from tests.integration.helpers import start_role, stop_role

pytestmark = pytest.mark.integration

Q = StoreQueries("agl")


# -- the in-process pieces -------------------------------------------------------------------


async def test_applied_offsets_wake_waiters_only_when_their_fence_holds() -> None:
    applied = AppliedOffsets()
    waiter = asyncio.create_task(applied.wait({"t": {0: 4, 1: 0}}, timeout=5))
    applied.update("t", {0: 5})  # partition 0 done (next offset 5 > record 4), partition 1 not
    await asyncio.sleep(0)
    assert not waiter.done()
    applied.update("t", {1: 1})
    await asyncio.wait_for(waiter, 1)
    applied.update("t", {0: 2})  # never moves back
    assert applied.snapshot() == {"t": {0: 5, 1: 1}}
    with pytest.raises(FenceTimeoutError, match="still behind"):
        await applied.wait({"t": {0: 5}}, timeout=0.05)


async def test_applied_offsets_say_which_topics_readers_wait_for() -> None:
    applied = AppliedOffsets()
    applied.update("done", {0: 9})
    assert not applied.wanted("t")
    waiter = asyncio.create_task(applied.wait({"t": {0: 4}, "done": {0: 3}}, timeout=5))
    await asyncio.sleep(0)  # let the waiter register
    assert applied.wanted("t") and not applied.wanted("done")  # "done" already holds the fence
    applied.update("t", {0: 5})
    await asyncio.wait_for(waiter, 1)
    assert not applied.wanted("t")
    with pytest.raises(FenceTimeoutError):
        await applied.wait({"t": {0: 7}}, timeout=0.01)
    assert not applied.wanted("t")  # a reader that gave up is no longer waiting


def test_query_values_become_json() -> None:
    from datetime import datetime
    from decimal import Decimal
    from uuid import UUID

    values = [
        1,
        2.5,
        float("nan"),
        float("-inf"),
        "x",
        None,
        (1, "a"),
        {1: [True]},
        Decimal("1.10"),
        UUID(int=1),
        datetime(2025, 1, 2, 3, 4, 5),
        b"\xff",
    ]
    assert json.loads(json.dumps(jsonable(values), allow_nan=False)) == [
        1,
        2.5,
        "NaN",
        "-Infinity",
        "x",
        None,
        [1, "a"],
        {"1": [True]},
        "1.10",
        "00000000-0000-0000-0000-000000000001",
        "2025-01-02T03:04:05",
        "\ufffd",
    ]


# -- the process -----------------------------------------------------------------------------


def _q(query: Query) -> tuple[str, dict[str, Any]]:
    return query.sql, query.parameters


def _gateway_settings(settings: Settings) -> Settings:
    return settings.model_copy(update={"gateway_port": 0})


@contextmanager
def gateway_process(settings: Settings, log_name: str = "gateway") -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Start `agl-stream gateway`; yield it and its URL once it answers. Stopped with SIGTERM."""
    process = start_role(settings, "gateway", log_name=log_name)
    try:
        yield process, _wait_until_serving(settings, process, log_name)
    finally:
        stop_role(process)


def _wait_until_serving(settings: Settings, process: subprocess.Popen[bytes], log_name: str) -> str:
    import httpx

    deadline = time.monotonic() + start_budget(settings, "gateway")
    while time.monotonic() < deadline:
        record = read_gateway_file(settings.run_dir)
        if record is not None and record.pid == process.pid:
            try:
                if httpx.get(f"{record.url}/v1/health", timeout=1).status_code == 200:
                    return record.url
            except httpx.HTTPError:
                pass
        if process.poll() is not None:
            break
        time.sleep(0.05)  # polling a child's readiness, not synchronising with data
    log = (settings.data_dir / f"{log_name}.log").read_text(errors="replace")[-3000:]
    raise AssertionError(f"the gateway did not start (exit code {process.poll()}); log:\n{log}")


@asynccontextmanager
async def reader(url: str) -> AsyncIterator[GatewayReadSide]:
    reads = GatewayReadSide(url)
    try:
        yield reads
    finally:
        await reads.aclose()


async def produce(settings: Settings, records: list[tuple[str, str, AglModel | None]]) -> list[RecordMetadata]:
    """(short topic, key, record or None for a tombstone), in order; acknowledged positions."""
    codec = Codec.default()
    producer = make_producer(settings)
    await producer.start()
    try:
        return [
            await producer.send_and_wait(
                settings.topic(topic), None if record is None else codec.encode(record), key=key.encode()
            )
            for topic, key, record in records
        ]
    finally:
        await producer.stop()


def rollout_state(rollout_id: str, version: int, status: str, *attempts: Attempt) -> RolloutState:
    rollout = Rollout.model_validate(
        {"rollout_id": rollout_id, "input": {"q": rollout_id}, "start_time": 10.0 + version, "status": status}
    )
    return RolloutState(rollout=rollout, attempts=list(attempts), version=version, cause_event_id="e", cause_time=1)


def an_attempt(rollout_id: str, status: str, worker_id: str) -> Attempt:
    return Attempt(
        rollout_id=rollout_id,
        attempt_id=f"at-{rollout_id}",
        sequence_id=1,
        start_time=50.0,
        status=status,
        worker_id=worker_id,
    )


async def rewind_state_sinks(settings: Settings) -> None:
    """Commit offset 0 for the state sinks, as if nothing had been committed: a full replay.

    The broker accepts the commit once it has expired the killed gateway's group members (the
    session timeout); until then it answers UnknownMemberId.
    """
    deadline = time.monotonic() + 60
    for spec in SPECS:
        if spec.resume != "committed":
            continue
        topic = settings.topic(spec.topic)
        ends = await end_offsets(settings, topic)
        consumer = make_consumer(settings, group_id=sinks_group_id(settings, spec.lane))
        await consumer.start()
        try:
            consumer.assign(list(ends))
            while True:
                try:
                    await consumer.commit({TopicPartition(topic, tp.partition): 0 for tp in ends})
                    break
                except CommitFailedError:
                    assert time.monotonic() < deadline, f"{spec.name}: the killed members never expired"
                    await asyncio.sleep(0.5)  # waiting for the broker's session timeout
        finally:
            await consumer.stop()


async def test_fenced_reads_write_refusal_timeouts_and_restart_after_kill_9(settings: Settings) -> None:
    await admin.apply(settings)
    settings = _gateway_settings(settings)
    running = rollout_state("ro-1", 2, "running", an_attempt("ro-1", "running", "w-1"))
    finished = rollout_state("ro-2", 5, "succeeded", an_attempt("ro-2", "succeeded", "w-2"))
    resources = ResourcesUpdate(
        resources_id="rs-1",
        create_time=1.0,
        update_time=2.0,
        version=1,
        resources={"main": LLM(endpoint="http://llm/v1", model="m", sampling_parameters={"temperature": 0.5})},
    )
    heartbeat = Worker(worker_id="w-1", status="idle", heartbeat_stats={"load": 0.25}, last_heartbeat_time=99.0)

    with gateway_process(settings, "gateway1") as (process, url):
        written = await produce(
            settings,
            [
                ("rollout-state", "ro-1", rollout_state("ro-1", 1, "queuing")),
                ("rollout-state", "ro-1", running),
                ("rollout-state", "ro-2", finished),
                ("rollout-state", "ro-2", None),  # the processor forgot ro-2: the read side keeps it
                ("resources", "rs-1", resources),
                ("workers", "w-1", heartbeat),
            ],
        )
        fence = fence_of(written)
        async with reader(url) as reads:
            rows = (await reads.query(Q.rollouts().sql, fence=fence, timeout=30)).dicts()
            assert [rollout_from_row(r) for r in rows] == [running.rollout, finished.rollout]
            attempts = await reads.query(*_q(Q.attempts("ro-2")), fence=fence)
            assert [attempt_from_row(r) for r in attempts.dicts()] == finished.attempts
            [latest] = (await reads.query(*_q(Q.latest_resources()), fence=fence)).dicts()
            assert resources_from_row(latest) == resources
            workers = [worker_from_row(r) for r in (await reads.query(*_q(Q.workers()), fence=fence)).dicts()]
            assert [(w.worker_id, w.status, w.current_rollout_id) for w in workers] == [
                ("w-1", "busy", "ro-1"),  # derived from its running attempt, not the heartbeat's "idle"
                ("w-2", "idle", None),
            ]
            assert workers[0].heartbeat_stats == {"load": 0.25}
            [stats] = (await reads.query(*_q(Q.statistics()), fence=fence)).dicts()
            assert statistics_from_row(stats) == {
                "total_rollouts": 2,
                "total_attempts": 2,
                "total_spans": 0,
                "total_resources": 1,
                "total_workers": 2,
            }

            # The engine refuses writes on the query path, whatever the SQL looks like: its parser
            # takes one SELECT only (no INSERT, DDL, SET or INTO OUTFILE), readonly=1 the rest.
            outfile = Path(settings.data_dir) / "written-by-a-query.csv"
            for sql in (
                "INSERT INTO agl.rollouts (rollout_id) VALUES ('x')",
                "DROP TABLE agl.rollouts",
                "SET readonly = 0",
                f"SELECT 1 INTO OUTFILE '{outfile}'",
            ):
                with pytest.raises(QueryError) as refused:
                    await reads.query(sql)
                assert refused.value.name in ("READONLY", "SYNTAX_ERROR"), sql
            assert not outfile.exists()
            # The analytics policy holds here too: no files, no server state, no system tables,
            # also not through a parameter (the parser substitutes it before the check).
            for sql, parameters, kind in (
                ("SELECT * FROM file('/etc/hostname', 'LineAsString')", {}, "forbidden_function"),
                ("SELECT file('/proc/self/environ') AS leaked", {}, "forbidden_function"),
                ("SELECT getSetting('readonly')", {}, "forbidden_function"),
                ("SELECT (SELECT groupArray(name) FROM system.databases) AS dbs", {}, "forbidden_table"),
                ("SELECT * FROM {t:Identifier}", {"t": "system.tables"}, "forbidden_table"),
            ):
                with pytest.raises(QueryError) as refused:
                    await reads.query(sql, parameters)
                assert refused.value.name == kind, sql
                assert "AGL_" not in str(refused.value)  # the check ran before anything was evaluated
            with pytest.raises(QueryError, match="SYNTAX_ERROR"):
                await reads.query("SELEC 1")

            # A fence on an offset never written times out; one on a topic no sink reads is refused.
            state_topic = settings.topic("rollout-state")
            never = {state_topic: {written[1].partition: written[-1].offset + 1000}}
            started = time.monotonic()
            with pytest.raises(FenceTimeoutError, match="did not apply"):
                await reads.query("SELECT 1", fence=never, timeout=0.3)
            assert time.monotonic() - started < 5
            with pytest.raises(ReadSideError, match="no sink of this gateway reads"):
                await reads.query("SELECT 1", fence={settings.topic("tasks"): {0: 0}})

            offsets = await reads.offsets()
            applied = offsets["sinks"][ROLLOUT_STATE.name]
            assert applied["topic"] == state_topic
            assert int(applied["applied"][str(written[3].partition)]) == written[3].offset + 1

        # The tombstone was skipped, not dead-lettered.
        assert sum((await end_offsets(settings, settings.topic("dlq"))).values()) == 0

        process.send_signal(signal.SIGKILL)
        process.wait(30)
    assert (settings.run_dir / GATEWAY_FILE).exists()  # left behind by kill -9 ...
    assert read_gateway_file(settings.run_dir) is None  # ... and recognised as stale

    # Replay every state topic from the start on restart: the rows arrive again, FINAL hides the copies.
    await rewind_state_sinks(settings)
    with gateway_process(settings, "gateway2") as (process, url):
        newer = rollout_state("ro-1", 3, "succeeded", an_attempt("ro-1", "succeeded", "w-1"))
        fence = fence_of([*written, *await produce(settings, [("rollout-state", "ro-1", newer)])])
        async with reader(url) as reads:
            rows = (await reads.query(Q.rollouts().sql, fence=fence)).dicts()
            assert [rollout_from_row(r) for r in rows] == [newer.rollout, finished.rollout]
            counts = await reads.query(
                "SELECT (SELECT count() FROM agl.rollouts FINAL), (SELECT count() FROM agl.attempts FINAL), "
                "(SELECT count() FROM agl.resources FINAL), (SELECT count() FROM agl.workers FINAL)",
                fence=fence,
            )
            assert counts.rows == [[2, 2, 1, 1]]
            workers = [worker_from_row(r) for r in (await reads.query(*_q(Q.workers()), fence=fence)).dicts()]
            assert [(w.worker_id, w.status) for w in workers] == [("w-1", "idle"), ("w-2", "idle")]
        assert stop_role(process) == 0  # SIGTERM: sinks commit, uvicorn stops, exit 0
    assert not (settings.run_dir / GATEWAY_FILE).exists()  # a clean exit removes its record


async def test_a_gateway_that_requires_its_token_refuses_requests_without_it(settings: Settings) -> None:
    import stat

    import httpx

    from agl_stream.auth import TOKEN_FILE, ensure_token
    from agl_stream.kafka import admin
    from agl_stream.store.readside import read_side_for

    await admin.apply(settings)
    guarded = _gateway_settings(settings).model_copy(update={"require_token": True})
    token = ensure_token(guarded)
    assert stat.S_IMODE((guarded.run_dir / TOKEN_FILE).stat().st_mode) == 0o600
    with gateway_process(guarded, log_name="gateway-token") as (_, url):
        async with httpx.AsyncClient() as client:
            anonymous = await client.post(f"{url}/v1/query", json={"sql": "SELECT 1"})
            wrong = await client.post(
                f"{url}/v1/query", json={"sql": "SELECT 1"}, headers={"authorization": "Bearer nope"}
            )
            health = await client.get(f"{url}/v1/health")
        assert anonymous.status_code == 401 and anonymous.json()["error"] == "unauthorized"
        assert wrong.status_code == 401 and token not in wrong.text
        assert health.status_code == 200  # health checks need no token
        side = read_side_for(guarded)  # what the store client uses: it sends the token it knows
        try:
            assert (await side.query("SELECT 1 AS one")).rows == [[1]]
        finally:
            await side.aclose()


# The gateway as `agl-stream gateway` runs it, plus a way to stop its main event loop dead: a
# line "block" on stdin makes the loop read the next line synchronously, so neither HTTP nor
# anything else on that loop runs until the test writes "release".
_BLOCKABLE_GATEWAY = """
import asyncio, sys
from agl_stream.config import Settings
from consumers.gateway import run_gateway

async def main() -> None:
    def on_line() -> None:
        if sys.stdin.readline().strip() == "block":
            print("blocking", flush=True)
            sys.stdin.readline()  # the main loop stands still until "release"
            print("released", flush=True)

    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), on_line)
    await run_gateway(Settings())

asyncio.run(main())
"""


def _start_blockable(settings: Settings) -> subprocess.Popen[bytes]:
    import sys

    from agl_stream.local.processes import role_environment

    with open(Path(settings.data_dir) / "blockable.log", "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-c", _BLOCKABLE_GATEWAY],
            env=role_environment(settings, "gateway"),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
        )


def _read_until(process: subprocess.Popen[bytes], line: bytes) -> None:
    """Read the child's output (its logs too) up to ``line``; fail if it ends first."""
    assert process.stdout is not None
    for read in iter(process.stdout.readline, b""):
        if read == line:
            return
    raise AssertionError(f"the gateway's output ended before {line!r} (exit code {process.poll()})")


async def _sink_members(settings: Settings, group: str) -> tuple[str, list[str]]:
    """The group's state and its members' ids, as the coordinator has them."""
    client = admin.admin_client(settings)
    await client.start()
    try:
        [response] = await client.describe_consumer_groups([group])
    finally:
        await client.close()
    [described] = response.to_object()["groups"]
    return described["state"], sorted(m["member_id"] for m in described["members"])


async def test_a_main_loop_that_stands_still_stops_no_sink_nor_its_group_membership(settings: Settings) -> None:
    await admin.apply(settings)
    settings = settings.model_copy(update={"gateway_port": 0, "sink_linger_ms": 0})
    group = sinks_group_id(settings, ROLLOUT_STATE.lane)
    process = _start_blockable(settings)
    assert process.stdin is not None and process.stdout is not None
    try:
        url = _wait_until_serving(settings, process, "blockable")
        first = await produce(settings, [("rollout-state", "ro-a", rollout_state("ro-a", 1, "queuing"))])
        async with reader(url) as reads:
            await reads.query(*_q(Q.rollouts()), fence=fence_of(first), timeout=120)  # the sinks run
        deadline = time.monotonic() + 120
        while (members := await _sink_members(settings, group))[0] != "Stable" or len(members[1]) != 1:
            assert time.monotonic() < deadline, f"the sinks' group never settled: {members}"
            await asyncio.sleep(0.2)

        process.stdin.write(b"block\n")
        process.stdin.flush()
        await asyncio.to_thread(_read_until, process, b"blocking\n")
        blocked_at = time.monotonic()
        # While the main loop stands still, the sinks fetch, insert and commit a new record.
        [written] = await produce(settings, [("rollout-state", "ro-b", rollout_state("ro-b", 1, "queuing"))])
        tp = TopicPartition(written.topic, written.partition)
        deadline = time.monotonic() + 120
        while (await committed_offsets(settings, group)).get(tp, 0) <= written.offset:
            assert time.monotonic() < deadline, "the sinks did not commit while the main loop stood still"
            await asyncio.sleep(0.2)
        # Past the group's session timeout (6 s) a member whose heartbeats stopped is gone; the
        # sinks' heartbeats do not run on the main loop, so their member stays.
        await asyncio.sleep(max(0.0, blocked_at + 9 - time.monotonic()))
        assert await _sink_members(settings, group) == members
        assert process.poll() is None

        process.stdin.write(b"release\n")
        process.stdin.flush()
        await asyncio.to_thread(_read_until, process, b"released\n")
        async with reader(url) as reads:
            rows = (await reads.query(*_q(Q.rollouts()), fence=fence_of([written]), timeout=120)).dicts()
        assert {r["rollout_id"] for r in rows} >= {"ro-a", "ro-b"}
        assert await _sink_members(settings, group) == members
    finally:
        stop_role(process)
        process.stdin.close()
        process.stdout.close()


async def test_a_clean_stop_with_a_batch_lingering_exits_cleanly_and_loses_nothing(settings: Settings) -> None:
    await admin.apply(settings)
    settings = settings.model_copy(update={"gateway_port": 0, "sink_linger_ms": 600_000})
    with gateway_process(settings, "lingering") as (process, url):
        async with reader(url) as reads:  # the sinks run: a fenced read was answered
            first = await produce(settings, [("rollout-state", "ro-1", rollout_state("ro-1", 1, "queuing"))])
            await reads.query(*_q(Q.rollouts()), fence=fence_of(first), timeout=120)
        # Nobody reads this one: it lingers (ten minutes), until the stop.
        second = await produce(settings, [("rollout-state", "ro-2", rollout_state("ro-2", 1, "queuing"))])
        # SIGTERM: the stop wakes the sinks, which write what lingers; the process exits cleanly
        # rather than waiting out the linger until stop_role kills it.
        assert stop_role(process, timeout=60) == 0
    with gateway_process(settings, "lingering-again") as (_, url):
        async with reader(url) as reads:
            rows = (await reads.query(*_q(Q.rollouts()), fence=fence_of(second), timeout=120)).dicts()
    assert {r["rollout_id"] for r in rows} >= {"ro-1", "ro-2"}

"""agl-stream against the seed (Agent Lightning 0.3.0's store server): the same work, one after the other.

The work, identical on both sides (the loops are benchmarks/_seed_workload.py, run by each
side's own interpreter):

* an algorithm process enqueues ``--rollouts`` rollouts with enqueue_many_rollouts in batches of
  256, then waits the seed's way: wait_for_rollouts(rollout_ids=<still unfinished>, timeout=0.1)
  again and again until all are done;
* ``--runner-processes`` runner processes with ``--runners-per-process`` coroutines each loop
  dequeue_rollout(worker_id=...) -> add_many_spans (``--spans`` spans with a 1 KB string
  attribute each) -> update_attempt(..., status="succeeded"), sleeping 10 ms when dequeue
  returns None (the seed's polling);
* then, with the runners idle-polling, 100 single rollouts are enqueued one at a time (50 ms
  apart) and each runner records enqueue-call start -> claim (time.time() in the rollout's input,
  same machine): the idle-queue claim latency.

Seed side: ``agl store`` of ``agentlightning==0.3.0`` (in-memory store, one process) in its own
virtualenv, ``~/.cache/agl-stream/seed-venv``, which this script creates on first use (pip;
a stamp file makes it idempotent). Its clients are its ``LightningStoreClient`` (HTTP).
agl-stream side: a local stack as `agl-stream up` starts it (broker on free ports and the roles,
in a temporary folder), clients from ``agl_stream.connect``.

Reported per side: rollouts/s from the first enqueue call to the last update_attempt (the
runners' clocks); the enqueue_many rate (rollouts over the time spent inside the
enqueue_many_rollouts calls alone, while the runners already work); CPU seconds per process over
the main run (from the "go" to the algorithm seeing all done; /proc/<pid>/stat, each process
with its live descendants), CPU ms per rollout store side (seed: the server; agl-stream: the
broker and every stack role) and whole benchmark (store side + clients + this script), plus the
whole machine's busy time from /proc/stat (which includes anything else running here; steal,
time the hypervisor gave to others, is reported apart: it slows a run down); the
idle-queue claim latency p50/p99; CPU % per process while idle-polling (probe phase).

Bytes on the wire, a proxy for "bytes fetched from the broker": ``ss -tinp`` gives each TCP
socket's tcp_info counters (bytes_sent, bytes_received). Snapshotted socket by socket before and
after the main run: ``store_bytes_sent`` is what the store's listening port (broker client port;
seed server port) sent to every peer (agl-stream: fetch responses to the stack roles and the
clients, produce acks, metadata; seed: HTTP responses), ``client_bytes_received`` what the
benchmark's client processes received on their connections to that port. Connections opened
and closed within the run are missed (Kafka clients and aiohttp keep theirs open).

``--clients-scaling 2,8,32`` (agl-stream only): the same total work with that many client
(runner) processes, the same total number of runner coroutines spread over them (at least one
each), no probes; prints rollouts/s, CPU and those byte counts per rollout for each count, to
see what each added client process costs the broker.

The seed's client and server, as read in agentlightning 0.3.0 and seen here:
``LightningStoreClient.add_many_spans`` posts one HTTP request per span; ``dequeue_rollout`` never
waits (None at once when the queue is empty, and None on any error too); ``wait_for_rollouts``
refuses a timeout over 0.1 s, and the in-memory server waits for each unfinished rollout with
``asyncio.to_thread(event.wait, timeout)``: one default-executor thread per unfinished id
(min(32, CPUs + 4) threads), so one call over N unfinished rollouts lasts about
N x timeout / threads (seconds for thousands of ids; ``--wait-timeout 0`` avoids it).

``--repeat N`` runs each side N times, alternating the sides (agl-stream, seed, agl-stream, ...),
so a machine that drifts slows both alike; the table shows each side's median run (by
rollouts/s: one real run, so its figures belong together), and a line per side gives the
spread of rollouts/s and store-side CPU over its runs. Every run is kept in the JSON (``runs``).

Run: ``python benchmarks/compare_seed.py`` (``--only seed|agl``, ``--rollouts 2000``). JSON goes
to benchmarks/results/compare_seed.json (compare_seed_clients.json with --clients-scaling).
Everything started here is stopped on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _seed_workload as workload  # type: ignore[import-not-found]
import httpx
from _measure import (  # type: ignore[import-not-found]
    cpu_seconds,
    machine_cpu_seconds,
    percentile,
    scrape_counts,
    tcp_bytes,
    tree_cpu_seconds,
)
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from store import step_spans  # type: ignore[import-not-found]

# The seed venv helper is shared with the side-by-side tests (tests/seed_venv.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.seed_venv import SEED_CHILD_ENV, SEED_REQUIREMENTS, ensure_seed_venv

HERE = Path(__file__).resolve().parent
console = Console(stderr=True)


# ---------------------------------------------------------------------------------------------
# The workload: child processes and one measured run
# ---------------------------------------------------------------------------------------------


@dataclass
class Workload:
    rollouts: int
    runner_processes: int
    runners_per_process: int
    spans: int
    span_bytes: int = 1024
    batch: int = 256
    poll: float = 0.01
    probes: int = 100
    probe_interval: float = 0.05
    wait_timeout: float = 0.1
    timeout: float = 900.0
    claim_wait: float = 0.0  # agl-stream only: dequeue_rollout(wait=...), the runner's long poll


@dataclass
class Store:
    """A running store: how to start its clients, and what to measure of it."""

    label: str
    client_command: list[str]  # interpreter + script + store-specific arguments
    processes: dict[str, int]  # store-side processes (name -> pid)
    port: int | None  # the port its clients connect to
    logs: Path
    metrics_dir: Path | None = None  # where the roles advertise their /metrics (agl-stream)
    log_dirs: tuple[Path, ...] = ()  # the broker's data folders (agl-stream's own broker)
    url: str | None = None  # its HTTP base URL: the seed's server, agl-stream's gateway


class ChildError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    process: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def _tail(self) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-3000:]

    async def expect(self, event: str, timeout: float) -> dict[str, Any]:
        """The next message of kind ``event`` (others are skipped); ChildError if it fails or exits."""
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildError(f"{self.name}: no {event!r} within {timeout:.0f}s; its log ends with:\n{self._tail()}")
            try:
                line = await asyncio.wait_for(self.process.stdout.readline(), left)
            except asyncio.TimeoutError:
                continue
            if not line:
                await self.process.wait()
                code = self.process.returncode
                raise ChildError(f"{self.name} exited ({code}) before {event!r}; its log ends with:\n{self._tail()}")
            message: dict[str, Any] = json.loads(line)
            if message["event"] == "failed":
                raise ChildError(f"{self.name} failed: {message['error']}; its log ends with:\n{self._tail()}")
            if message["event"] == event:
                return message

    async def messages(self) -> dict[str, Any]:
        """The next message, whatever it is (ChildError on failure or exit)."""
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        if not line:
            await self.process.wait()
            raise ChildError(f"{self.name} exited ({self.process.returncode}); its log ends with:\n{self._tail()}")
        message: dict[str, Any] = json.loads(line)
        if message["event"] == "failed":
            raise ChildError(f"{self.name} failed: {message['error']}; its log ends with:\n{self._tail()}")
        return message

    async def send(self, command: str) -> None:
        assert self.process.stdin is not None
        if self.process.returncode is None:
            self.process.stdin.write(f"{command}\n".encode())
            with contextlib.suppress(ConnectionError):
                await self.process.stdin.drain()

    async def stop(self, timeout: float = 15.0) -> None:
        """Ask it to stop, then SIGKILL (by its pid) if it has not exited within ``timeout``."""
        if self.process.returncode is None:
            with contextlib.suppress(ConnectionError):
                await self.send("stop")
                assert self.process.stdin is not None
                self.process.stdin.close()
            try:
                await asyncio.wait_for(self.process.wait(), timeout)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()


async def start_child(store: Store, name: str, role_args: list[str]) -> Child:
    log = store.logs / f"{store.label}-{name}.log"
    with log.open("wb") as handle:
        process = await asyncio.create_subprocess_exec(
            *store.client_command,
            *role_args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=handle,
            env={**os.environ, **SEED_CHILD_ENV},
            start_new_session=True,  # a Ctrl-C reaches this script only; it stops the children
        )
    return Child(name, process, log)


def _cpu(processes: dict[str, int]) -> dict[str, float]:
    return {
        # Own time only for this script (its descendants are the clients) and for the stack's
        # supervisor (its descendants are the roles, each counted on its own): a tree sum would
        # count them twice.
        name: cpu_seconds(pid) if pid == os.getpid() or name == "supervisor" else tree_cpu_seconds(pid)
        for name, pid in processes.items()
    }


Sockets = dict[tuple[str, str, str], tuple[int | None, int, int]]  # (end, local, peer) -> (pid, sent, received)


def _bytes(port: int | None, client_pids: set[int]) -> Sockets:
    """tcp_info counters of the store's ends and of the clients' ends of their connections."""
    if port is None:
        return {}
    sockets: Sockets = {}
    try:
        for (local, peer), counters in tcp_bytes(port, local=True).items():
            sockets[("server", local, peer)] = counters
        for (local, peer), counters in tcp_bytes(port, local=False).items():
            if counters[0] in client_pids:
                sockets[("client", local, peer)] = counters
    except (OSError, subprocess.CalledProcessError):
        return {}
    return sockets


def _bytes_delta(before: Sockets, after: Sockets) -> dict[str, int]:
    sent = received = 0
    for key, (_, out, into) in after.items():
        _, out0, into0 = before.get(key, (None, 0, 0))
        if key[0] == "server":
            sent += out - out0
        else:
            received += into - into0
    return {"store_bytes_sent": sent, "client_bytes_received": received}


async def run_workload(store: Store, work: Workload, title: str) -> dict[str, Any]:
    """One measured run of the workload against a running store."""
    runner_args = [
        "--spans", str(work.spans), "--span-bytes", str(work.span_bytes), "--poll", str(work.poll),
        "--runners", str(work.runners_per_process),
    ]  # fmt: skip
    if work.claim_wait > 0 and store.label == "agl":
        runner_args += ["--claim-wait", str(work.claim_wait)]
    children: list[Child] = []
    try:
        runners = [
            await start_child(store, f"runner-{i}", ["--role", "runner", "--name", f"r{i}", *runner_args])
            for i in range(work.runner_processes)
        ]
        children.extend(runners)
        algorithm = await start_child(
            store,
            "algorithm",
            [
                "--role", "algorithm", "--rollouts", str(work.rollouts), "--batch", str(work.batch),
                "--probes", str(work.probes), "--probe-interval", str(work.probe_interval),
                "--wait-timeout", str(work.wait_timeout),
            ],
        )  # fmt: skip
        children.append(algorithm)
        with console.status(f"{title}: starting {len(children)} client processes"):
            for child in children:
                await child.expect("ready", 300)
        client_pids = {c.name: c.pid for c in children}
        processes = {**store.processes, **client_pids, "benchmark": os.getpid()}

        counts_before, topics_before = scrape_counts(store.metrics_dir), topic_bytes(list(store.log_dirs))
        cpu_before, machine_before = _cpu(processes), machine_cpu_seconds()
        bytes_before = _bytes(store.port, set(client_pids.values()))
        await algorithm.send("go")
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        ) as progress:
            enqueued = progress.add_task(f"{title} enqueued", total=work.rollouts)
            done = progress.add_task(f"{title} done", total=work.rollouts)
            deadline = time.monotonic() + work.timeout
            while True:
                left = deadline - time.monotonic()
                try:
                    message = await asyncio.wait_for(algorithm.messages(), max(left, 0.001))
                except asyncio.TimeoutError:
                    raise ChildError(f"{title}: not all rollouts done within {work.timeout:.0f}s") from None
                if message["event"] == "enqueued":
                    progress.update(enqueued, completed=message["count"])
                elif message["event"] == "progress":
                    progress.update(done, completed=message["done"])
                elif message["event"] == "main_done":
                    main = message
                    break
        cpu_after, machine_after = _cpu(processes), machine_cpu_seconds()
        bytes_after = _bytes(store.port, set(client_pids.values()))
        counts_after, topics_after = scrape_counts(store.metrics_dir), topic_bytes(list(store.log_dirs))

        idle_cpu: dict[str, float] = {}
        probe_counts: dict[str, Any] = {}
        if work.probes:
            with console.status(f"{title}: {work.probes} claim-latency probes into the idle queue"):
                probe_began = time.perf_counter()
                cpu_probe, counts_probe = _cpu(processes), scrape_counts(store.metrics_dir)
                await algorithm.send("probe")
                await algorithm.expect("probes_done", work.timeout)
                probe_seconds = time.perf_counter() - probe_began
                probe_counts = per_rollout(counts_probe, scrape_counts(store.metrics_dir), work.probes)
                idle_cpu = {
                    name: round((used - cpu_probe[name]) / probe_seconds * 100, 1)
                    for name, used in _cpu(processes).items()
                }
        results = []
        for runner in runners:
            await runner.send("stop")
        for runner in runners:
            results.append(await runner.expect("result", 60))
    finally:
        await asyncio.gather(*(child.stop() for child in children))

    completed = sum(r["completed"] for r in results)
    if completed != work.rollouts or main["unique_ids"] != work.rollouts:
        raise ChildError(f"{title}: {completed} rollouts completed by the runners, {work.rollouts} enqueued")
    last_completion = max(r["last_completion"] for r in results)
    seconds = last_completion - main["first_enqueue"]
    cpu = {name: round(cpu_after[name] - cpu_before[name], 2) for name in processes}
    machine = {kind: machine_after[kind] - machine_before[kind] for kind in machine_after}
    charged = machine["user"] + machine["nice"] + machine["system"]  # what processes were charged
    interrupts = machine["irq"] + machine["softirq"]  # charged to no process (loopback networking, mostly)
    store_cpu = sum(cpu[name] for name in store.processes)
    client_cpu = sum(cpu[name] for name in client_pids)
    probe_latency = [lat for r in results for lat in r["probe_latency"]]
    wire = _bytes_delta(bytes_before, bytes_after)
    return {
        "rollouts": work.rollouts,
        "runner_processes": work.runner_processes,
        "runners_per_process": work.runners_per_process,
        "spans_per_rollout": work.spans,
        "span_payload_bytes": work.span_bytes,
        "seconds": round(seconds, 3),
        "rollouts_per_s": round(work.rollouts / seconds, 1),
        "seconds_until_algorithm_saw_all_done": round(main["all_seen_done"] - main["first_enqueue"], 3),
        "enqueue_many_rollouts_per_s": round(work.rollouts / main["enqueue_seconds"], 1),
        "wait_for_rollouts_calls": main["wait_calls"],
        "cpu_seconds": cpu,
        "cpu_seconds_store_side": round(store_cpu, 2),
        "cpu_seconds_clients": round(client_cpu, 2),
        "cpu_ms_per_rollout": {
            "store_side": round(store_cpu / work.rollouts * 1e3, 3),
            "clients": round(client_cpu / work.rollouts * 1e3, 3),
            "whole_benchmark": round(sum(cpu.values()) / work.rollouts * 1e3, 3),
            "whole_machine_proc_stat": round((charged + interrupts) / work.rollouts * 1e3, 3),
        },
        # /proc/stat over the main run; steal is time the hypervisor gave to other guests
        "machine_cpu_seconds": {kind: round(value, 2) for kind, value in machine.items() if kind != "idle"},
        # CPU that processes outside this benchmark were charged meanwhile: > 0 means contended figures
        "cpu_seconds_outside_benchmark": round(max(0.0, charged - sum(cpu.values())), 2),
        "irq_softirq_cpu_seconds": round(interrupts, 2),
        "idle_queue_claim_ms": {
            "probes": len(probe_latency),
            "p50": round(percentile(probe_latency, 0.5) * 1e3, 2),
            "p99": round(percentile(probe_latency, 0.99) * 1e3, 2),
        },
        "idle_polling_cpu_percent": idle_cpu,
        "counts_per_probe": probe_counts,  # the same counts over the probe phase, per probe rollout
        "bytes_per_rollout": {k: round(v / work.rollouts) for k, v in wire.items()},
        # Per rollout, main run: each stack role's Kafka requests by API, records produced per
        # topic, ClickHouse INSERTs (sink batches) and reads per table; the clients' own Kafka
        # requests (whole life, probes included); broker disk bytes per topic.
        "counts_per_rollout": {
            **per_rollout(counts_before, counts_after, work.rollouts),
            "client_kafka_requests": {
                key: round(value / work.rollouts, 3) for key, value in sorted(_sum_counts([*results, main]).items())
            },
            "broker_log_bytes": {
                topic: round((size - topics_before.get(topic, 0)) / work.rollouts)
                for topic, size in sorted(topics_after.items())
                if size > topics_before.get(topic, 0)
            },
        },
        "runner_stats": [
            {k: r[k] for k in ("claimed", "completed", "empty_dequeues", "errors", "error_samples")} for r in results
        ],
    }


# ---------------------------------------------------------------------------------------------
# The seed: its virtualenv and its store server
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stop_group(process: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM the process group this script started (its own session), SIGKILL after ``timeout``."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@contextlib.contextmanager
def seed_store(logs: Path) -> Iterator[Store]:
    python = ensure_seed_venv()
    port = _free_port()
    log = logs / "seed-server.log"
    with log.open("wb") as handle:
        server = subprocess.Popen(
            [str(python.parent / "agl"), "store", "--host", "127.0.0.1", "--port", str(port)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, **SEED_CHILD_ENV},
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        with console.status("seed: starting `agl store` (importing agentlightning takes a while)"):
            while True:
                if server.poll() is not None:
                    raise ChildError(f"`agl store` exited ({server.returncode}):\n{log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/agl/health", timeout=1.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise ChildError(f"`agl store` did not answer within 180s; see {log}")
                time.sleep(0.2)  # polling a child's health endpoint
        yield Store(
            label="seed",
            client_command=[str(python), str(HERE / "_seed_workload.py"), "--server", url],
            processes={"seed-server": server.pid},
            port=port,
            logs=logs,
            url=url,
        )
    finally:
        _stop_group(server)


# ---------------------------------------------------------------------------------------------
# agl-stream: a local stack, and its client roles (this script, run with --role)
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def agl_store(logs: Path) -> Iterator[Store]:
    from agl_stream import metrics
    from agl_stream.config import Settings
    from agl_stream.kafka import broker
    from agl_stream.local import stack
    from agl_stream.ports import free_ports

    with tempfile.TemporaryDirectory(prefix="agl-bench-compare-") as tmp:
        settings = Settings(
            data_dir=Path(tmp), gateway_port=0, topic_prefix=f"b{uuid.uuid4().hex[:6]}", log_level="WARNING"
        )
        own_broker = settings.uses_local_broker
        if own_broker:
            port, controller = free_ports(2)
            settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
        try:
            with console.status("agl-stream: starting the stack (broker, topics, roles)"):
                stack.up(settings)
            info = stack.read_stack(settings)
            assert info is not None
            processes = dict(info.pids)
            broker_pid = broker.status(settings).pid if own_broker else None
            if broker_pid is not None:
                processes["broker"] = broker_pid
            live = stack.local_stack_settings(settings)
            options = live.model_dump(mode="json", exclude_none=True)
            host, _, kafka_port = live.bootstrap_servers.split(",")[0].rpartition(":")
            yield Store(
                label="agl",
                client_command=[sys.executable, str(Path(__file__).resolve()), "--settings", json.dumps(options)],
                processes=processes,
                port=int(kafka_port) if host in ("127.0.0.1", "localhost") else None,
                logs=logs,
                metrics_dir=settings.run_dir / metrics.ENDPOINTS_DIR,
                log_dirs=tuple(p.parent for p in Path(tmp).rglob("meta.properties")),
                url=info.gateway_url,
            )
        finally:
            stack.down(settings)


def agl_side(options: dict[str, Any]) -> Any:
    from agl_stream import AglStore, connect
    from agl_stream.models import Span

    async def open_store() -> AglStore:
        return await connect(**options)

    def enqueue_requests(inputs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"input": task} for task in inputs]

    def make_spans(rollout_id: str, attempt_id: str, texts: list[str]) -> list[Span]:
        return step_spans(rollout_id, attempt_id, [{"step": i, "payload": text} for i, text in enumerate(texts)])

    async def close_store(store: AglStore) -> None:
        await store.close()

    def counts() -> dict[str, float]:
        from agl_stream import metrics

        return {f"kafka_requests.{api}": value for (_, api), value in _samples(metrics.KAFKA_REQUESTS).items()}

    return workload.Side(open_store, enqueue_requests, make_spans, close_store, counts)


def _samples(metric: Any) -> dict[tuple[str, ...], float]:
    """A labelled counter's values in this process: label values -> count."""
    return {
        tuple(sample.labels.values()): sample.value
        for family in metric.collect()
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def topic_bytes(log_dirs: list[Path]) -> dict[str, int]:
    """Bytes on the broker's disk per topic (its partitions' folders): records, batch headers, indexes."""
    sizes: dict[str, int] = {}
    for log_dir in log_dirs:
        for partition in log_dir.glob("*-[0-9]*"):
            topic = partition.name.rsplit("-", 1)[0]
            size = sum(f.stat().st_size for f in partition.glob("*.log") if f.is_file())
            sizes[topic] = sizes.get(topic, 0) + size
    return sizes


def per_rollout(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], rollouts: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, values in after.items():
        delta = {k: (v - before.get(kind, {}).get(k, 0.0)) / rollouts for k, v in values.items()}
        out[kind] = {k: round(v, 3) for k, v in sorted(delta.items()) if v > 0}
    return out


# ---------------------------------------------------------------------------------------------
# Orchestration and the report
# ---------------------------------------------------------------------------------------------


def _sum_counts(messages: list[dict[str, Any]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for message in messages:
        for key, value in (message.get("counts") or {}).items():
            total[key] = total.get(key, 0.0) + value
    return total


def _run_side(name: str, make_store: Any, logs: Path, work: Workload) -> dict[str, Any]:
    try:
        with make_store(logs) as store:
            return asyncio.run(run_workload(store, work, name))
    except Exception as error:  # report it and go on with the other side
        console.print(f"[red]{name} failed:[/red] {type(error).__name__}: {error}")
        return {"error": f"{type(error).__name__}: {error}"}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rollouts/s (the lower middle of an even count) among those that
    finished; the first failure when none did."""
    finished = sorted((r for r in runs if "error" not in r), key=lambda r: r["rollouts_per_s"])
    if not finished:
        return runs[0]
    return finished[(len(finished) - 1) // 2]


def spread(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Lowest and highest rollouts/s and store-side CPU ms per rollout over the finished runs."""
    finished = [r for r in runs if "error" not in r]
    rates = [r["rollouts_per_s"] for r in finished]
    cpu = [r["cpu_ms_per_rollout"]["store_side"] for r in finished]
    return {
        "runs": len(runs),
        "failed": len(runs) - len(finished),
        "rollouts_per_s": [min(rates), max(rates)] if rates else None,
        "cpu_ms_per_rollout_store_side": [min(cpu), max(cpu)] if cpu else None,
    }


def _clients_scaling(counts: list[int], logs: Path, work: Workload) -> list[dict[str, Any]]:
    total = work.runner_processes * work.runners_per_process
    rows: list[dict[str, Any]] = []
    try:
        with agl_store(logs) as store:
            for count in counts:
                scaled = Workload(
                    rollouts=work.rollouts,
                    runner_processes=count,
                    runners_per_process=max(1, total // count),
                    spans=work.spans,
                    probes=0,
                    wait_timeout=work.wait_timeout,
                    timeout=work.timeout,
                )
                try:
                    rows.append({"clients": count, **asyncio.run(run_workload(store, scaled, f"agl x{count} clients"))})
                except Exception as error:
                    console.print(f"[red]{count} clients failed:[/red] {type(error).__name__}: {error}")
                    rows.append({"clients": count, "error": f"{type(error).__name__}: {error}"})
    except Exception as error:
        console.print(f"[red]the agl-stream stack failed:[/red] {type(error).__name__}: {error}")
        rows.append({"error": f"{type(error).__name__}: {error}"})
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return "-" if value is None else str(value)


def _dig(result: dict[str, Any], path: str) -> Any:
    value: Any = result
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def print_report(report: dict[str, Any]) -> None:
    out = Console() if sys.stdout.isatty() else Console(width=150)
    sides = [s for s in ("agl-stream", "seed") if s in report["sides"]]
    if sides:
        _print_sides(out, report, sides)
    if report.get("clients_scaling"):
        _print_scaling(out, report["clients_scaling"])


def _print_sides(out: Console, report: dict[str, Any], sides: list[str]) -> None:
    table = Table(title=f"{report['config']['rollouts']:,} rollouts, {report['config']['runners']} runners")
    table.add_column("metric")
    for side in sides:
        table.add_column(side, justify="right")
    if len(sides) == 2:
        table.add_column("agl/seed", justify="right")
    metrics = [
        ("rollouts/s (first enqueue -> last completion)", "rollouts_per_s"),
        ("seconds", "seconds"),
        ("seconds until the algorithm saw all done", "seconds_until_algorithm_saw_all_done"),
        ("enqueue_many_rollouts: rollouts/s in the calls", "enqueue_many_rollouts_per_s"),
        ("wait_for_rollouts calls", "wait_for_rollouts_calls"),
        ("CPU ms/rollout, store side", "cpu_ms_per_rollout.store_side"),
        ("CPU ms/rollout, clients", "cpu_ms_per_rollout.clients"),
        ("CPU ms/rollout, whole benchmark", "cpu_ms_per_rollout.whole_benchmark"),
        ("CPU ms/rollout, whole machine (/proc/stat)", "cpu_ms_per_rollout.whole_machine_proc_stat"),
        ("irq+softirq CPU s (charged to no process)", "irq_softirq_cpu_seconds"),
        ("steal CPU s (hypervisor)", "machine_cpu_seconds.steal"),
        ("CPU s used by other processes meanwhile", "cpu_seconds_outside_benchmark"),
        ("idle-queue claim latency p50 ms", "idle_queue_claim_ms.p50"),
        ("idle-queue claim latency p99 ms", "idle_queue_claim_ms.p99"),
        ("store bytes sent/rollout", "bytes_per_rollout.store_bytes_sent"),
        ("client bytes received/rollout", "bytes_per_rollout.client_bytes_received"),
    ]
    for label, path in metrics:
        values = [_dig(report["sides"][side], path) for side in sides]
        row = [label, *(_fmt(v) for v in values)]
        if len(sides) == 2:
            a, s = values
            row.append(f"{a / s:.2f}x" if isinstance(a, (int, float)) and isinstance(s, (int, float)) and s else "-")
        table.add_row(*row)
    out.print(table)
    for side in sides:
        result = report["sides"][side]
        if "error" in result:
            out.print(f"[red]{side}: {result['error']}[/red]")
            continue
        cpu = ", ".join(
            f"{name} {sec:.2f}" for name, sec in sorted(result["cpu_seconds"].items(), key=lambda kv: -kv[1])
        )
        out.print(f"{side} CPU seconds in the main run: {cpu}")
        idle = ", ".join(f"{name} {pct:.0f}%" for name, pct in result["idle_polling_cpu_percent"].items() if pct >= 1)
        out.print(f"{side} CPU while idle-polling (probe phase): {idle or 'all under 1%'}")
        capacity = result["seconds"] * (os.cpu_count() or 1)
        if result["cpu_seconds_outside_benchmark"] > 0.05 * capacity:
            out.print(
                f"[yellow]{side}: other processes used {result['cpu_seconds_outside_benchmark']:.1f} CPU s during"
                " its run: its figures are contended[/yellow]"
            )
        if result["machine_cpu_seconds"]["steal"] > 0.05 * capacity:
            out.print(
                f"[yellow]{side}: the hypervisor took {result['machine_cpu_seconds']['steal']:.1f} CPU s (steal)"
                " during its run: its rates and latencies are noisy[/yellow]"
            )
    for side, range_ in report.get("spread", {}).items():
        rates, cpu = range_["rollouts_per_s"], range_["cpu_ms_per_rollout_store_side"]
        if rates is not None:
            out.print(
                f"{side} over {range_['runs']} runs (the table shows the median): rollouts/s {rates[0]:,.0f}-"
                f"{rates[1]:,.0f}, store-side CPU {cpu[0]:.2f}-{cpu[1]:.2f} ms/rollout"
                + (f", {range_['failed']} failed" if range_["failed"] else "")
            )
    if "ratio_agl_over_seed" in report:
        out.print(f"agl-stream / seed, rollouts/s: [bold]{report['ratio_agl_over_seed']['rollouts_per_s']:.2f}x[/bold]")


def _print_scaling(out: Console, rows: list[dict[str, Any]]) -> None:
    table = Table(title="agl-stream, clients scaling (same total work)")
    columns = (
        "clients", "runners each", "rollouts/s", "CPU ms/rollout store", "CPU ms/rollout all",
        "broker bytes sent/rollout", "client bytes recv/rollout", "other CPU s",
    )  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        if "error" in row:
            table.add_row(_fmt(row.get("clients")), "-", row["error"][:80])
            continue
        table.add_row(
            _fmt(row["clients"]),
            _fmt(row["runners_per_process"]),
            _fmt(row["rollouts_per_s"]),
            _fmt(row["cpu_ms_per_rollout"]["store_side"]),
            _fmt(row["cpu_ms_per_rollout"]["whole_benchmark"]),
            _fmt(row["bytes_per_rollout"]["store_bytes_sent"]),
            _fmt(row["bytes_per_rollout"]["client_bytes_received"]),
            _fmt(row["cpu_seconds_outside_benchmark"]),
        )
    out.print(table)


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    if "--role" in sys.argv:  # a client process of the agl-stream side
        role_parser = argparse.ArgumentParser()
        workload.add_role_arguments(role_parser)
        role_parser.add_argument("--settings", required=True, help="the stack's settings, JSON")
        role_args = role_parser.parse_args()
        workload.run_role(agl_side(json.loads(role_args.settings)), role_args)
        return

    signal.signal(signal.SIGTERM, _interrupted)  # a SIGTERM stops what was started, as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=2_000)
    parser.add_argument("--runner-processes", type=int, default=2)
    parser.add_argument("--runners-per-process", type=int, default=8)
    parser.add_argument("--spans", type=int, default=5, help="spans per rollout (1 KB string attribute each)")
    parser.add_argument("--probes", type=int, default=100, help="idle-queue claim latency probes")
    parser.add_argument("--only", choices=["agl", "seed", "both"], default="both")
    parser.add_argument(
        "--clients-scaling",
        default=None,
        metavar="2,8,32",
        help="agl-stream only: the same work with each of these numbers of client processes",
    )
    parser.add_argument(
        "--wait-timeout",
        type=float,
        default=0.1,
        help="timeout of each wait_for_rollouts call (the seed allows at most 0.1; 0: non-blocking calls 0.1 s apart)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a phase may take")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs per side, alternating the sides; the table shows each side's median run and the spread",
    )
    parser.add_argument(
        "--claim-wait",
        type=float,
        default=0.0,
        help="agl-stream runners claim with dequeue_rollout(wait=S), the long poll agl-stream's runner uses "
        "(the seed has none: it keeps polling every 10 ms)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON results (default: results/compare_seed.json; results/compare_seed_clients.json when scaling)",
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    work = Workload(
        rollouts=args.rollouts,
        runner_processes=args.runner_processes,
        runners_per_process=args.runners_per_process,
        spans=args.spans,
        probes=args.probes,
        wait_timeout=args.wait_timeout,
        timeout=args.timeout,
        claim_wait=args.claim_wait,
    )
    report: dict[str, Any] = {
        "config": {
            "rollouts": work.rollouts,
            "runner_processes": work.runner_processes,
            "runners_per_process": work.runners_per_process,
            "runners": work.runner_processes * work.runners_per_process,
            "spans_per_rollout": work.spans,
            "span_payload_bytes": work.span_bytes,
            "enqueue_batch": work.batch,
            "poll_s": work.poll,
            "wait_for_rollouts_timeout_s": work.wait_timeout,
            "probes": work.probes,
            "probe_interval_s": work.probe_interval,
            "cpus": os.cpu_count(),
            "seed": SEED_REQUIREMENTS[0],
        },
        "sides": {},
    }
    with tempfile.TemporaryDirectory(prefix="agl-bench-compare-logs-") as logs_dir:
        logs = Path(logs_dir)
        if args.clients_scaling:
            counts = [int(c) for c in args.clients_scaling.split(",") if c.strip()]
            report["clients_scaling"] = _clients_scaling(counts, logs, work)
        else:
            sides = [
                (name, make)
                for name, make, wanted in (("agl-stream", agl_store, "agl"), ("seed", seed_store, "seed"))
                if args.only in (wanted, "both")
            ]
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in sides}
            for _ in range(args.repeat):  # alternating: a machine that drifts slows both sides alike
                for name, make in sides:
                    runs[name].append(_run_side(name, make, logs, work))
            for name, results in runs.items():
                report["sides"][name] = median_run(results)
            if args.repeat > 1:
                report["runs"] = runs
                report["spread"] = {name: spread(results) for name, results in runs.items()}
            agl, seed = report["sides"].get("agl-stream", {}), report["sides"].get("seed", {})
            if "rollouts_per_s" in agl and "rollouts_per_s" in seed:
                report["ratio_agl_over_seed"] = {
                    "rollouts_per_s": agl["rollouts_per_s"] / seed["rollouts_per_s"],
                    "cpu_ms_per_rollout_store_side": agl["cpu_ms_per_rollout"]["store_side"]
                    / seed["cpu_ms_per_rollout"]["store_side"],
                    "cpu_ms_per_rollout_whole_benchmark": agl["cpu_ms_per_rollout"]["whole_benchmark"]
                    / seed["cpu_ms_per_rollout"]["whole_benchmark"],
                }
    print_report(report)
    out = args.out or HERE / "results" / ("compare_seed_clients.json" if args.clients_scaling else "compare_seed.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    console.print(f"results: {out}")
    failed = [run for side in report.get("runs", {}).values() for run in side if "error" in run]
    if (
        failed
        or any("error" in side for side in report["sides"].values())
        or any("error" in row for row in report.get("clients_scaling", []))
    ):
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        console.print("[red]interrupted[/red]: what this run started has been stopped")
        sys.exit(130)

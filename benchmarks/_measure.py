"""Helpers the benchmark scripts share (imported as a sibling module when a script runs)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

SHORT_LIVED_JIT = os.environ.setdefault("AGL_KAFKA_JIT", "c1")
"""Benchmarks start brokers that live seconds to minutes: the C1-only JIT unless AGL_KAFKA_JIT
says otherwise (``benchmarks/broker_jit.py`` compares both on a broker kept under load)."""


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (nearest rank), NaN when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _stat_cpu_seconds(stat: Path) -> float:
    """User + system CPU seconds in a /proc ``stat`` file (a process's or one thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used so far (user + system), from /proc."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """CPU time each live thread of a process has used so far, by thread id: (its name, seconds).
    Names are the kernel's (15 characters): a JVM's "C2 CompilerThre", Python's "python"."""
    threads: dict[int, tuple[str, float]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = ((task / "comm").read_text().strip(), _stat_cpu_seconds(task / "stat"))
        except OSError:
            continue  # a thread that ended meanwhile
    return threads


def busiest_threads(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    seconds: float,
    process_cpu: float,
    top: int = 8,
) -> dict[str, float]:
    """% of a core per thread name between two :func:`thread_cpu_seconds` snapshots, busiest first
    (threads of one name summed, like a JVM's request handlers). ``process_cpu``: the process's
    own CPU seconds over the same window; what its live threads do not account for is put under
    "(threads that ended)" (a JVM starts and stops compiler threads as it needs them)."""
    by_name: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        by_name[name] = by_name.get(name, 0.0) + cpu - before.get(tid, (name, 0.0))[1]
    ended = process_cpu - sum(by_name.values())
    busiest = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    shares = {name: round(cpu / seconds * 100, 2) for name, cpu in busiest if cpu > 0}
    if ended > 0:
        shares["(threads that ended)"] = round(ended / seconds * 100, 2)
    return shares


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (from /proc/<pid>/task/*/children)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        try:
            tasks = list(Path(f"/proc/{current}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                pending.extend(int(child) for child in (task / "children").read_text().split())
            except OSError:
                continue
    return found


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its live descendants (user + system); 0 for those gone meanwhile."""
    total = 0.0
    for member in descendants(pid):
        try:
            total += cpu_seconds(member)
        except (OSError, IndexError, ValueError):
            continue
    return total


MACHINE_CPU_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def machine_cpu_seconds() -> dict[str, float]:
    """CPU time all cores of this machine have spent so far, by kind (the first line of /proc/stat).

    Processes are charged user/nice/system time; irq and softirq time (much of loopback
    networking) is charged to no process; steal is time the hypervisor gave to someone else.
    """
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return {name: value / tick for name, value in zip(MACHINE_CPU_FIELDS, values, strict=False)}


def tcp_bytes(port: int, *, local: bool) -> dict[tuple[str, str], tuple[int | None, int, int]]:
    """Byte counters of each established TCP socket on ``port``, from ``ss -tinp`` (Linux tcp_info).

    ``local=True``: sockets whose local port is ``port`` (the server's ends); ``local=False``:
    sockets connected to ``port`` (the clients' ends). Maps (local address, peer address) to
    (pid or None where ss does not say, bytes_sent, bytes_received). Counters of sockets closed
    meanwhile are gone: take the difference of two snapshots socket by socket.
    """
    side = "sport" if local else "dport"
    text = subprocess.run(
        ["ss", "-tinpH", "state", "established", f"( {side} = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sockets: dict[tuple[str, str], tuple[int | None, int, int]] = {}
    key: tuple[str, str] | None = None
    pid: int | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():  # Recv-Q Send-Q Local Peer [users:...]; its details follow indented
            fields = line.split()
            key = (fields[2], fields[3]) if len(fields) >= 4 else None
            match = re.search(r"pid=(\d+)", line)
            pid = int(match.group(1)) if match else None
            continue
        if key is None:
            continue
        sent = re.search(r"\bbytes_sent:(\d+)", line)
        received = re.search(r"\bbytes_received:(\d+)", line)
        sockets[key] = (pid, int(sent.group(1)) if sent else 0, int(received.group(1)) if received else 0)
        key = None
    return sockets


def bench_settings(data_dir: Path, prefix: str) -> Any:
    """Settings of a benchmark's own stack in ``data_dir``: a fresh topic prefix, any free gateway
    port, quiet logs, and (unless AGL_KAFKA_BOOTSTRAP names a cluster) a local broker on free ports."""
    import uuid

    from agl_stream.config import Settings
    from agl_stream.ports import free_ports

    settings = Settings(
        data_dir=data_dir, gateway_port=0, topic_prefix=f"{prefix}{uuid.uuid4().hex[:6]}", log_level="WARNING"
    )
    if settings.uses_local_broker:
        port, controller = free_ports(2)
        settings = settings.model_copy(update={"kafka_port": port, "kafka_controller_port": controller})
    return settings


COUNTED = {
    "agl_kafka_requests_total": ("kafka_requests", ("role", "api")),
    "agl_records_in_total": ("records_in", ("role", "topic")),
    "agl_records_out_total": ("records_out", ("role", "topic")),
    "agl_sink_flush_seconds_count": ("clickhouse_inserts", ("sink",)),
    "agl_sink_records_total": ("clickhouse_inserted_records", ("sink",)),
    "agl_clickhouse_reads_total": ("clickhouse_reads", ("table",)),
    "agl_http_request_seconds_count": ("http_requests", ("role", "method", "route")),
}
"""What --count reads from the stack's roles (their /metrics), and the labels it groups by."""


def scrape_counts(metrics_dir: Path | None) -> dict[str, dict[str, float]]:
    """Every stack role's counters of :data:`COUNTED`, summed by the listed labels: {kind: {labels: value}}."""
    from prometheus_client.parser import text_string_to_metric_families

    from agl_stream import metrics

    counts: dict[str, dict[str, float]] = {kind: {} for kind, _ in COUNTED.values()}
    if metrics_dir is None or not metrics_dir.is_dir():
        return counts
    for endpoint in metrics_dir.glob("*.json"):
        try:
            [found] = metrics.parse_target_groups(json.loads(endpoint.read_text()), endpoint)
            text = httpx.get(found.url, timeout=10).text
        except (OSError, ValueError, KeyError, httpx.HTTPError):
            continue  # a role that left meanwhile
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in COUNTED:
                    kind, labels = COUNTED[sample.name]
                    key = " ".join(str(sample.labels.get(label, "")) for label in labels)
                    counts[kind][key] = counts[kind].get(key, 0.0) + sample.value
    return counts


@contextlib.contextmanager
def profiled(pid: int, out: Path | None, name: str) -> Iterator[None]:
    """py-spy records ``pid`` while the block runs (when ``out`` is given)."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    spy = Path(sys.executable).parent / "py-spy"
    recorders = [
        subprocess.Popen(
            [
                str(spy),
                "record",
                "--pid",
                str(pid),
                "--rate",
                "50",
                "--format",
                fmt,
                "--output",
                str(out / f"{name}.{ext}"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fmt, ext in (("flamegraph", "svg"), ("raw", "txt"))
    ]
    try:
        yield
    finally:
        for recorder in recorders:
            recorder.send_signal(2)  # py-spy writes its output on SIGINT
        for recorder in recorders:
            with contextlib.suppress(subprocess.TimeoutExpired):
                recorder.wait(60)

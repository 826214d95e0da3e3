"""The local broker's JVMs: a node's storage formatted and its JVM launched, waited for until it
answers, found again by pid file and command line, signalled and reaped; start and stop
serialised on a data dir. Its layout is ``layout.py``'s, the start and stop ``broker.py``'s.

Only a process whose command line is ``java ... kafka.Kafka <our server.properties>`` is ever
signalled, so a pid reused by another program is never killed.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from agl_stream.auth import write_private
from agl_stream.config import KafkaJit, Settings
from agl_stream.errors import BrokerError
from agl_stream.kafka import probe, security
from agl_stream.kafka.jars import tail
from agl_stream.kafka.layout import Node, NodePaths
from agl_stream.logs import get_logger
from agl_stream.resources import resource_path

log = get_logger("agl_stream.kafka.broker")

KAFKA_MAIN = "kafka.Kafka"
_POLL_S = 0.05

# Broker JVMs this Python process launched. Keeping the Popen objects lets terminate() reap them:
# an unreaped child stays a zombie, which os.kill(pid, 0) still reports as alive.
_children: dict[int, subprocess.Popen[bytes]] = {}


def _log_tail(paths: NodePaths) -> str:
    """The JVM's console (warnings, errors, JVM failures), or server.log when that is empty."""
    for path in (paths.console_log, paths.server_log):
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")
            if text.strip():
                return f"Last lines of {path} (full log: {paths.server_log}):\n{tail(text, 25)}"
    return f"(nothing in {paths.console_log} or {paths.server_log})"


# -- finding our processes ------------------------------------------------------------------


def _cmdline(pid: int) -> list[str] | None:
    """The argv of a process, or None when it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None
        # No procfs (macOS): ask ps. Arguments with spaces can't be told apart here, which
        # _is_ours tolerates by matching on the joined line.
        out = subprocess.run(["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, check=False)
        return out.stdout.split() if out.returncode == 0 and out.stdout.strip() else None
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _is_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # "pid (comm) S ...": comm may contain spaces and parentheses, the state follows the last ')'.
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def _is_alive(pid: int) -> bool:
    child = _children.get(pid)
    if child is not None:
        return child.poll() is None  # poll() also reaps it once it has exited
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    return not _is_zombie(pid)


def _is_ours(pid: int, paths: NodePaths) -> bool:
    """A java kafka.Kafka process started with this data dir's config (never a reused pid)."""
    argv = _cmdline(pid)
    if not argv:
        return False
    config = str(paths.config)
    return Path(argv[0]).name.startswith("java") and KAFKA_MAIN in argv and (config in argv or config in " ".join(argv))


def running_pid(paths: NodePaths, *, clean: bool = True) -> int | None:
    """The pid of our live broker for this data dir; removes a stale pid file if ``clean``."""
    try:
        text = paths.pid_file.read_text().strip()
    except FileNotFoundError:
        return None
    pid = int(text) if text.isdigit() else None
    if pid is not None and _is_alive(pid) and _is_ours(pid, paths):
        return pid
    if clean:
        log.info("removing stale kafka pid file", pid_file=str(paths.pid_file), pid=text)
        paths.pid_file.unlink(missing_ok=True)
    return None


@contextlib.contextmanager
def locked(paths: NodePaths) -> Iterator[None]:
    """Serialise start/stop on one data dir across processes."""
    paths.kafka_dir.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# -- starting -------------------------------------------------------------------------------


def _new_cluster_id() -> str:
    # Kafka's Uuid.toString(): 16 random bytes, URL-safe base64 without padding (22 chars).
    # Kafka never hands out ids starting with '-', which command lines mistake for options.
    while True:
        value = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not value.startswith("-"):
            return value


def _java(
    java: Path, libs: Path, paths: NodePaths, heap: str | None, main: str, argument: str, jit: KafkaJit
) -> list[str]:
    """The command line of a JVM running ``main`` from the Kafka jars for this node."""
    options = [
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        # ``jit="c1"``: the C1 compiler only. A fresh broker under load otherwise spends its first
        # ~10 s mostly in C2 compiler threads (several CPU-seconds), which on a small machine takes
        # the cores from the pipeline: right for a broker that lives seconds (tests, benchmarks,
        # the demo). A long-lived one is cheaper with C2 once warm (benchmarks/broker_jit.py:
        # ~0.38 against ~0.62 ms of broker CPU per rollout), so that is the default.
        *(["-XX:TieredStopAtLevel=1"] if jit == "c1" else []),
        "-XX:+ExitOnOutOfMemoryError",  # a broker out of memory is better dead than wedged
        # No hsperfdata file, and no sampling of it 20 times a second (only jstat/jps read it).
        "-XX:-UsePerfData",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={resource_path('infra/kafka/log4j2.properties')}",
        f"-Dkafka.logs.dir={paths.kafka_dir}",
    ]
    heap_option = [f"-Xmx{heap}"] if heap else []
    return [str(java), *heap_option, *options, "-cp", f"{libs}/*", main, argument]


def prepare(java: Path, libs: Path, paths: NodePaths, settings: Settings, properties: str) -> None:
    """Write the node's ``server.properties`` (0600: it may hold passwords) and format its data dir
    once; later starts reuse it (and its topics, and its SCRAM users)."""
    paths.data.mkdir(parents=True, exist_ok=True)
    write_private(paths.config, properties)
    if (paths.data / "meta.properties").exists():
        return
    # Reuse an id written by an earlier, interrupted attempt so the files on disk agree.
    cluster_id = paths.cluster_id.read_text().strip() if paths.cluster_id.exists() else ""
    if len(cluster_id) != 22:
        cluster_id = _new_cluster_id()
        paths.cluster_id.write_text(cluster_id + "\n")
    arguments = ["format", "-t", cluster_id, "-c", str(paths.config)]
    if security.secured(settings):
        arguments += ["--add-scram", security.scram_argument(settings)]
    # The arguments go in a 0600 file (one a line, read by the tool itself), not on the command
    # line, where every local user could read the salted password.
    args_file = paths.kafka_dir / "format.args"
    write_private(args_file, "".join(f"{argument}\n" for argument in arguments))
    try:
        result = subprocess.run(
            _java(java, libs, paths, "256m", "kafka.tools.StorageTool", f"@{args_file}", jit="c1"),
            capture_output=True,
            text=True,
            check=False,
            cwd=paths.kafka_dir,
        )
    finally:
        args_file.unlink(missing_ok=True)
    if result.returncode != 0:
        raise BrokerError(
            f"formatting the Kafka storage in {paths.data} failed (exit {result.returncode}):\n"
            f"{tail(result.stdout + result.stderr)}"
        )
    log.info("formatted kafka storage", data=str(paths.data), cluster_id=cluster_id)


def launch(java: Path, libs: Path, paths: NodePaths, settings: Settings) -> subprocess.Popen[bytes]:
    """Start the node's JVM, in a session of its own, and record its pid."""
    with open(paths.console_log, "wb") as console:
        child = subprocess.Popen(
            _java(java, libs, paths, settings.kafka_heap, KAFKA_MAIN, str(paths.config), settings.kafka_jit),
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            cwd=paths.kafka_dir,
            start_new_session=True,  # outlives this process and its terminal's Ctrl-C
            close_fds=True,
        )
    _children[child.pid] = child
    paths.pid_file.write_text(f"{child.pid}\n")
    return child


def wait_until_answering(pid: int, settings: Settings, paths: NodePaths, node: Node, timeout: float) -> None:
    host, port = settings.kafka_host, node.port
    deadline = time.monotonic() + timeout
    while True:
        if not _is_alive(pid):
            child = _children.pop(pid, None)
            code = f" with exit code {child.returncode}" if child is not None else ""
            raise BrokerError(f"the local Kafka broker (pid {pid}) exited during start-up{code}.\n{_log_tail(paths)}")
        remaining = deadline - time.monotonic()
        if probe.answering(settings, host, port, timeout=max(0.1, min(1.0, remaining))):
            return
        if time.monotonic() >= deadline:
            raise BrokerError(
                f"the local Kafka broker (pid {pid}) did not answer on {host}:{port} within "
                f"{timeout:g} s (on a busy or slow machine give it more with AGL_START_TIMEOUT_S).\n"
                f"{_log_tail(paths)}"
            )
        time.sleep(_POLL_S)


def abandon(child: subprocess.Popen[bytes], paths: NodePaths, node_id: int) -> None:
    """Stop a JVM that did not start and forget it. Only one still unreaped is signalled: once
    reaped, its pid may already belong to another process."""
    if child.poll() is None:
        log.warning("stopping the kafka broker that did not start", node=node_id, pid=child.pid)
        terminate([child.pid], timeout=10.0)
    _children.pop(child.pid, None)
    paths.pid_file.unlink(missing_ok=True)


# -- stopping -------------------------------------------------------------------------------


def _wait_exit(pid: int, timeout: float) -> bool:
    """Whether ``pid`` exited within ``timeout`` (a child of ours is reaped and forgotten)."""
    deadline = time.monotonic() + timeout
    while _is_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    _children.pop(pid, None)
    return True


def kill(pid: int) -> None:
    """SIGKILL, and wait for the process to be gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not _wait_exit(pid, 10.0):
        raise BrokerError(f"the local Kafka broker (pid {pid}) survived SIGKILL")


def terminate(pids: list[int], timeout: float) -> None:
    """SIGTERM (Kafka shuts down cleanly), then SIGKILL to each that takes longer than ``timeout``."""
    # All at once: a cluster's nodes stopped one by one would leave the last without a quorum,
    # waiting out its controlled shutdown.
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in pids:
        if not _wait_exit(pid, max(0.0, deadline - time.monotonic())):
            log.warning("kafka broker ignored SIGTERM; killing it", pid=pid, timeout=timeout)
            kill(pid)

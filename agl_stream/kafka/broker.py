"""The local Apache Kafka broker or cluster: format its storage, start, stop, inspect (its jars and
Java: ``jars.py``; its TLS, SCRAM and ACL settings: ``security.py``).

By default one single-node KRaft broker (broker and controller in one JVM) per data dir, under
``<data_dir>/kafka``:

- ``server.properties``  rewritten on every start, so changed ports apply
- ``data/``              Kafka's log.dirs (topic data and the metadata log, meta.properties)
- ``cluster.id``         the id the data dir was formatted with
- ``broker.pid``         pid of the running JVM
- ``broker.out``         the JVM's stdout/stderr: warnings, errors, crashes
- ``server.log``         Kafka's INFO log (infra/kafka/log4j2.properties)

With ``AGL_KAFKA_BROKERS=N`` (``agl-stream kafka start --brokers N``) it is a cluster of N such
nodes, each a broker and a voter of one static KRaft quorum, under ``<data_dir>/kafka/node-<i>``
(same files as above; ``cluster.id`` is shared), node i listening on ``AGL_KAFKA_PORT + 2(i-1)``
and its controller on ``AGL_KAFKA_CONTROLLER_PORT + 2(i-1)``. Combined nodes keep it to N JVMs on
a small machine; a quorum of 3 survives the loss of any one node, the active controller included.
Internal topics get replication min(3, N) and min ISR min(2, N), like the declared topics.

Nothing here runs when ``AGL_KAFKA_BOOTSTRAP`` names an existing cluster.

With ``AGL_KAFKA_SECURITY_PROTOCOL=SASL_SSL`` (and a SCRAM mechanism) the client listener is
SASL_SSL instead of PLAINTEXT: TLS from ``AGL_KAFKA_BROKER_KEYSTORE``, SCRAM users, and ACLs
(StandardAuthorizer) with the settings' own user as the one super user; its credential is
added when the storage is formatted. The controller listener is then on 127.0.0.1 only, behind
SASL/PLAIN with a password made at each start.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from agl_stream.config import Settings
from agl_stream.errors import BrokerError, ConfigError
from agl_stream.kafka import probe, security
from agl_stream.kafka.jars import check_prerequisites, ensure_jars
from agl_stream.logs import get_logger
from agl_stream.resources import resource_path

log = get_logger(__name__)

KAFKA_MAIN = "kafka.Kafka"
_POLL_S = 0.05
CLUSTER_STOP_GRACE_S = 10.0
_TAIL_LINES = 40

# Broker JVMs this Python process launched. Keeping the Popen objects lets stop() reap them:
# an unreaped child stays a zombie, which os.kill(pid, 0) still reports as alive.
_children: dict[int, subprocess.Popen[bytes]] = {}


# -- results --------------------------------------------------------------------------------


class BrokerInfo(BaseModel):
    """What start() did and where clients should connect."""

    model_config = ConfigDict(frozen=True)

    bootstrap: str
    external: bool  # AGL_KAFKA_BOOTSTRAP was set: nothing local was started
    started: bool  # this call launched the JVM (False: external, or already running)
    pid: int | None = None  # node 1's JVM
    pids: dict[int, int] = {}  # node id -> JVM pid, every node of a cluster
    data_dir: Path | None = None
    log_file: Path | None = None
    seconds: float = 0.0  # how long start() took


class BrokerStatus(BaseModel):
    """The local broker of one data dir, as seen from outside."""

    model_config = ConfigDict(frozen=True)

    running: bool  # a JVM of ours is alive for this data dir
    answering: bool  # it answers a Metadata request with at least one live broker
    pid: int | None
    bootstrap: str
    data_dir: Path
    log_file: Path
    node_id: int = 1


@dataclass(frozen=True)
class Node:
    """One node of the local cluster (the single broker is node 1 of a cluster of one)."""

    node_id: int
    port: int  # client listener
    controller_port: int  # KRaft controller listener


def cluster_nodes(settings: Settings) -> list[Node]:
    """The local nodes ``settings`` describe: node i on the ports 2(i-1) above the settings' own."""
    nodes = [
        Node(i + 1, settings.kafka_port + 2 * i, settings.kafka_controller_port + 2 * i)
        for i in range(settings.kafka_brokers)
    ]
    ports = [port for node in nodes for port in (node.port, node.controller_port)]
    if len(set(ports)) != len(ports) or max(ports) > 65535:
        raise ConfigError(
            f"{settings.kafka_brokers} local broker(s) from client port {settings.kafka_port} and controller "
            f"port {settings.kafka_controller_port} need the ports {sorted(ports)}, which "
            + ("overlap" if len(set(ports)) != len(ports) else "go past 65535")
            + "; node i uses port+2(i-1) and controller-port+2(i-1), so choose two ports an odd "
            "distance apart (e.g. 9092 and 9093) or fewer brokers"
        )
    return nodes


@dataclass(frozen=True)
class _Paths:
    kafka_dir: Path
    config: Path
    data: Path
    cluster_id: Path
    pid_file: Path
    console_log: Path
    server_log: Path
    lock: Path

    @classmethod
    def of(cls, settings: Settings, node_id: int = 1) -> _Paths:
        # Absolute, because the config path in the JVM's command line identifies our process.
        base = settings.kafka_dir.expanduser().resolve()
        # A single broker keeps the layout it always had; a cluster's nodes get folders of their own.
        root = base if settings.kafka_brokers == 1 else base / f"node-{node_id}"
        return cls(
            kafka_dir=root,
            config=root / "server.properties",
            data=root / "data",
            cluster_id=base / "cluster.id",  # one cluster, one id on every node
            pid_file=root / "broker.pid",
            console_log=root / "broker.out",
            server_log=root / "server.log",
            lock=base / "agl.lock",  # one lock for the whole cluster
        )


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# -- processes ------------------------------------------------------------------------------


def _cmdline(pid: int) -> list[str] | None:
    """The argv of a process, or None when it is gone or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        if Path("/proc/self").exists():
            return None
        # No procfs (macOS): ask ps. Arguments with spaces can't be told apart here, which
        # _is_ours tolerates by matching on the joined line.
        out = subprocess.run(
            ["ps", "-ww", "-o", "args=", "-p", str(pid)],
            capture_output=True,
            text=True,
            check=False,
        )
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


def _is_ours(pid: int, paths: _Paths) -> bool:
    """A java kafka.Kafka process started with this data dir's config (never a reused pid)."""
    argv = _cmdline(pid)
    if not argv:
        return False
    config = str(paths.config)
    return Path(argv[0]).name.startswith("java") and KAFKA_MAIN in argv and (config in argv or config in " ".join(argv))


def _wait_exit(pid: int, timeout: float) -> bool:
    child = _children.get(pid)
    if child is not None:
        try:
            child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        _children.pop(pid, None)
        return True
    deadline = time.monotonic() + timeout
    while _is_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _running_pid(paths: _Paths, *, clean: bool = True) -> int | None:
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
def _locked(paths: _Paths) -> Iterator[None]:
    """Serialise start/stop on one data dir across processes."""
    paths.kafka_dir.mkdir(parents=True, exist_ok=True)
    with open(paths.lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _log_tail(paths: _Paths) -> str:
    """The JVM's console (warnings, errors, JVM failures), or server.log when that is empty."""
    for path in (paths.console_log, paths.server_log):
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace")
            if text.strip():
                return f"Last lines of {path} (full log: {paths.server_log}):\n{_tail(text, 25)}"
    return f"(nothing in {paths.console_log} or {paths.server_log})"


# -- ports ----------------------------------------------------------------------


def _check_port_free(host: str, port: int, what: str, option: str) -> None:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # Like the JVM's server sockets: connections in TIME_WAIT from a previous run don't
        # count as "in use", a listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            reason = "already in use" if exc.errno == errno.EADDRINUSE else str(exc)
            raise BrokerError(
                f"cannot start the local Kafka broker: {what} {host}:{port} is {reason} "
                f"(another broker or program listens there). Choose another port "
                f"({option}), stop that program, or set AGL_KAFKA_BOOTSTRAP to use a running "
                f"cluster"
            ) from exc


# -- configuration --------------------------------------------------------------------------


def _server_properties(settings: Settings, paths: _Paths, node: Node, nodes: list[Node]) -> str:
    host = settings.kafka_host
    secured = security.secured(settings)
    client, controller = ("SASL_SSL", "SASL_PLAINTEXT") if secured else ("PLAINTEXT", "PLAINTEXT")
    chost = security.controller_host(settings)
    # Internal topics as the declared ones (topics/topics.toml): 3 replicas, 2 in sync, capped
    # at the nodes there are.
    replicas, min_isr = str(min(3, len(nodes))), str(min(2, len(nodes)))
    props = {
        # Each JVM is both a KRaft controller and a broker; the voters are static.
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": ",".join(f"{n.node_id}@{chost}:{n.controller_port}" for n in nodes),
        "listeners": f"{client}://{host}:{node.port},CONTROLLER://{chost}:{node.controller_port}",
        "advertised.listeners": f"{client}://{host}:{node.port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": f"CONTROLLER:{controller},{client}:{client}",
        "inter.broker.listener.name": client,
        # Kafka calls its data "logs"; this is topic data plus the metadata log.
        "log.dirs": str(paths.data),
        "offsets.topic.replication.factor": replicas,
        "transaction.state.log.replication.factor": replicas,
        "transaction.state.log.min.isr": min_isr,
        "share.coordinator.state.topic.replication.factor": replicas,
        "share.coordinator.state.topic.min.isr": min_isr,
        # Consumer groups form at once instead of waiting 3 s for more members.
        "group.initial.rebalance.delay.ms": "0",
        # The controller writes a no-op record to the metadata log when it has written nothing
        # for this long (Kafka's default, 500 ms, was a fifth of an idle stack's broker CPU).
        "metadata.max.idle.interval.ms": "5000",
        # Topics come from topic declarations (agl-stream's topic tool), never from a typo.
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        # Retention stays at Kafka's defaults (7 days); each declared topic sets its own.
        **(security.security_properties(settings) if secured else {}),
    }
    header = (
        "# Written by agl-stream (agl_stream/kafka/broker.py) on every start; edits are lost.\n"
        "# Change ports with AGL_KAFKA_PORT / AGL_KAFKA_CONTROLLER_PORT or `agl-stream kafka start"
        " --port`.\n"
    )
    return header + "".join(f"{key}={security.property_value(value)}\n" for key, value in props.items())


def _configured_bootstrap(paths: _Paths) -> str | None:
    """host:port the broker was last started with (from its server.properties)."""
    try:
        text = paths.config.read_text()
    except OSError:
        return None
    match = re.search(r"^advertised\.listeners=[A-Z_]+://(\S+)$", text, re.MULTILINE)
    return match.group(1) if match else None


def _new_cluster_id() -> str:
    # Kafka's Uuid.toString(): 16 random bytes, URL-safe base64 without padding (22 chars).
    # Kafka never hands out ids starting with '-', which command lines mistake for options.
    while True:
        value = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not value.startswith("-"):
            return value


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (it may hold passwords)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # also when the file was there before
    with os.fdopen(descriptor, "w") as file:
        file.write(text)


def _java_options(paths: _Paths, heap: str | None) -> list[str]:
    options = [
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        # The C1 compiler only: a fresh broker otherwise spends its first minutes of load mostly
        # in C2 compiler threads (measured: ~80% of its CPU, several CPU-seconds per minute), which
        # on a small machine takes the cores from the pipeline. C1 code is fast enough for a
        # local broker, whose own request handling is a small part of its CPU.
        "-XX:TieredStopAtLevel=1",
        "-XX:+ExitOnOutOfMemoryError",  # a broker out of memory is better dead than wedged
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={resource_path('infra/kafka/log4j2.properties')}",
        f"-Dkafka.logs.dir={paths.kafka_dir}",
    ]
    return ([f"-Xmx{heap}"] if heap else []) + options


def _format_storage(java: Path, libs: Path, paths: _Paths, settings: Settings) -> None:
    """Format the data dir once; later starts reuse it (and its topics, and its SCRAM users)."""
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
    _write_private(args_file, "".join(f"{argument}\n" for argument in arguments))
    try:
        result = subprocess.run(
            [
                str(java),
                *_java_options(paths, "256m"),
                "-cp",
                f"{libs}/*",
                "kafka.tools.StorageTool",
                f"@{args_file}",
            ],
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
            f"{_tail(result.stdout + result.stderr)}"
        )
    log.info("formatted kafka storage", data=str(paths.data), cluster_id=cluster_id)


# -- start / stop / status ------------------------------------------------------------------


def _wait_until_answering(pid: int, settings: Settings, paths: _Paths, node: Node, timeout: float) -> None:
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


def _settings_from_config(settings: Settings, paths: _Paths) -> Settings:
    """Settings pointing at the host:port a running single broker was started with."""
    bootstrap = _configured_bootstrap(paths)
    if settings.kafka_brokers != 1 or bootstrap is None or bootstrap == settings.bootstrap_servers:
        return settings
    host, _, port = bootstrap.rpartition(":")
    log.warning(
        "a local kafka broker is already running on other ports; stop it to change them",
        running=bootstrap,
        requested=settings.bootstrap_servers,
    )
    return settings.model_copy(update={"kafka_host": host, "kafka_port": int(port)})


def _layout_file(settings: Settings) -> Path:
    return settings.kafka_dir.expanduser().resolve() / "brokers"


def _read_layout(settings: Settings) -> dict[str, int]:
    """What ``<kafka dir>/brokers`` recorded: the node count and the first node's two ports
    (a file of an older version holds the count alone); empty when there is none."""
    try:
        text = _layout_file(settings).read_text().strip()
    except OSError:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    if isinstance(value, int):
        return {"brokers": value}
    if not isinstance(value, dict):
        return {}
    return {key: value[key] for key in ("brokers", "port", "controller_port") if isinstance(value.get(key), int)}


def _write_layout(settings: Settings) -> None:
    layout = {
        "brokers": settings.kafka_brokers,
        "port": settings.kafka_port,
        "controller_port": settings.kafka_controller_port,
    }
    _layout_file(settings).write_text(json.dumps(layout) + "\n")


def with_local_layout(settings: Settings) -> Settings:
    """``settings`` with the layout this data dir's local cluster was created with.

    A cluster started with ``--brokers 3`` stays a cluster of three, on the ports it was made
    with, for every later command (``kafka start/status/stop``, ``up``, ``down``) that does not
    say otherwise: a count other than 1, or ports set by a flag or AGL_KAFKA_PORT /
    AGL_KAFKA_CONTROLLER_PORT, win over what was recorded.
    """
    if settings.kafka_brokers != 1 or settings.kafka_bootstrap is not None:
        return settings
    recorded = _read_layout(settings)
    if recorded.get("brokers", 1) <= 1:
        return settings
    update: dict[str, int] = {"kafka_brokers": recorded["brokers"]}
    for field, key in (("kafka_port", "port"), ("kafka_controller_port", "controller_port")):
        if key in recorded and field not in settings.model_fields_set:
            update[field] = recorded[key]
    return settings.model_copy(update=update)


def _check_layout(settings: Settings) -> None:
    base = settings.kafka_dir.expanduser().resolve()
    single = (base / "data" / "meta.properties").exists()
    if settings.kafka_brokers > 1 and single:
        raise ConfigError(
            f"{base} holds a single broker's data; a cluster of {settings.kafka_brokers} needs a data dir of "
            "its own (--data-dir / AGL_DATA_DIR), or delete that one"
        )
    recorded = with_local_layout(settings.model_copy(update={"kafka_brokers": 1})).kafka_brokers
    if (base / "node-1").exists() and recorded not in (1, settings.kafka_brokers):
        raise ConfigError(
            f"{base} holds a local cluster of {recorded} nodes, not {settings.kafka_brokers}; "
            f"start it with --brokers {recorded}, or use another data dir"
        )


def _check_start_settings(settings: Settings) -> list[Node]:
    if settings.kafka_port == settings.kafka_controller_port:
        raise ConfigError(
            f"the client and controller ports (--port, --controller-port / AGL_KAFKA_PORT, "
            f"AGL_KAFKA_CONTROLLER_PORT) are both {settings.kafka_port}; "
            "the broker needs two different ports"
        )
    if not re.fullmatch(r"\d+[kKmMgG]?", settings.kafka_heap):
        raise ConfigError(
            f"kafka heap {settings.kafka_heap!r} (--heap / AGL_KAFKA_HEAP): use a JVM size like 512m or 2g"
        )
    if settings.kafka_brokers > 1 and security.secured(settings):
        raise ConfigError(
            "the local multi-broker cluster runs PLAINTEXT only; use AGL_KAFKA_BROKERS=1 with "
            f"AGL_KAFKA_SECURITY_PROTOCOL={settings.kafka_security_protocol}, or point "
            "AGL_KAFKA_BOOTSTRAP at a secured cluster of your own"
        )
    security.check_security(settings)
    _check_layout(settings)
    return cluster_nodes(settings)


def _launch(java: Path, libs: Path, paths: _Paths, settings: Settings) -> subprocess.Popen[bytes]:
    command = [str(java), *_java_options(paths, settings.kafka_heap), "-cp", f"{libs}/*", KAFKA_MAIN, str(paths.config)]
    with open(paths.console_log, "wb") as console:
        child = subprocess.Popen(
            command,
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


def start(settings: Settings, *, wait_timeout: float | None = None) -> BrokerInfo:
    """Start the local broker (or each node of the local cluster) and wait until all serve requests.

    Idempotent: nodes already running are kept, and a cluster node that died is started again,
    which is also how a node stopped with :func:`stop_node` rejoins. Starts nothing when
    ``settings.kafka_bootstrap`` names an existing cluster.
    """
    began = time.monotonic()
    if settings.kafka_bootstrap is not None:
        return BrokerInfo(bootstrap=settings.kafka_bootstrap, external=True, started=False)
    settings = with_local_layout(settings)
    nodes = _check_start_settings(settings)
    root = _Paths.of(settings, 1)
    with _locked(root):
        if settings.kafka_brokers > 1:
            _write_layout(settings)
        running = {node.node_id: _running_pid(_Paths.of(settings, node.node_id)) for node in nodes}
        if settings.kafka_brokers == 1 and running[1] is not None:
            settings = _settings_from_config(settings, root)
            nodes = cluster_nodes(settings)
        missing = [node for node in nodes if running[node.node_id] is None]
        # Fail fast and clearly, before Maven or the JVM run.
        for node in missing:
            _check_port_free(settings.kafka_host, node.port, "the client port", "--port / AGL_KAFKA_PORT")
            _check_port_free(
                security.controller_host(settings),
                node.controller_port,
                "the controller port",
                "--controller-port / AGL_KAFKA_CONTROLLER_PORT",
            )
        launched: dict[int, subprocess.Popen[bytes]] = {}
        if missing:
            tools = check_prerequisites(maven=False)  # ensure_jars asks for Maven if it needs it
            libs = ensure_jars(settings)
            for node in missing:
                paths = _Paths.of(settings, node.node_id)
                paths.data.mkdir(parents=True, exist_ok=True)
                _write_private(paths.config, _server_properties(settings, paths, node, nodes))
                _format_storage(tools.java, libs, paths, settings)
            # Every node is launched before any is waited for: a KRaft quorum answers only once a
            # majority of its voters runs.
            for node in missing:
                child = _launch(tools.java, libs, _Paths.of(settings, node.node_id), settings)
                launched[node.node_id] = child
                running[node.node_id] = child.pid
                log.info("starting local kafka broker", node=node.node_id, pid=child.pid, port=node.port)
        try:
            for node in nodes:
                pid = running[node.node_id]
                assert pid is not None
                budget = settings.start_timeout_s if wait_timeout is None else wait_timeout
                _wait_until_answering(pid, settings, _Paths.of(settings, node.node_id), node, budget)
        except BaseException:
            # Never leave a half-started JVM behind (timeout, Ctrl-C). Only signal one while it
            # is unreaped: once reaped, its pid may already belong to another process.
            for node_id, child in launched.items():
                if child.poll() is None:
                    log.warning("stopping the kafka broker that did not start", node=node_id, pid=child.pid)
                    _terminate(child.pid, timeout=10.0)
                _children.pop(child.pid, None)
                _Paths.of(settings, node_id).pid_file.unlink(missing_ok=True)
            raise
        pids = {node_id: pid for node_id, pid in running.items() if pid is not None}
        info = BrokerInfo(
            bootstrap=settings.bootstrap_servers,
            external=False,
            started=bool(launched),
            pid=pids[1],
            pids=pids,
            data_dir=root.kafka_dir if settings.kafka_brokers == 1 else root.kafka_dir.parent,
            log_file=root.server_log,
            seconds=round(time.monotonic() - began, 2),
        )
        if launched:
            log.info("local kafka ready", nodes=sorted(launched), bootstrap=info.bootstrap, seconds=info.seconds)
        return info


def _terminate(pid: int, timeout: float) -> None:
    """SIGTERM (Kafka shuts down cleanly), then SIGKILL when it takes longer than ``timeout``."""
    _terminate_all([pid], timeout)


def _terminate_all(pids: list[int], timeout: float) -> None:
    # All at once: a cluster's nodes stopped one by one would leave the last without a quorum,
    # waiting out its controlled shutdown.
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for pid in pids:
        if _wait_exit(pid, max(0.0, deadline - time.monotonic())):
            continue
        log.warning("kafka broker ignored SIGTERM; killing it", pid=pid, timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if not _wait_exit(pid, 10.0):
            raise BrokerError(f"the local Kafka broker (pid {pid}) survived SIGKILL")


def stop(settings: Settings, *, timeout: float = 30.0) -> bool:
    """Stop the local broker (every node of the local cluster); True if one was running.

    Only a process whose command line is ``java ... kafka.Kafka <our server.properties>`` is
    signalled, so a pid reused by another program is never killed.
    """
    settings = with_local_layout(settings)
    root = _Paths.of(settings, 1)
    if not root.kafka_dir.exists() and not root.cluster_id.parent.exists():
        return False
    with _locked(root):
        running = _running_nodes(settings)
        if not running:
            return False
        log.info("stopping local kafka", pids=running)
        began = time.monotonic()
        if len(running) > 1:
            # The last nodes of a cluster going down can lose their quorum in the middle of their
            # controlled shutdown and then wait it out (seen: 30 s); the whole cluster stops, so
            # there is no leadership left to hand over and a short grace is enough.
            timeout = min(timeout, CLUSTER_STOP_GRACE_S)
        _terminate_all(list(running.values()), timeout)
        for node_id in running:
            _Paths.of(settings, node_id).pid_file.unlink(missing_ok=True)
        log.info("local kafka stopped", nodes=sorted(running), seconds=round(time.monotonic() - began, 2))
        return True


def stop_node(settings: Settings, node_id: int, *, kill: bool = False, timeout: float = 30.0) -> int | None:
    """Stop one node of the local cluster (SIGKILL with ``kill``, as a crash); its pid, if it ran.

    :func:`start` brings it back. Used to rehearse failures: the other nodes keep serving.
    """
    settings = with_local_layout(settings)
    if not 1 <= node_id <= settings.kafka_brokers:
        raise ConfigError(f"node {node_id}: the local cluster has nodes 1 to {settings.kafka_brokers}")
    paths = _Paths.of(settings, node_id)
    with _locked(paths):
        pid = _running_pid(paths)
        if pid is None:
            return None
        log.info("stopping local kafka node", node=node_id, pid=pid, kill=kill)
        if kill:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if not _wait_exit(pid, 10.0):
                raise BrokerError(f"the local Kafka broker (pid {pid}) survived SIGKILL")
        else:
            _terminate(pid, timeout)
        paths.pid_file.unlink(missing_ok=True)
        return pid


def _running_nodes(settings: Settings) -> dict[int, int]:
    pids = {node: _running_pid(_Paths.of(settings, node)) for node in range(1, settings.kafka_brokers + 1)}
    return {node: pid for node, pid in pids.items() if pid is not None}


def active_controller(settings: Settings) -> int | None:
    """The node id of the local cluster's active KRaft controller, as its live voters record it.

    Each voter keeps its view of the quorum in ``__cluster_metadata-0/quorum-state``; the view
    with the newest epoch wins, and a leader that is not running is no leader.
    """
    settings = with_local_layout(settings)
    running = _running_nodes(settings)
    best: tuple[int, int] | None = None  # (epoch, leader)
    for node_id in running:
        path = _Paths.of(settings, node_id).data / "__cluster_metadata-0" / "quorum-state"
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        epoch, leader = int(state.get("leaderEpoch", -1)), int(state.get("leaderId", -1))
        if leader in running and (best is None or epoch > best[0]):
            best = (epoch, leader)
    return best[1] if best is not None else None


def nodes_status(settings: Settings) -> list[BrokerStatus]:
    """Each local node: whether it runs and answers. Changes nothing."""
    settings = with_local_layout(settings)
    found = []
    for node in cluster_nodes(settings):
        paths = _Paths.of(settings, node.node_id)
        pid = _running_pid(paths, clean=False)
        local = f"{settings.kafka_host}:{node.port}"
        # A running broker keeps the ports it was started with, whatever the settings say now.
        bootstrap = (_configured_bootstrap(paths) or local) if pid is not None else local
        host, _, port = bootstrap.rpartition(":")
        found.append(
            BrokerStatus(
                running=pid is not None,
                answering=pid is not None and probe.answering(settings, host, int(port)),
                pid=pid,
                bootstrap=bootstrap,
                data_dir=paths.kafka_dir,
                log_file=paths.server_log,
                node_id=node.node_id,
            )
        )
    return found


def status(settings: Settings) -> BrokerStatus:
    """The local broker as a whole (node 1's pid and files); running and answering when every node is."""
    nodes = nodes_status(settings)
    if len(nodes) == 1:
        return nodes[0]
    return nodes[0].model_copy(
        update={
            "running": all(n.running for n in nodes),
            "answering": all(n.answering for n in nodes),
            "bootstrap": ",".join(n.bootstrap for n in nodes),
        }
    )

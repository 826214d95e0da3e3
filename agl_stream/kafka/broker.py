"""The local Apache Kafka broker or cluster: start, stop, inspect (its jars and Java: ``jars.py``;
its nodes, files and ``server.properties``: ``layout.py``; its JVMs: ``jvm.py``; its TLS, SCRAM
and ACL settings: ``security.py``).

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

import errno
import json
import socket
import subprocess
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from agl_stream.config import Settings
from agl_stream.errors import BrokerError, ConfigError
from agl_stream.kafka import jvm, probe, security
from agl_stream.kafka.jars import check_prerequisites, ensure_jars
from agl_stream.kafka.layout import (
    NodePaths,
    check_start_settings,
    cluster_nodes,
    configured_bootstrap,
    server_properties,
    with_local_layout,
    write_layout,
)
from agl_stream.logs import get_logger

log = get_logger(__name__)

CLUSTER_STOP_GRACE_S = 10.0


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


def _settings_from_config(settings: Settings, paths: NodePaths) -> Settings:
    """Settings pointing at the host:port a running single broker was started with."""
    bootstrap = configured_bootstrap(paths)
    if settings.kafka_brokers != 1 or bootstrap is None or bootstrap == settings.bootstrap_servers:
        return settings
    host, _, port = bootstrap.rpartition(":")
    log.warning(
        "a local kafka broker is already running on other ports; stop it to change them",
        running=bootstrap,
        requested=settings.bootstrap_servers,
    )
    return settings.model_copy(update={"kafka_host": host, "kafka_port": int(port)})


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
    nodes = check_start_settings(settings)
    root = NodePaths.of(settings, 1)
    with jvm.locked(root):
        if settings.kafka_brokers > 1:
            write_layout(settings)
        running = _running_nodes(settings)
        if settings.kafka_brokers == 1 and running:
            settings = _settings_from_config(settings, root)
            nodes = cluster_nodes(settings)
        paths = {node.node_id: NodePaths.of(settings, node.node_id) for node in nodes}
        missing = [node for node in nodes if node.node_id not in running]
        # Fail fast and clearly, before Maven or the JVM run.
        option = "--controller-port / AGL_KAFKA_CONTROLLER_PORT"
        for node in missing:
            _check_port_free(settings.kafka_host, node.port, "the client port", "--port / AGL_KAFKA_PORT")
            _check_port_free(security.controller_host(settings), node.controller_port, "the controller port", option)
        launched: dict[int, subprocess.Popen[bytes]] = {}
        if missing:
            tools = check_prerequisites(maven=False)  # ensure_jars asks for Maven if it needs it
            libs = ensure_jars(settings)
            for node in missing:
                properties = server_properties(settings, paths[node.node_id], node, nodes)
                jvm.prepare(tools.java, libs, paths[node.node_id], settings, properties)
            # Every node is launched before any is waited for: a KRaft quorum answers only once a
            # majority of its voters runs.
            for node in missing:
                child = launched[node.node_id] = jvm.launch(tools.java, libs, paths[node.node_id], settings)
                running[node.node_id] = child.pid
                log.info("starting local kafka broker", node=node.node_id, pid=child.pid, port=node.port)
        try:
            budget = settings.start_timeout_s if wait_timeout is None else wait_timeout
            for node in nodes:
                jvm.wait_until_answering(running[node.node_id], settings, paths[node.node_id], node, budget)
        except BaseException:
            # Never leave a half-started JVM behind (timeout, Ctrl-C).
            for node_id, child in launched.items():
                jvm.abandon(child, paths[node_id], node_id)
            raise
        info = BrokerInfo(
            bootstrap=settings.bootstrap_servers,
            external=False,
            started=bool(launched),
            pid=running[1],
            pids=dict(sorted(running.items())),
            data_dir=root.kafka_dir if settings.kafka_brokers == 1 else root.kafka_dir.parent,
            log_file=root.server_log,
            seconds=round(time.monotonic() - began, 2),
        )
        if launched:
            log.info("local kafka ready", nodes=sorted(launched), bootstrap=info.bootstrap, seconds=info.seconds)
        return info


def stop(settings: Settings, *, timeout: float = 30.0) -> bool:
    """Stop the local broker (every node of the local cluster); True if one was running (only our
    JVMs are ever signalled: see ``jvm.py``)."""
    settings = with_local_layout(settings)
    root = NodePaths.of(settings, 1)
    if not root.kafka_dir.exists() and not root.cluster_id.parent.exists():
        return False
    with jvm.locked(root):
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
        jvm.terminate(list(running.values()), timeout)
        for node_id in running:
            NodePaths.of(settings, node_id).pid_file.unlink(missing_ok=True)
        log.info("local kafka stopped", nodes=sorted(running), seconds=round(time.monotonic() - began, 2))
        return True


def stop_node(settings: Settings, node_id: int, *, kill: bool = False, timeout: float = 30.0) -> int | None:
    """Stop one node of the local cluster (SIGKILL with ``kill``, as a crash); its pid, if it ran.

    :func:`start` brings it back. Used to rehearse failures: the other nodes keep serving.
    """
    settings = with_local_layout(settings)
    if not 1 <= node_id <= settings.kafka_brokers:
        raise ConfigError(f"node {node_id}: the local cluster has nodes 1 to {settings.kafka_brokers}")
    paths = NodePaths.of(settings, node_id)
    with jvm.locked(paths):
        pid = jvm.running_pid(paths)
        if pid is None:
            return None
        log.info("stopping local kafka node", node=node_id, pid=pid, kill=kill)
        if kill:
            jvm.kill(pid)
        else:
            jvm.terminate([pid], timeout)
        paths.pid_file.unlink(missing_ok=True)
        return pid


def _running_nodes(settings: Settings) -> dict[int, int]:
    pids = {node: jvm.running_pid(NodePaths.of(settings, node)) for node in range(1, settings.kafka_brokers + 1)}
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
        path = NodePaths.of(settings, node_id).data / "__cluster_metadata-0" / "quorum-state"
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
        paths = NodePaths.of(settings, node.node_id)
        pid = jvm.running_pid(paths, clean=False)
        local = f"{settings.kafka_host}:{node.port}"
        # A running broker keeps the ports it was started with, whatever the settings say now.
        bootstrap = (configured_bootstrap(paths) or local) if pid is not None else local
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

"""The local broker's layout as pure settings: its nodes and their ports, each node's files, the
node count and ports a data dir remembers (``<kafka dir>/brokers``), the checks a start makes
before anything runs, and each node's ``server.properties``. The processes are ``jvm.py``'s,
the start and stop ``broker.py``'s.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from agl_stream.config import Settings
from agl_stream.errors import ConfigError
from agl_stream.kafka import security


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
class NodePaths:
    """The files of one node (see ``broker.py``'s docstring)."""

    kafka_dir: Path
    config: Path
    data: Path
    cluster_id: Path
    pid_file: Path
    console_log: Path
    server_log: Path
    lock: Path

    @classmethod
    def of(cls, settings: Settings, node_id: int = 1) -> NodePaths:
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


def layout_file(settings: Settings) -> Path:
    return settings.kafka_dir.expanduser().resolve() / "brokers"


def _read_layout(settings: Settings) -> dict[str, int]:
    """What ``<kafka dir>/brokers`` recorded: the node count and the first node's two ports
    (a file of an older version holds the count alone); empty when there is none."""
    try:
        value = json.loads(layout_file(settings).read_text().strip())
    except (OSError, ValueError):
        return {}
    if isinstance(value, int):
        return {"brokers": value}
    if not isinstance(value, dict):
        return {}
    return {key: value[key] for key in ("brokers", "port", "controller_port") if isinstance(value.get(key), int)}


def write_layout(settings: Settings) -> None:
    layout = {
        "brokers": settings.kafka_brokers,
        "port": settings.kafka_port,
        "controller_port": settings.kafka_controller_port,
    }
    layout_file(settings).write_text(json.dumps(layout) + "\n")


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


def check_start_settings(settings: Settings) -> list[Node]:
    """The nodes to start, once the settings are found fit to start them (ConfigError otherwise)."""
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


def _request_threads(cpus: int) -> dict[str, str]:
    return {"num.io.threads": str(max(2, min(8, cpus))), "num.network.threads": str(max(1, min(3, cpus // 2)))}


def server_properties(settings: Settings, paths: NodePaths, node: Node, nodes: list[Node]) -> str:
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
        # Request threads for the cores there are (Kafka's defaults, 8 and 3, are a server's):
        # each idle thread wakes a few times a second, and under load more threads than cores
        # only take turns.
        **_request_threads(os.cpu_count() or 1),
        # Topics come from topic declarations (agl-stream's topic tool), never from a typo.
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        # Retention stays at Kafka's defaults (7 days); each declared topic sets its own.
        **(security.security_properties(settings) if secured else {}),
    }
    header = (
        "# Written by agl-stream (agl_stream/kafka/layout.py) on every start; edits are lost.\n"
        "# Change ports with AGL_KAFKA_PORT / AGL_KAFKA_CONTROLLER_PORT or `agl-stream kafka start"
        " --port`.\n"
    )
    return header + "".join(f"{key}={security.property_value(value)}\n" for key, value in props.items())


def configured_bootstrap(paths: NodePaths) -> str | None:
    """host:port the broker was last started with (from its server.properties)."""
    try:
        text = paths.config.read_text()
    except OSError:
        return None
    match = re.search(r"^advertised\.listeners=[A-Z_]+://(\S+)$", text, re.MULTILINE)
    return match.group(1) if match else None

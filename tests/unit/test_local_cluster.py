"""The local cluster's layout as pure settings: node ports, each node's server.properties, and the
node count a data dir remembers. The cluster itself runs in tests/integration/test_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_stream.config import Settings
from agl_stream.errors import ConfigError
from agl_stream.kafka import broker, layout


def _settings(tmp_path: Path, **values: object) -> Settings:
    return Settings(kafka_bootstrap=None, data_dir=tmp_path, **values)  # type: ignore[arg-type]


def _properties(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    return {key: value for key, value in pairs}


def test_node_i_listens_two_ports_above_the_last(tmp_path: Path) -> None:
    settings = _settings(tmp_path, kafka_brokers=3, kafka_port=19092, kafka_controller_port=19093)
    assert layout.cluster_nodes(settings) == [
        layout.Node(1, 19092, 19093),
        layout.Node(2, 19094, 19095),
        layout.Node(3, 19096, 19097),
    ]
    assert settings.bootstrap_servers == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"


def test_one_broker_keeps_its_ports_and_layout(tmp_path: Path) -> None:
    settings = _settings(tmp_path, kafka_port=19092, kafka_controller_port=19093)
    assert layout.cluster_nodes(settings) == [layout.Node(1, 19092, 19093)]
    assert settings.bootstrap_servers == "127.0.0.1:19092"
    paths = layout.NodePaths.of(settings)
    assert paths.config == (tmp_path / "kafka" / "server.properties").resolve()


@pytest.mark.parametrize(("port", "controller"), [(19092, 19094), (65532, 65533)])
def test_ports_that_collide_or_overflow_are_refused(tmp_path: Path, port: int, controller: int) -> None:
    settings = _settings(tmp_path, kafka_brokers=3, kafka_port=port, kafka_controller_port=controller)
    with pytest.raises(ConfigError, match="need the ports"):
        layout.cluster_nodes(settings)


def test_each_node_is_a_voter_of_one_quorum_with_replicated_internal_topics(tmp_path: Path) -> None:
    settings = _settings(tmp_path, kafka_brokers=3, kafka_port=19092, kafka_controller_port=19093)
    nodes = layout.cluster_nodes(settings)
    texts = [layout.server_properties(settings, layout.NodePaths.of(settings, n.node_id), n, nodes) for n in nodes]
    props = [_properties(text) for text in texts]
    assert [p["node.id"] for p in props] == ["1", "2", "3"]
    voters = "1@127.0.0.1:19093,2@127.0.0.1:19095,3@127.0.0.1:19097"
    assert {p["controller.quorum.voters"] for p in props} == {voters}
    assert props[1]["listeners"] == "PLAINTEXT://127.0.0.1:19094,CONTROLLER://127.0.0.1:19095"
    assert props[2]["log.dirs"] == str((tmp_path / "kafka" / "node-3" / "data").resolve())
    for p in props:
        assert p["offsets.topic.replication.factor"] == "3"
        assert p["transaction.state.log.min.isr"] == "2"


def test_a_single_broker_replicates_internal_topics_once(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    [node] = layout.cluster_nodes(settings)
    props = _properties(layout.server_properties(settings, layout.NodePaths.of(settings), node, [node]))
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["transaction.state.log.min.isr"] == "1"
    assert props["controller.quorum.voters"] == f"1@127.0.0.1:{settings.kafka_controller_port}"


def test_a_data_dir_remembers_its_cluster_size(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    assert layout.with_local_layout(settings).kafka_brokers == 1
    (tmp_path / "kafka").mkdir()
    (tmp_path / "kafka" / "brokers").write_text("3\n")
    assert layout.with_local_layout(settings).kafka_brokers == 3
    # Said explicitly (or an external cluster) wins over what the data dir remembers.
    assert layout.with_local_layout(settings.model_copy(update={"kafka_brokers": 5})).kafka_brokers == 5
    external = settings.model_copy(update={"kafka_bootstrap": "elsewhere:9092"})
    assert layout.with_local_layout(external).kafka_brokers == 1


def test_a_single_brokers_data_dir_does_not_become_a_cluster(tmp_path: Path) -> None:
    (tmp_path / "kafka" / "data").mkdir(parents=True)
    (tmp_path / "kafka" / "data" / "meta.properties").write_text("node.id=1\n")
    settings = _settings(tmp_path, kafka_brokers=3)
    with pytest.raises(ConfigError, match="single broker's data"):
        broker.start(settings)


def test_a_cluster_refuses_a_secured_listener(tmp_path: Path) -> None:
    settings = _settings(
        tmp_path,
        kafka_brokers=3,
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-256",
        kafka_sasl_username="agl",
    )
    with pytest.raises(ConfigError, match="PLAINTEXT only"):
        broker.start(settings)


def test_stop_node_names_the_nodes_there_are(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nodes 1 to 3"):
        broker.stop_node(_settings(tmp_path, kafka_brokers=3), 4)


@pytest.mark.parametrize(("cpus", "io", "network"), [(1, "2", "1"), (2, "2", "1"), (4, "4", "2"), (64, "8", "3")])
def test_request_threads_follow_the_cores_up_to_kafkas_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: int, io: str, network: str
) -> None:
    monkeypatch.setattr(layout.os, "cpu_count", lambda: cpus)
    settings = _settings(tmp_path)
    [node] = layout.cluster_nodes(settings)
    props = _properties(layout.server_properties(settings, layout.NodePaths.of(settings), node, [node]))
    assert (props["num.io.threads"], props["num.network.threads"]) == (io, network)

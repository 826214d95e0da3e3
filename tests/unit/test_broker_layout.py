"""A local cluster's data dir remembers its layout: later commands that do not name the node
count or the ports use the ones it was made with (a restarted node is looked for there)."""

from __future__ import annotations

from pathlib import Path

from agl_stream.config import Settings
from agl_stream.kafka import layout


def test_a_cluster_dir_keeps_its_node_count_and_ports(tmp_path: Path) -> None:
    made = Settings(data_dir=tmp_path, kafka_brokers=3, kafka_port=31000, kafka_controller_port=31001)
    layout.layout_file(made).parent.mkdir(parents=True)
    layout.write_layout(made)

    later = layout.with_local_layout(Settings(data_dir=tmp_path))  # no count, no ports named
    assert (later.kafka_brokers, later.kafka_port, later.kafka_controller_port) == (3, 31000, 31001)
    assert later.bootstrap_servers == "127.0.0.1:31000,127.0.0.1:31002,127.0.0.1:31004"
    assert [node.port for node in layout.cluster_nodes(later)] == [31000, 31002, 31004]

    named = layout.with_local_layout(Settings(data_dir=tmp_path, kafka_port=32000))  # a port named wins
    assert (named.kafka_brokers, named.kafka_port, named.kafka_controller_port) == (3, 32000, 31001)


def test_a_layout_file_of_an_older_version_holds_the_count_alone(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    layout.layout_file(settings).parent.mkdir(parents=True)
    layout.layout_file(settings).write_text("3\n")
    later = layout.with_local_layout(settings)
    assert (later.kafka_brokers, later.kafka_port) == (3, 9092)


def test_a_single_broker_dir_has_no_layout(tmp_path: Path) -> None:
    assert layout.with_local_layout(Settings(data_dir=tmp_path)).kafka_brokers == 1

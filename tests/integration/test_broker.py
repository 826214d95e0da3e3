"""The local Kafka broker: start, answer, stop, restart on the same data, and what goes wrong.

The lifecycle tests start their own brokers (not the session one from conftest) because
stopping and restarting is what they test. The rest needs no JVM and runs everywhere.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from agl_stream.config import Settings
from agl_stream.errors import BrokerError, PrerequisiteError
from agl_stream.kafka import broker, jars, layout
from agl_stream.ports import free_ports

needs_java = pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"), reason="no Java here")


def _local(data_dir: Path, **overrides: object) -> Settings:
    """Settings for a broker of our own on free ports, whatever AGL_KAFKA_BOOTSTRAP says."""
    port, controller_port = free_ports(2)
    values: dict[str, object] = {
        "kafka_bootstrap": None,
        "data_dir": data_dir,
        "kafka_port": port,
        "kafka_controller_port": controller_port,
        **overrides,
    }
    return Settings(**values)  # type: ignore[arg-type]


def _assert_gone(pid: int, settings: Settings) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    for port in (settings.kafka_port, settings.kafka_controller_port):
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((settings.kafka_host, port), timeout=2).close()


async def _create_topic(settings: Settings, name: str) -> None:
    admin = AIOKafkaAdminClient(**settings.kafka_client_options())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()


async def _topics(settings: Settings) -> set[str]:
    admin = AIOKafkaAdminClient(**settings.kafka_client_options())
    await admin.start()
    try:
        return set(await admin.list_topics())
    finally:
        await admin.close()


async def _produce(settings: Settings, topic: str, value: bytes) -> None:
    producer = AIOKafkaProducer(**settings.kafka_client_options(), enable_idempotence=True)
    await producer.start()
    try:
        await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()


async def _first_value(settings: Settings, topic: str) -> bytes:
    consumer = AIOKafkaConsumer(
        topic,
        **settings.kafka_client_options(),
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        record = await asyncio.wait_for(consumer.getone(), timeout=30)
    finally:
        await consumer.stop()
    assert isinstance(record.value, bytes)
    return record.value


def _jvm_options(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


# -- the real broker ----------------------------------------------------------------------


@pytest.mark.integration
@needs_java
def test_start_answer_stop_restart_on_same_data(tmp_path: Path) -> None:
    first = _local(tmp_path, kafka_jit="c1")
    info = broker.start(first)
    try:
        assert info.started and not info.external and info.pid is not None
        assert "-XX:TieredStopAtLevel=1" in _jvm_options(info.pid)  # C1 only, as asked
        # No JVM perf-data file (nothing samples it), and request threads sized to the cores.
        assert "-XX:-UsePerfData" in _jvm_options(info.pid)
        assert not list(Path("/tmp").glob(f"hsperfdata_*/{info.pid}"))  # HotSpot's fixed place
        written = layout.NodePaths.of(first).config
        properties = dict(
            line.split("=", 1) for line in written.read_text().splitlines() if "=" in line and not line.startswith("#")
        )
        assert int(properties["num.io.threads"]) == max(2, min(8, os.cpu_count() or 1))
        assert info.bootstrap == f"127.0.0.1:{first.kafka_port}"
        # Starting again is a no-op that reports the running broker.
        again = broker.start(first)
        assert (again.started, again.pid) == (False, info.pid)
        state = broker.status(first)
        assert state.running and state.answering and state.pid == info.pid

        asyncio.run(_create_topic(first, "keep"))
        asyncio.run(_produce(first, "keep", b"survives a restart"))
        assert asyncio.run(_first_value(first, "keep")) == b"survives a restart"
    finally:
        stopped = broker.stop(first)
    assert stopped
    _assert_gone(info.pid, first)
    assert not (first.kafka_dir / "broker.pid").exists()
    assert not broker.status(first).running
    assert broker.stop(first) is False  # nothing left to stop

    # Same data dir, other ports: the existing storage is reused, not reformatted. The JIT of
    # a long-lived broker (the default): Java's tiered compilers.
    second = _local(tmp_path, kafka_jit="tiered")
    info2 = broker.start(second)
    try:
        assert info2.started and info2.pid != info.pid
        assert info2.pid is not None and not any("TieredStopAtLevel" in o for o in _jvm_options(info2.pid))
        assert info2.bootstrap == f"127.0.0.1:{second.kafka_port}"
        assert "keep" in asyncio.run(_topics(second))
        assert asyncio.run(_first_value(second, "keep")) == b"survives a restart"
    finally:
        assert broker.stop(second)
    assert info2.pid is not None
    _assert_gone(info2.pid, second)


@pytest.mark.integration
@needs_java
def test_broker_that_dies_at_start_up_explains_itself(tmp_path: Path) -> None:
    # A 1 KiB heap: the JVM refuses to start, as a broken Java or config would make it.
    settings = _local(tmp_path, kafka_heap="1k")
    with pytest.raises(BrokerError, match="exited during start-up") as caught:
        broker.start(settings)
    assert "heap" in str(caught.value).lower()  # the JVM's own words, from broker.out
    assert not (settings.kafka_dir / "broker.pid").exists()
    assert not broker.status(settings).running


@pytest.mark.integration
@needs_java
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_start_that_times_out_leaves_no_process(tmp_path: Path) -> None:
    settings = _local(tmp_path)
    with pytest.raises(BrokerError, match="did not answer"):
        broker.start(settings, wait_timeout=0.2)  # far shorter than a JVM start
    config = str(settings.kafka_dir / "server.properties")
    leftovers = [
        proc.name
        for proc in Path("/proc").iterdir()
        if proc.name.isdigit() and config.encode() in _read_or_empty(proc / "cmdline")
    ]
    assert leftovers == []
    assert not (settings.kafka_dir / "broker.pid").exists()


def _read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process exited while we looked
        return b""


# -- no JVM needed ------------------------------------------------------------------------


def test_port_in_use_is_reported_before_anything_runs(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        settings = _local(tmp_path, kafka_port=taken)
        with pytest.raises(BrokerError, match=rf"127\.0\.0\.1:{taken} is already in use"):
            broker.start(settings)
    assert not (settings.kafka_dir / "server.properties").exists()


def test_external_cluster_starts_nothing(tmp_path: Path) -> None:
    settings = Settings(kafka_bootstrap="kafka.example:9092", data_dir=tmp_path)
    info = broker.start(settings)
    assert info.external and not info.started and info.pid is None
    assert info.bootstrap == "kafka.example:9092"
    assert not settings.kafka_dir.exists()


@pytest.fixture
def unrelated_process() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not a Kafka broker (what a reused pid would point at)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _exited_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()  # reaped: the pid now names no process
    return process.pid


@pytest.mark.parametrize("kind", ["exited", "reused", "garbage"])
def test_stale_pid_file_is_cleaned_and_never_killed(
    tmp_path: Path, kind: str, unrelated_process: subprocess.Popen[bytes]
) -> None:
    settings = _local(tmp_path)
    settings.kafka_dir.mkdir(parents=True)
    pid_file = settings.kafka_dir / "broker.pid"
    content = {"exited": str(_exited_pid()), "reused": str(unrelated_process.pid)}.get(kind, "x")
    pid_file.write_text(content + "\n")

    state = broker.status(settings)
    assert not state.running and state.pid is None
    assert pid_file.exists()  # status only looks
    assert broker.stop(settings) is False
    assert not pid_file.exists()
    assert unrelated_process.poll() is None  # the innocent process still runs


# -- prerequisites ------------------------------------------------------------------------


def _fake_java(folder: Path, version_line: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    java = folder / "java"
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return java


def test_missing_java_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # neither java nor mvn here
    with pytest.raises(PrerequisiteError) as caught:
        jars.check_prerequisites()
    message = str(caught.value)
    assert "Java 17+" in message
    assert "apt-get install openjdk-17-jdk-headless" in message
    assert "JAVA_HOME" in message


def test_missing_maven_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    _fake_java(tmp_path, 'openjdk version "17.0.15" 2025-04-15')
    monkeypatch.setenv("PATH", str(tmp_path))
    assert jars.check_prerequisites(maven=False).java_version == 17
    with pytest.raises(PrerequisiteError, match=r"apt-get install maven"):
        jars.check_prerequisites()


def test_java_home_wins_and_old_java_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_java(tmp_path / "path", 'openjdk version "21.0.2" 2024-01-16')
    _fake_java(tmp_path / "jdk8" / "bin", 'java version "1.8.0_292"')
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk8"))
    with pytest.raises(PrerequisiteError, match=r"is Java 8; .* needs Java 17\+"):
        jars.check_prerequisites(maven=False)
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "nothing-here"))
    with pytest.raises(PrerequisiteError, match=r"JAVA_HOME=.*has no executable bin/java"):
        jars.check_prerequisites(maven=False)
    monkeypatch.delenv("JAVA_HOME")
    assert jars.check_prerequisites(maven=False).java_version == 21


@pytest.mark.parametrize(
    ("line", "major"),
    [
        ('java version "1.8.0_292"', 8),
        ('openjdk version "11.0.2" 2019-01-15', 11),
        ('openjdk version "17.0.15" 2025-04-15', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('openjdk version "25-ea" 2025-09-16', 25),
    ],
)
def test_java_version_parsing(tmp_path: Path, line: str, major: int) -> None:
    assert jars.java_major_version(_fake_java(tmp_path, line)) == major

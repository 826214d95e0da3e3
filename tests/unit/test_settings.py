"""Settings: environment, precedence, and the README table staying complete."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from agl_stream.config import Settings, load_settings
from agl_stream.errors import ConfigError

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_setting_is_documented_in_the_readme() -> None:
    text = README.read_text()
    missing = [n for n in Settings.model_fields if f"`AGL_{n.upper()}`" not in text]
    assert not missing, f"add these to the README's Settings table: {missing}"


def test_environment_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGL_TOPIC_PREFIX", "fromenv")
    monkeypatch.setenv("AGL_DATA_DIR", str(tmp_path))
    assert Settings().topic("spans") == "fromenv.spans"
    assert load_settings(topic_prefix="fromflag", kafka_bootstrap=None).topic_prefix == "fromflag"
    assert Settings().chdb_dir == tmp_path / "clickhouse"


def test_local_broker_unless_bootstrap_given() -> None:
    local = Settings(kafka_port=19000)
    assert local.uses_local_broker and local.bootstrap_servers == "127.0.0.1:19000"
    remote = Settings(kafka_bootstrap="k1:9092,k2:9092")
    assert not remote.uses_local_broker and remote.bootstrap_servers == "k1:9092,k2:9092"


def test_sasl_settings_pass_through_to_clients() -> None:
    s = Settings(
        kafka_bootstrap="k:9093",
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="u",
        kafka_sasl_password="p",
    )
    options = s.kafka_client_options()
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["sasl_plain_username"] == "u" and options["sasl_plain_password"] == "p"
    with pytest.raises(ConfigError, match="AGL_KAFKA_SASL_MECHANISM"):
        Settings(kafka_security_protocol="SASL_SSL").kafka_client_options()


def test_bad_values_are_rejected_with_the_field_name() -> None:
    with pytest.raises(ValidationError, match="clickhouse_url"):
        Settings(clickhouse_url="tcp://x:9000")
    with pytest.raises(ValidationError, match="topic_prefix"):
        Settings(topic_prefix="bad prefix")


def test_a_local_broker_is_set_up_for_a_long_life_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    from agl_stream.kafka.jvm import _java
    from agl_stream.kafka.layout import NodePaths

    monkeypatch.delenv("AGL_KAFKA_JIT", raising=False)  # the test session sets c1 for its own brokers
    assert Settings().kafka_jit == "tiered"
    monkeypatch.setenv("AGL_KAFKA_JIT", "c1")
    assert Settings().kafka_jit == "c1"
    monkeypatch.setenv("AGL_KAFKA_JIT", "c2")
    with pytest.raises(ValidationError, match="kafka_jit"):
        Settings()
    paths = NodePaths.of(Settings(kafka_jit="c1"), 1)
    c1 = _java(Path("java"), Path("libs"), paths, "512m", "Main", "server.properties", "c1")
    tiered = _java(Path("java"), Path("libs"), paths, "512m", "Main", "server.properties", "tiered")
    assert "-XX:TieredStopAtLevel=1" in c1 and not any("Tiered" in option for option in tiered)

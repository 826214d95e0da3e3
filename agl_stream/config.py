"""One settings object for every knob. Environment variables (``AGL_*``) and CLI flags.

The table in README.md ("Settings") lists every field; keep the two in step.
"""

from __future__ import annotations

import os
import ssl
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SecretsSettingsSource, SettingsConfigDict

from agl_stream.errors import ConfigError

KAFKA_VERSION = "4.1.1"

SECRETS_DIR_ENV = "AGL_SECRETS_DIR"
"""A directory of 0600 files, one per secret setting (``agl_clickhouse_password``...): how the
roles a parent starts receive secrets, since a process's environment is readable in
``/proc/<pid>/environ`` and copied into every grandchild."""


def _default_data_dir() -> Path:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "agl-stream"


def _default_kafka_libs_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "agl-stream" / f"kafka-{KAFKA_VERSION}" / "libs"


KafkaJit = Literal["tiered", "c1"]
"""The local broker's JIT compilers (``Settings.kafka_jit``)."""


class Settings(BaseSettings):
    """Every setting of agl-stream. Each field ``x`` is read from ``AGL_X``."""

    model_config = SettingsConfigDict(env_prefix="AGL_", extra="forbid", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        secrets_dir = os.environ.get(SECRETS_DIR_ENV)
        if secrets_dir:  # flags and the environment still win over the files
            file_secret_settings = SecretsSettingsSource(settings_cls, secrets_dir=secrets_dir)
        return init_settings, env_settings, dotenv_settings, file_secret_settings

    # -- local state -------------------------------------------------------------------------
    data_dir: Path = Field(
        default_factory=_default_data_dir, description="Local state: broker data, embedded ClickHouse, pid files."
    )

    # -- Kafka -------------------------------------------------------------------------------
    kafka_bootstrap: str | None = Field(
        None, description="Bootstrap servers of an existing cluster. When set, agl-stream starts no broker."
    )
    kafka_host: str = Field("127.0.0.1", description="Address the local broker binds to.")
    kafka_port: int = Field(9092, ge=1, le=65535, description="Client port of the local broker.")
    kafka_controller_port: int = Field(9093, ge=1, le=65535, description="KRaft controller port of the local broker.")
    kafka_heap: str = Field("512m", description="JVM heap (-Xmx) of the local broker.")
    kafka_jit: KafkaJit = Field(
        "tiered",
        description=(
            "JIT compilers of the local broker's JVM: `tiered` (Java's default, C1 then C2: the cheaper "
            "broker once warm, after ~10 s of load) or `c1` (C1 only: no C2 compiling while a short-lived "
            "broker works, as in tests, benchmarks and the demo)."
        ),
    )
    kafka_brokers: int = Field(
        1,
        ge=1,
        le=9,
        description="Nodes of the local cluster (each a broker and a KRaft voter); node i uses port+2(i-1).",
    )
    kafka_libs_dir: Path = Field(
        default_factory=_default_kafka_libs_dir, description="Where Maven puts the Kafka server jars."
    )
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Security protocol for every Kafka client."
    )
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI"] | None = Field(
        None, description="SASL mechanism."
    )
    kafka_sasl_username: str | None = Field(None, description="SASL user name.")
    kafka_sasl_password: SecretStr | None = Field(None, description="SASL password.")
    kafka_ssl_cafile: Path | None = Field(None, description="CA bundle that signs the brokers' certificates.")
    kafka_ssl_certfile: Path | None = Field(None, description="Client certificate (mutual TLS).")
    kafka_ssl_keyfile: Path | None = Field(None, description="Client private key (mutual TLS).")
    kafka_ssl_password: SecretStr | None = Field(None, description="Password of the client private key.")
    kafka_broker_keystore: Path | None = Field(
        None, description="PKCS12 keystore with the certificate and key of the local broker's SASL_SSL listener."
    )
    kafka_broker_keystore_password: SecretStr | None = Field(None, description="Password of that keystore.")
    topic_prefix: str = Field(
        "agl", pattern=r"^[A-Za-z0-9._-]+$", description="Prefix of every topic name, so projects can share a cluster."
    )
    replication_factor: int | None = Field(
        None, ge=1, description="Replication of created topics; default: the declaration's, capped at the broker count."
    )

    # -- producer tuning (passed to aiokafka) ----------------------------------------------------
    # aiokafka keeps one produce request in flight per broker, and what is sent meanwhile goes in
    # the next one: under load that fills batches without a timer, and a role's own sends of a
    # batch are all appended before its first request leaves. A linger only delays every hop
    # of a light load (design notes: "A producer that never waits").
    producer_linger_ms: int = Field(
        0, ge=0, description="How long the producer waits to fill a batch (one in flight per broker batches anyway)."
    )
    producer_max_batch_size: int = Field(
        1 << 20, ge=1024, description="Largest producer batch per partition, in bytes."
    )
    producer_compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        # zstd, not lz4: aiokafka's lz4 path measured 3x slower than zstd here (12k vs 38k msgs/s).
        "zstd",
        description="Producer compression codec.",
    )
    producer_max_request_size: int = Field(4 << 20, ge=1024, description="Largest produce request, in bytes.")

    # -- ClickHouse --------------------------------------------------------------------------
    clickhouse_url: str | None = Field(
        None,
        description="http(s)://host:port of a ClickHouse server. Unset: the embedded engine (chDB) under data_dir.",
    )
    clickhouse_user: str = Field("default", description="ClickHouse user (server only).")
    clickhouse_password: SecretStr | None = Field(None, description="ClickHouse password (server only).")
    clickhouse_database: str = Field(
        "agl", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Database holding agl-stream's tables."
    )
    clickhouse_reader_user: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_.-]*$",
        description="User the gateway's queries run as (server only): `clickhouse migrate` gives it the reader role.",
    )
    clickhouse_reader_password: SecretStr | None = Field(None, description="Password of the reader user.")
    clickhouse_verify_tls: bool = Field(True, description="Verify the server certificate on https.")
    clickhouse_ca_cert: Path | None = Field(None, description="CA bundle for the ClickHouse server certificate.")
    clickhouse_ttl_days: int = Field(
        0,
        ge=0,
        description="Days ClickHouse keeps spans, rollouts and attempts before deleting them (0: forever); "
        "applied by the migration step (docs/retention.md).",
    )
    sink_linger_ms: int = Field(
        5000,
        ge=0,
        le=600_000,
        description="How long the ClickHouse sinks of spans, rollout states and workers hold a batch before inserting "
        "it; a store read waiting for its records ends the wait at once, so only SQL and the dashboard see up to "
        "this much behind.",
    )

    # -- gateway (read side) -----------------------------------------------------------------
    gateway_host: str = Field("127.0.0.1", description="Address the gateway (sink + query API) binds to.")
    gateway_port: int = Field(8642, ge=0, le=65535, description="Port of the gateway's HTTP API (0: pick a free one).")
    api_token: SecretStr | None = Field(
        None, description="Token of the HTTP listeners. Unset: the one `up` writes to the data dir."
    )
    require_token: bool = Field(False, description="Listeners on loopback require the token too.")
    allowed_hosts: str = Field(
        "",
        description="Host names the HTTP listeners answer to besides loopback and their bind address, "
        'comma-separated ("*": any).',
    )
    gateway_url: str | None = Field(
        None, description="URL of a running gateway for clients; unset: the one `agl-stream up` recorded."
    )

    request_timeout_s: float = Field(
        60.0, gt=0, description="How long a store call waits for the rollout processor's answer."
    )

    # -- starting processes (the local stack, the demo, Trainer.fit; agl_stream/local/processes.py) ------
    start_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest a role or the local broker may take to answer after it started, while it runs "
        "(one that exits fails at once); a busy machine may need more.",
    )
    model_start_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="The same for model servers (`inference`, vLLM), whose first load may take many minutes.",
    )
    gc_threshold: int = Field(
        50_000,
        ge=0,
        le=100_000_000,
        description="Allocations between the young-generation collections of Python's garbage collector in a "
        "role process (Python's default is 700, a cost that grows with what a role holds); 0 keeps Python's.",
    )

    # -- SQL analytics (`GET/POST /v1/sql`, `agl-stream sql`) ----------------------------------
    sql_time_limit_s: float = Field(
        30.0, gt=0, le=3600, description="Longest an analytics query may run (ClickHouse max_execution_time)."
    )
    sql_max_memory_bytes: int = Field(
        2 << 30, ge=1 << 20, description="Memory an analytics query may use (ClickHouse max_memory_usage)."
    )
    sql_max_result_rows: int = Field(
        100_000, ge=1, description="Most rows an analytics query may return (ClickHouse max_result_rows)."
    )
    sql_max_result_bytes: int = Field(
        64 << 20, ge=1024, description="Largest result of an analytics query, in bytes (ClickHouse max_result_bytes)."
    )
    sql_concurrency: int = Field(4, ge=1, le=64, description="Analytics queries the gateway runs at once.")

    # -- OTLP from Kafka (the OpenTelemetry Collector's Kafka exporter) ---------------------------
    otlp_kafka_topic: str = Field(
        # The collector's topic, so never prefixed with topic_prefix.
        "otlp_spans",
        pattern=r"^[A-Za-z0-9._-]+$",
        description="Topic the collector's Kafka exporter writes OTLP traces to (not prefixed).",
    )
    otlp_kafka_group: str = Field(
        "agl-otlp-kafka", min_length=1, description="Consumer group of `agl-stream otlp-kafka` on that topic."
    )

    # -- rollout processor ---------------------------------------------------------------------
    watchdog_interval_s: float = Field(0.5, gt=0, description="Seconds between the processor's watchdog scans.")
    finished_retention_s: float = Field(
        60.0, ge=0, description="Seconds a finished rollout stays in the processor's memory before it is forgotten."
    )
    max_queued_per_partition: int = Field(
        50_000,
        ge=0,
        description=(
            "Most rollouts queued (queuing or requeuing) on one partition of agl.rollouts: the processor "
            "holds each in memory, so an enqueue past it is refused (QueueFullError; retries still "
            "requeue). 0: no limit."
        ),
    )

    # -- task ingress ----------------------------------------------------------------------------
    ingress_max_input_bytes: int = Field(
        512 * 1024, ge=1, le=900_000, description="Largest task request input, in bytes of JSON text."
    )
    ingress_max_metadata_bytes: int = Field(
        64 * 1024, ge=0, le=900_000, description="Largest task request metadata, in bytes of JSON text."
    )

    # -- metrics (Prometheus; agl_stream/metrics.py) ------------------------------------------
    metrics: bool = Field(
        True, description="Roles expose Prometheus metrics (false: the roles without HTTP start no endpoint)."
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address the metrics endpoint of a role without HTTP binds to (it has no token check)."
    )
    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of that endpoint (0: any free one; if taken: any free one)."
    )

    # -- logging -----------------------------------------------------------------------------
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    log_format: Literal["console", "json"] = Field(
        "console", description="Log rendering: console for people, json for log pipelines."
    )

    @field_validator("clickhouse_url")
    @classmethod
    def _check_clickhouse_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(
                "AGL_CLICKHOUSE_URL must start with http:// or https:// (unset it for the embedded engine)"
            )
        return value

    # -- derived values ----------------------------------------------------------------------
    @property
    def uses_local_broker(self) -> bool:
        return self.kafka_bootstrap is None

    @property
    def bootstrap_servers(self) -> str:
        if self.kafka_bootstrap:
            return self.kafka_bootstrap
        return ",".join(f"{self.kafka_host}:{self.kafka_port + 2 * i}" for i in range(self.kafka_brokers))

    @property
    def kafka_dir(self) -> Path:
        return self.data_dir / "kafka"

    @property
    def run_dir(self) -> Path:
        """Pid files and endpoints of the local stack's processes."""
        return self.data_dir / "run"

    def ready_file(self, role: str) -> Path:
        """Written by a consumer-group role once its first assignment is handled (``agl-stream up`` waits)."""
        return self.run_dir / f"{role}.ready"

    @property
    def chdb_dir(self) -> Path:
        return self.data_dir / "clickhouse"

    @property
    def uses_embedded_clickhouse(self) -> bool:
        return self.clickhouse_url is None

    def as_env(self) -> dict[str, str]:
        """These settings as AGL_* variables, so a child process sees the same configuration.

        Secrets are left out: :meth:`secrets` are handed over as files (``SECRETS_DIR_ENV``).
        """
        env = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if value is None or isinstance(value, SecretStr):
                continue
            env[f"AGL_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        return env

    def secrets(self) -> dict[str, str]:
        """The secret settings that are set, by the file name a secrets directory gives each."""
        return {
            f"agl_{name}": value.get_secret_value()
            for name in type(self).model_fields
            if isinstance(value := getattr(self, name), SecretStr)
        }

    @property
    def secrets_dir(self) -> Path:
        """Where the roles started from this data dir read their secrets (0700, files 0600)."""
        return self.run_dir / "secrets"

    def topic(self, name: str) -> str:
        """Full topic name: ``topic("rollouts")`` -> ``agl.rollouts``."""
        return f"{self.topic_prefix}.{name}"

    @cached_property
    def _ssl_context(self) -> ssl.SSLContext | None:
        if self.kafka_security_protocol not in ("SSL", "SASL_SSL"):
            return None
        context = ssl.create_default_context(cafile=str(self.kafka_ssl_cafile) if self.kafka_ssl_cafile else None)
        if self.kafka_ssl_certfile:
            context.load_cert_chain(
                str(self.kafka_ssl_certfile),
                str(self.kafka_ssl_keyfile) if self.kafka_ssl_keyfile else None,
                self.kafka_ssl_password.get_secret_value() if self.kafka_ssl_password else None,
            )
        return context

    @property
    def extra_hosts(self) -> list[str]:
        """``allowed_hosts`` as a list."""
        return [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]

    def kafka_client_options(self) -> dict[str, Any]:
        """Connection and security options shared by every aiokafka client."""
        options: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "security_protocol": self.kafka_security_protocol,
        }
        if self.kafka_security_protocol.startswith("SASL"):
            if self.kafka_sasl_mechanism is None:
                raise ConfigError(
                    f"AGL_KAFKA_SECURITY_PROTOCOL={self.kafka_security_protocol} needs AGL_KAFKA_SASL_MECHANISM"
                )
            options["sasl_mechanism"] = self.kafka_sasl_mechanism
            options["sasl_plain_username"] = self.kafka_sasl_username
            options["sasl_plain_password"] = (
                self.kafka_sasl_password.get_secret_value() if self.kafka_sasl_password else None
            )
        if self._ssl_context is not None:
            options["ssl_context"] = self._ssl_context
        return options


def load_settings(**overrides: Any) -> Settings:
    """Settings from the environment, with explicit values (CLI flags) taking precedence."""
    return Settings(**{k: v for k, v in overrides.items() if v is not None})

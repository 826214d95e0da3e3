"""What every faust processor of agl-stream shares: credentials and the app's base settings."""

from __future__ import annotations

from typing import Any

import faust

from agl_stream.config import Settings

RAW_TOPIC = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
"""Topic options for records faust must not touch: agl-stream decodes Avro itself."""


def faust_credentials(settings: Settings) -> Any:
    """The settings' SASL/TLS options in faust's terms (None for PLAINTEXT)."""
    options = settings.kafka_client_options()
    if settings.kafka_security_protocol.startswith("SASL"):
        return faust.SASLCredentials(
            username=options.get("sasl_plain_username"),
            password=options.get("sasl_plain_password"),
            mechanism=settings.kafka_sasl_mechanism,
            ssl_context=options.get("ssl_context"),
        )
    if settings.kafka_security_protocol == "SSL":
        return faust.SSLCredentials(options["ssl_context"])
    return None


def make_app(settings: Settings, processor: str, *, partitions: int, **overrides: Any) -> faust.App:
    """A faust app for one processor: group ``<prefix>.<processor>``, at-least-once, no web server.

    At-least-once plus idempotent processing rather than transactions: faust left the last
    transaction of a burst open here, hiding records from read_committed readers. Effects are
    flushed before offsets are committed either way. Topics come from topics/topics.toml,
    never from faust; a processor killed with -9 holds its partitions until its session times
    out, so the session is short (the broker's minimum is 6 s).
    """
    options: dict[str, Any] = {
        "broker": [f"kafka://{server}" for server in settings.bootstrap_servers.split(",")],
        "broker_credentials": faust_credentials(settings),
        "store": "memory://",
        # faust keeps a data dir even with memory tables: under ours, not the working directory.
        "datadir": str(settings.data_dir / "faust"),
        "processing_guarantee": "at_least_once",
        "topic_partitions": partitions,
        "topic_allow_declare": False,
        "web_enabled": False,
        "consumer_auto_offset_reset": "earliest",
        "producer_acks": -1,
        "stream_wait_empty": False,
        "broker_session_timeout": 6.0,
        "broker_heartbeat_interval": 1.5,
    }
    options.update(overrides)
    return faust.App(f"{settings.topic_prefix}.{processor}", **options)


def run_app(app: faust.App, settings: Settings) -> None:
    """Run the app's worker in the foreground until SIGTERM/SIGINT."""
    worker = faust.Worker(app, loglevel=settings.log_level.lower().replace("warning", "warn"), quiet=True)
    worker.execute_from_commandline()

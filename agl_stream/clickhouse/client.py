"""The one ClickHouse client factory: embedded chDB by default, a server when AGL_CLICKHOUSE_URL is set.

chDB allows one open database per process and one process per data dir, so in local mode a
single process (the sink / gateway) owns it; everyone else goes through that process.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

import clickhouse_connect
from clickhouse_connect.driver.client import Client

from agl_stream.config import Settings
from agl_stream.errors import ConfigError

EMBEDDED_OPTIONS = {
    # The engine's memory worker corrects its memory accounting from the process's resident
    # size; at its default period (100 ms) it was most of an idle embedded engine's CPU.
    "memory_worker_period_ms": "1000",
}
"""Server settings of the embedded engine (chDB takes them as connection options)."""


def get_client(settings: Settings, *, readonly: bool = False, **client_settings: Any) -> Client:
    """A clickhouse-connect client for the configured engine.

    ``readonly`` is enforced by ClickHouse (chDB read-only mode, or the ``readonly`` setting
    on a server), never by inspecting SQL.
    """
    if settings.uses_embedded_clickhouse:
        settings.chdb_dir.mkdir(parents=True, exist_ok=True)
        options = {**EMBEDDED_OPTIONS, **({"mode": "ro"} if readonly else {})}
        return clickhouse_connect.get_client(
            dsn=f"chdb://{settings.chdb_dir.resolve()}", chdb_options=options, settings=client_settings or None
        )
    url = urlparse(settings.clickhouse_url or "")
    if not url.hostname:
        raise ConfigError(f"AGL_CLICKHOUSE_URL={settings.clickhouse_url!r} has no host")
    secure = url.scheme == "https"
    username = url.username or settings.clickhouse_user
    password = url.password or (settings.clickhouse_password.get_secret_value() if settings.clickhouse_password else "")
    if readonly:
        # readonly=2 still lets the client set per-query limits such as max_execution_time; the
        # reader role's profile (agl_stream/clickhouse/access.py) keeps them from going higher.
        client_settings = {"readonly": 2, **client_settings}
        if settings.clickhouse_reader_user:
            username = settings.clickhouse_reader_user
            secret = settings.clickhouse_reader_password
            password = secret.get_secret_value() if secret else ""
    return clickhouse_connect.get_client(
        host=url.hostname,
        port=url.port or (8443 if secure else 8123),
        username=username,
        password=password,
        secure=secure,
        verify=settings.clickhouse_verify_tls,
        ca_cert=str(settings.clickhouse_ca_cert) if settings.clickhouse_ca_cert else None,
        settings=client_settings or None,
    )

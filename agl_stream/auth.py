"""The API token of the HTTP listeners (gateway, LLM proxy, inference server).

`agl-stream up` writes a random token to ``<run dir>/api-token`` (created 0600, never in the
environment, a log or a table); ``AGL_API_TOKEN`` overrides it. A listener bound beyond
loopback requires it (and refuses to start without one); on loopback it is required only with
``AGL_REQUIRE_TOKEN=1``. Every client the project runs sends the token it knows, whether the
listener asks or not.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from agl_stream.config import Settings
from agl_stream.errors import ConfigError

TOKEN_FILE = "api-token"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
"""Names of the loopback interface: a listener bound to one of them is reachable from this machine only."""


def ensure_token(settings: Settings) -> str:
    """The token clients and listeners of this data dir use; written (0600) when there is none."""
    known = known_token(settings)
    if known is not None:
        return known
    path = settings.run_dir / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another `up` wrote it meanwhile
        return path.read_text().strip()
    with os.fdopen(fd, "w") as out:
        out.write(token)
    return token


def write_private(path: Path, data: str | bytes) -> None:
    """Write ``data`` to a file only its owner can read or write (0600, also when it was there
    before): tokens, passwords, pickled agents."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data.encode() if isinstance(data, str) else data)


def known_token(settings: Settings) -> str | None:
    """AGL_API_TOKEN, else the token file of the data dir, else None."""
    if settings.api_token is not None:
        return settings.api_token.get_secret_value()
    try:
        return (settings.run_dir / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def listener_token(settings: Settings | None, bind_host: str) -> str | None:
    """The token a listener bound to ``bind_host`` requires, or None when it requires none."""
    token = known_token(settings) if settings is not None else None
    if bind_host not in LOOPBACK:
        if token is None:
            raise ConfigError(
                f"a listener bound to {bind_host} (beyond loopback) needs an API token: set AGL_API_TOKEN, "
                "or start the stack with `agl-stream up`, which writes one to the data dir"
            )
        return token
    return token if settings is not None and settings.require_token else None


def auth_headers(settings: Settings) -> dict[str, str]:
    """What a client of the listeners sends: the token it knows, if any."""
    token = known_token(settings)
    return {"authorization": f"Bearer {token}"} if token else {}

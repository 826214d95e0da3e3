"""Start and stop agl-stream roles as child processes (the local stack, the demo, tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from agl_stream.config import SECRETS_DIR_ENV, Settings

KEYLESS_ROLES = frozenset({"supervise", "processor", "gateway", "ingress", "triplets", "batcher", "sink", "otlp-kafka"})
"""Roles that call no outside service, so they get none of the caller's credentials: a role that
is tricked into reading its environment has nothing to give away."""

_CREDENTIAL = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH", re.IGNORECASE)


def write_secrets(settings: Settings) -> Path | None:
    """Write the secret settings as 0600 files for child processes; None when there are none."""
    secrets = settings.secrets()
    directory = settings.secrets_dir
    if not secrets:
        return None
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for stale in directory.iterdir():
        if stale.name not in secrets:
            stale.unlink()
    for name, value in secrets.items():
        path = directory / name
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(descriptor, 0o600)  # also when the file was there before
        with os.fdopen(descriptor, "w") as file:
            file.write(value)
    return directory


def role_environment(settings: Settings, role: str | None = None) -> dict[str, str]:
    """The environment of a child agl-stream process: these settings, secrets only as files.

    ``role``: the command it runs; a role in ``KEYLESS_ROLES`` also loses the caller's
    credential-looking variables (``OPENAI_API_KEY``, ``HF_TOKEN``...).
    """
    keyless = role in KEYLESS_ROLES
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGL_") and not (keyless and _CREDENTIAL.search(k))}
    env.update(settings.as_env())
    secrets_dir = write_secrets(settings)
    if secrets_dir is not None:
        env[SECRETS_DIR_ENV] = str(secrets_dir)
    return env


def start_role(settings: Settings, *args: str, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``agl-stream <args>`` with these settings; its output goes to ``log_path``."""
    env = role_environment(settings, args[0] if args else None)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "agl_stream", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop_role(process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    """SIGTERM, wait, SIGKILL after ``timeout``; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


def role_alive(pid: int) -> bool:
    """Whether ``pid`` is a running agl-stream role (never a recycled pid of something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"agl_stream" in cmdline  # a zombie's cmdline is empty

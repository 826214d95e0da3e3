"""The seed (Agent Lightning 0.3.0 from PyPI) and Agent Lightning 1.0.2 in virtualenvs of their own.

Tests and benchmarks run the seed's code in a separate interpreter: its pins (OpenTelemetry
1.39.1, its own pydantic models) must never meet ours in one process. The virtualenv lives in
the user cache and is created on first use; a stamp holding the requirement list makes the
call idempotent and re-installs when the list changes. Concurrent first uses (two test
processes) serialise on a lock file beside the venv.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

__all__ = [
    "AGL_V1_REQUIREMENTS",
    "AGL_V1_VENV",
    "SEED_CHILD_ENV",
    "SEED_REQUIREMENTS",
    "SEED_VENV",
    "ensure_agl_v1_venv",
    "ensure_seed_venv",
    "ensure_venv",
    "seed_site_packages",
]

SEED_VENV = Path(os.environ.get("AGL_SEED_VENV", Path.home() / ".cache" / "agl-stream" / "seed-venv"))
SEED_REQUIREMENTS = [
    "agentlightning==0.3.0",
    # its OpenTelemetry packages need the 1.39.1 line (0.60b1 for the contrib ones)
    "opentelemetry-api==1.39.1",
    "opentelemetry-sdk==1.39.1",
    "opentelemetry-exporter-otlp==1.39.1",
    "opentelemetry-exporter-otlp-proto-http==1.39.1",
    "opentelemetry-exporter-otlp-proto-grpc==1.39.1",
    "opentelemetry-exporter-otlp-proto-common==1.39.1",
    "opentelemetry-proto==1.39.1",
    "opentelemetry-semantic-conventions==0.60b1",
    "opentelemetry-instrumentation==0.60b1",
    "openai<3",
]
# LiteLLM (a seed dependency) fetches its cost map from the internet at import unless told not to.
SEED_CHILD_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONUNBUFFERED": "1"}


AGL_V1_VENV = Path(os.environ.get("AGL_V1_VENV", Path.home() / ".cache" / "agl-stream" / "agl-v1-venv"))
AGL_V1_REQUIREMENTS = [
    "agentlightning==1.0.2",
    "numpy",  # its rollout manager imports numpy and does not declare it
    "openai<3",  # what its agents use
]
AGL_V1_PYTHON = "3.12"  # agentlightning 1.0 requires Python >= 3.12


def ensure_seed_venv(venv: Path = SEED_VENV, *, quiet: bool = True) -> Path:
    """The seed venv's python; creates the venv and installs the seed on first use."""
    return ensure_venv(venv, SEED_REQUIREMENTS, quiet=quiet)


def ensure_agl_v1_venv(venv: Path = AGL_V1_VENV, *, quiet: bool = True) -> Path:
    """Agent Lightning 1.0.2's venv (Python 3.12) and its python; created on first use."""
    return ensure_venv(venv, AGL_V1_REQUIREMENTS, python=AGL_V1_PYTHON, quiet=quiet)


def _interpreter(version: str) -> str:
    """A Python ``version`` interpreter: pyenv's (its shims resolve only the selected versions),
    else one on the PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = sorted(pyenv.glob(f"{version}.*/bin/python{version}"))
    if candidates:
        return str(candidates[-1])
    found = shutil.which(f"python{version}")
    if found is None or "/shims/" in found:
        raise RuntimeError(f"Python {version} is needed (install it with pyenv: pyenv install {version})")
    return found


def ensure_venv(venv: Path, requirements: list[str], *, python: str | None = None, quiet: bool = True) -> Path:
    """The python of a venv holding ``requirements`` (made with Python ``python``, default this
    interpreter's); created and installed on first use, re-installed when the list changes."""
    interpreter = venv / "bin" / "python"
    stamp = venv / ".agl-stream-seed-stamp"
    wanted = "\n".join(requirements) + "\n"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if interpreter.exists() and stamp.exists() and stamp.read_text() == wanted:
            return interpreter
        quiet_flag = ["-q"] if quiet else []
        if not interpreter.exists():
            base = getattr(sys, "_base_executable", sys.executable) if python is None else _interpreter(python)
            subprocess.run([base, "-m", "venv", str(venv)], check=True)
        # uv (installed beside this interpreter by `make venv`) takes seconds with its cache;
        # pip took ~3.5 min here.
        uv = Path(sys.executable).parent / "uv"
        if uv.exists():
            command = [str(uv), "pip", "install", *quiet_flag, "--python", str(interpreter), *requirements]
        else:
            subprocess.run([str(interpreter), "-m", "pip", "install", *quiet_flag, "--upgrade", "pip"], check=True)
            command = [str(interpreter), "-m", "pip", "install", *quiet_flag, *requirements]
        subprocess.run(command, check=True)
        stamp.write_text(wanted)
    return interpreter


def seed_site_packages(python: Path) -> Path:
    """Where the seed's sources are, to read its behaviour (never imported into this process)."""
    out = subprocess.run(
        [str(python), "-c", "import agentlightning, pathlib; print(pathlib.Path(agentlightning.__file__).parent)"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **SEED_CHILD_ENV},
    )
    return Path(out.stdout.strip())

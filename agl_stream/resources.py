"""Locate the files that ship beside the code: schemas, topic declarations, infra.

In a source checkout they sit at the repository root; in an installed wheel they are
bundled under ``agl_stream/_bundled`` (see pyproject's force-include).
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def resource_path(relative: str) -> Path:
    """Return the path of a shipped file or folder such as ``schemas`` or ``infra/kafka/pom.xml``."""
    for root in (_PACKAGE_DIR / "_bundled", _PACKAGE_DIR.parent):
        candidate = root / relative
        if candidate.exists():
            return candidate
    raise FileNotFoundError(
        f"agl-stream resource {relative!r} not found next to {_PACKAGE_DIR}; "
        "reinstall the package (pip install agl-stream) or run from a source checkout"
    )

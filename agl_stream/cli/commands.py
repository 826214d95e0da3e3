"""Wires every sub-command module into the root app."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    pass

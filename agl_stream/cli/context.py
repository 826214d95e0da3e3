"""What every sub-command reads from the root command: the settings it built."""

from __future__ import annotations

import typer

from agl_stream.config import Settings


def settings_of(ctx: typer.Context) -> Settings:
    """The settings the root command built from flags and environment."""
    obj = ctx.find_root().obj
    assert isinstance(obj, Settings)
    return obj

"""What every sub-command runs in: the settings the root command's flags ask for, and the
command classes of the ``agl-stream`` tree.

The root command only records its flags (a :class:`SettingsRequest`). The settings are built,
and logging configured, once the command line has been parsed and a command is about to run
(:class:`AglCommand`), so ``--help`` at any level never loads pydantic or the logging stack,
and a bad setting still fails before the command does anything.

Nothing here imports a heavy library at module level: ``agl-stream --help`` imports every
command module (tests/unit/test_cli_startup.py keeps it that way).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

if TYPE_CHECKING:
    from agl_stream.config import Settings

# typer vendors its own click; its context class is not public: contexts are typed Any here.


@dataclass(frozen=True)
class SettingsRequest:
    """The settings the root command's flags ask for, built when a command runs."""

    overrides: Mapping[str, Any] = field(default_factory=dict)
    """Setting name -> value given on the command line (flags and ``--set``); the environment fills the rest."""
    role: str | None = None
    """The role command invoked, if one: it logs a line as it starts, before its heavy imports
    (torch, vLLM, chDB: tens of seconds on a busy machine), so a slow start never looks like a hang."""

    def build(self) -> Settings:
        from agl_stream.config import load_settings
        from agl_stream.logs import configure_logging, get_logger

        try:
            settings = load_settings(**self.overrides)
        except Exception as exc:  # pydantic's ValidationError lists every bad field
            raise typer.BadParameter(str(exc)) from exc
        configure_logging(settings.log_level, settings.log_format)
        if self.role is not None:
            get_logger("agl.cli").info("starting; loading its libraries", role=self.role, pid=os.getpid())
            if settings.gc_threshold:
                # A role holds many long-lived objects (the processor every queued rollout): at
                # Python's default each young collection's promotions keep the older ones busy.
                gc.set_threshold(settings.gc_threshold, *gc.get_threshold()[1:])
        return settings


def _resolve(ctx: Any) -> object:
    """The root context's object, with a pending :class:`SettingsRequest` built into settings."""
    root = ctx.find_root()
    if isinstance(root.obj, SettingsRequest):
        root.obj = root.obj.build()
    return root.obj


def settings_of(ctx: typer.Context) -> Settings:
    """The settings the root command built from flags and environment."""
    from agl_stream.config import Settings

    obj = _resolve(ctx)
    assert isinstance(obj, Settings)
    return obj


def _without_flag_metavars(params: list[Any]) -> list[Any]:
    """A flag takes no value: its help row shows no type (typer would show ``<bool>``)."""
    for param in params:
        if isinstance(param, TyperOption) and param.is_flag and param.metavar is None:
            param.metavar = ""
    return params


class AglCommand(TyperCommand):
    """Every ``agl-stream`` command: builds the settings before it runs; flags without a metavar in its help."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_metavars(super().get_params(ctx))

    def invoke(self, ctx: Any) -> Any:
        _resolve(ctx)  # a bad setting fails here, before the command starts anything
        return super().invoke(ctx)


class AglGroup(TyperGroup):
    """Every ``agl-stream`` group (the root, ``kafka``, ``topics``...): flags without a metavar in its help."""

    def get_params(self, ctx: Any) -> list[Any]:
        return _without_flag_metavars(super().get_params(ctx))

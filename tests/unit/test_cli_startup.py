"""`agl-stream --help` answers without loading the libraries the commands run on; its help is
grouped in panels and shows no type for flags; settings are built only when a command runs."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

import pytest
import typer
from typer.core import TyperCommand
from typer.testing import CliRunner

from agl_stream.cli import _root
from agl_stream.cli.commands import PANELS, register
from agl_stream.cli.context import AglGroup, SettingsRequest, settings_of
from agl_stream.config import Settings

# What the commands run on, and the package's own model and settings layers: none of them is
# needed to print help (typer itself loads pydantic to build its parameters; that stays allowed).
HEAVY = (
    "openai",
    "litellm",
    "torch",
    "transformers",
    "vllm",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "clickhouse_connect",
    "chdb",
    "aiokafka",
    "fastavro",
    "prometheus_client",
    "structlog",
    "opentelemetry",
    "pydantic_settings",
    "agl_stream.models",
    "agl_stream.config",
    "agl_stream.kafka",
    "agl_stream.clickhouse",
    "agl_stream.store",
    "agl_stream.domain",
    "agl_stream.local",
    "processors",
    "producers",
    "consumers",
)

# Runs the installed entry point's function with the given arguments, then reports which of
# HEAVY were imported: what `agl-stream ARGS` loads, measured in a fresh interpreter.
PROBE = """
import contextlib, io, json, sys
heavy = json.loads(sys.argv[1])
sys.argv = ["agl-stream", *sys.argv[2:]]
from agl_stream.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main()
    except SystemExit as exit:
        code = exit.code
loaded = sorted(name for name in sys.modules if any(name == h or name.startswith(h + ".") for h in heavy))
print(json.dumps({"code": code, "help": out.getvalue(), "loaded": loaded}))
"""


def _run(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(HEAVY), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["sql", "--help"],
        ["trainer", "--help"],
        ["kafka", "start", "--help"],
        ["--set", "kafka_port=not-a-port", "up", "--help"],
    ],
    ids=" ".join,
)
def test_help_loads_none_of_the_heavy_libraries(args: list[str]) -> None:
    result = _run(*args)
    assert result["code"] == 0
    assert "Usage:" in result["help"]
    assert _packages(result["loaded"]) == [], f"`agl-stream {' '.join(args)}` loads them"


def _packages(modules: list[str]) -> list[str]:
    """The names of HEAVY that these modules belong to."""
    return sorted({h for h in HEAVY for m in modules if m == h or m.startswith(h + ".")})


# Imports each module of the CLI in turn and names the heavy modules each one brought in first.
EACH_MODULE = """
import json, pkgutil, sys
import agl_stream.cli
heavy = json.loads(sys.argv[1])
found = {}
for info in sorted(pkgutil.iter_modules(agl_stream.cli.__path__), key=lambda i: i.name):
    before = set(sys.modules)
    __import__(f"agl_stream.cli.{info.name}")
    new = [m for m in set(sys.modules) - before if any(m == h or m.startswith(h + ".") for h in heavy)]
    found[info.name] = sorted(new)
print(json.dumps(found))
"""


def test_no_command_module_imports_a_heavy_library_at_module_level() -> None:
    done = subprocess.run(
        [sys.executable, "-c", EACH_MODULE, json.dumps(HEAVY)], capture_output=True, text=True, timeout=300, check=True
    )
    found: dict[str, list[str]] = json.loads(done.stdout)
    assert {"commands", "context", "output", "sql_cmd", "stack_cmd"} <= set(found)
    heavy = {f"agl_stream/cli/{module}.py": _packages(new) for module, new in found.items() if new}
    assert heavy == {}, "import these inside the command functions that use them (--help imports every module)"


def test_importing_the_package_loads_none_of_its_api_until_asked() -> None:
    probe = (
        "import json, sys\n"
        "import agl_stream\n"
        "before = sorted(m for m in sys.modules if m.startswith(('agl_stream.', 'pydantic')))\n"
        "from agl_stream import Rollout, TraceStatus\n"
        "print(json.dumps([before, Rollout.__name__, TraceStatus.__name__, 'LitAgent' in dir(agl_stream)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(done.stdout) == [[], "Rollout", "SpanStatus", True]


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    """The ``agl-stream`` tree, built afresh (the installed app registers its commands when it runs)."""
    app = typer.Typer(cls=AglGroup)
    app.callback()(_root)
    register(app)
    return app


def _paths(command: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and group below ``command``, as the words that name it."""
    found: list[tuple[str, ...]] = [prefix]
    for name, sub in getattr(command, "commands", {}).items():
        found += _paths(sub, (*prefix, name))
    return found


def test_every_command_sits_in_a_panel(app: typer.Typer) -> None:
    group: Any = typer.main.get_command(app)
    assert group.commands
    outside = {name: cmd.rich_help_panel for name, cmd in group.commands.items() if cmd.rich_help_panel not in PANELS}
    assert outside == {}, f"give each command one of {PANELS} as its rich_help_panel in agl_stream/cli/commands.py"
    shown = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"}).output
    assert [panel for panel in PANELS if f"─ {panel} ─" in shown] == list(PANELS)


def test_help_shows_a_type_for_valued_options_only(app: typer.Typer) -> None:
    runner = CliRunner()
    paths = _paths(typer.main.get_command(app))
    assert len(paths) > 30
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, f"agl-stream {' '.join(path)} --help shows <bool> for a flag"
    status = runner.invoke(app, ["status", "--help"], env={"COLUMNS": "200"}).output
    assert "<float range>" in status  # --interval takes a value


def test_settings_are_built_when_a_command_runs_not_for_help(app: typer.Typer) -> None:
    runner = CliRunner()
    bad = ["--set", "kafka_port=not-a-port"]
    assert runner.invoke(app, [*bad, "topics", "table", "--help"]).exit_code == 0
    refused = runner.invoke(app, [*bad, "topics", "table"])
    assert refused.exit_code == 2
    assert "kafka_port" in refused.output
    shown = runner.invoke(app, ["--topic-prefix", "exp7", "topics", "table"])
    assert shown.exit_code == 0, shown.output
    assert "`exp7.rollouts`" in shown.output


def test_a_request_becomes_the_settings_once() -> None:
    ctx = typer.Context(TyperCommand(name="probe"))
    ctx.obj = SettingsRequest(overrides={"topic_prefix": "exp8"})
    first = settings_of(ctx)
    assert isinstance(first, Settings)
    assert first.topic_prefix == "exp8"
    assert settings_of(ctx) is first


def test_a_role_process_collects_garbage_less_often_and_other_commands_keep_pythons_threshold() -> None:
    before = gc.get_threshold()
    try:
        SettingsRequest(overrides={"gc_threshold": 12_345}).build()
        assert gc.get_threshold() == before  # not a role: a short command keeps Python's
        SettingsRequest(overrides={"gc_threshold": 12_345}, role="processor").build()
        assert gc.get_threshold() == (12_345, *before[1:])
        gc.set_threshold(*before)
        SettingsRequest(overrides={"gc_threshold": 0}, role="processor").build()
        assert gc.get_threshold() == before  # 0 keeps Python's
    finally:
        gc.set_threshold(*before)

"""``agl-stream schemas``: snapshot released schema versions and check that changes are compatible."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agl_stream.resources import resource_path
from agl_stream.wire.contract import HISTORY_DIRNAME, Contract

schemas_app = typer.Typer(no_args_is_help=True)

SchemasDir = Annotated[
    Path | None,
    typer.Option(help="Folder of the current .avsc files (default: the bundled schemas/)."),
]
HistoryDir = Annotated[
    Path | None,
    typer.Option(help="Folder of the snapshots (default: <schemas-dir>/history)."),
]


def _load(schemas_dir: Path | None, history_dir: Path | None) -> tuple[Contract, Path]:
    schemas = schemas_dir if schemas_dir is not None else resource_path("schemas")
    history = history_dir if history_dir is not None else schemas / HISTORY_DIRNAME
    return Contract.load(schemas, history), history


@schemas_app.command("snapshot")
def snapshot(schemas_dir: SchemasDir = None, history_dir: HistoryDir = None) -> None:
    """Write every current schema that has no snapshot yet to the history folder.

    Refuses when a current schema is incompatible with its history: a snapshot is a promise
    that readers of every other version can read it.
    """
    contract, history = _load(schemas_dir, history_dir)
    problems = contract.compatibility_problems()
    if problems:
        for problem in problems:
            typer.secho(f"incompatible: {problem}", fg=typer.colors.RED, err=True)
        typer.secho("nothing written: fix the schemas first", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    written = contract.write_snapshots(history)
    for path in written:
        typer.echo(f"wrote {path}")
    if not written:
        typer.echo(f"every schema is already in {history}")


@schemas_app.command("check")
def check(schemas_dir: SchemasDir = None, history_dir: HistoryDir = None) -> None:
    """Check every current schema against all its snapshots, both ways; exit 1 with the reason."""
    contract, history = _load(schemas_dir, history_dir)
    problems = [f"incompatible: {p}" for p in contract.compatibility_problems()]
    problems += [
        f"not snapshotted: {s.name} ({s.fingerprint_hex}); run `agl-stream schemas snapshot`"
        for s in contract.missing_snapshots()
    ]
    for problem in problems:
        typer.secho(problem, fg=typer.colors.RED, err=True)
    if problems:
        raise typer.Exit(1)
    typer.echo(f"{len(contract.current)} schemas compatible with {len(contract.history)} snapshots in {history}")


@schemas_app.command("show")
def show(
    name: Annotated[str, typer.Argument(help="Record or enum name, e.g. TaskRequest.")],
    schemas_dir: SchemasDir = None,
) -> None:
    """Print a schema fully expanded (self-contained, for other languages) and its fingerprint.

    The schema goes to stdout, the fingerprint and single-object header to stderr.
    """
    contract, _ = _load(schemas_dir, None)
    try:
        schema = contract.schema(name)
    except KeyError as exc:
        typer.secho(f"no schema named {name!r}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from exc
    typer.echo(schema.to_json(), nl=False)
    typer.echo(
        f"{schema.name}: fingerprint {schema.fingerprint_hex}, single-object header {schema.header.hex(' ')}",
        err=True,
    )

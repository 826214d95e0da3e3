"""``agl-stream schemas``: snapshot released schema versions and check that changes are compatible."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from agl_stream.wire.contract import Contract

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
    from agl_stream.resources import resource_path
    from agl_stream.wire.contract import HISTORY_DIRNAME, Contract

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


@schemas_app.command("export")
def export(
    out_dir: Annotated[Path, typer.Option("--dir", help="Folder to write the .avsc files to (made if missing).")],
    schemas_dir: SchemasDir = None,
    history_dir: HistoryDir = None,
) -> None:
    """Write every schema as a self-contained .avsc file, for tools other than agl-stream.

    <dir>/<Name>.avsc is each current schema; <dir>/by-header/<header>.avsc is every known
    version (current and snapshots) named by its single-object header in hex (c301 and the
    fingerprint, the first 10 bytes of every record written with it), so the writer schema of a
    record is the file named by `od -An -tx1 -N10 record.bin | tr -d ' \\n'`; <dir>/schemas.json
    lists them. A record's Avro body is what follows those 10 bytes (docs/dlq.md).
    """
    import json

    contract, _ = _load(schemas_dir, history_dir)
    (out_dir / "by-header").mkdir(parents=True, exist_ok=True)
    index = []
    for schema in contract.current.values():
        (out_dir / f"{schema.short_name}.avsc").write_text(schema.to_json())
    for fingerprint, schema in sorted(contract.known.items(), key=lambda kv: (kv[1].name, kv[0])):
        header = schema.header.hex()
        (out_dir / "by-header" / f"{header}.avsc").write_text(schema.to_json())
        current = contract.current.get(schema.name)
        index.append(
            {
                "name": schema.name,
                "fingerprint": schema.fingerprint_hex,
                "header": header,
                "file": f"by-header/{header}.avsc",
                "current": current is not None and current.fingerprint == fingerprint,
            }
        )
    (out_dir / "schemas.json").write_text(json.dumps(index, indent=2) + "\n")
    typer.echo(f"wrote {len(contract.current)} current schemas and {len(index)} versions by header to {out_dir}")

"""``agl-stream up / status / down``: the local stack."""

from __future__ import annotations

import asyncio
import signal
import threading
from typing import TYPE_CHECKING, Annotated

import typer

from agl_stream.cli import output
from agl_stream.cli.context import settings_of

if TYPE_CHECKING:
    from rich.console import Console

    from agl_stream.config import Settings


def _show(settings: Settings, console: Console) -> bool:
    from agl_stream.local import stack

    parts = stack.status(settings)
    if not parts:
        console.print("no local stack recorded here; start one with `agl-stream up`")
        return False
    info = stack.read_stack(settings)
    started = f"started {output.format_time(info.started_at)}" if info is not None and info.started_at else None
    table = output.new_table("part", "state", title=started)
    for part, state in parts.items():
        table.add_row(part, state)
    output.show(table, console)
    return all("not" not in state for state in parts.values())


def up(
    ctx: typer.Context,
    detach: Annotated[bool, typer.Option("--detach", "-d", help="Return once everything is ready.")] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds the parts may take to start while they run (default AGL_START_TIMEOUT_S, 600); "
            "a part that exits fails at once."
        ),
    ] = None,
    training: Annotated[
        bool, typer.Option(help="Also the triplet builder and the batcher (the RL training data path).")
    ] = True,
) -> None:
    """Start the local stack: broker (unless AGL_KAFKA_BOOTSTRAP), topics, processor, gateway,
    and (unless --no-training) the triplet builder and the batcher.

    Without --detach it stays in the foreground and stops everything on Ctrl-C. With --detach
    the stack runs in a session of its own: closing the terminal stops nothing (`down` does).
    """
    from agl_stream.local import stack

    settings = settings_of(ctx)
    console = output.console()
    with console.status("starting the local stack ...") as spinner:
        info = stack.up(settings, timeout=timeout, training=training, progress=spinner.update)
    _show(settings, console)
    url = stack.dashboard_url(settings)
    if url:
        console.print(f"dashboard: [bold]{url}[/]")
    console.print(
        f"connect with [bold]agl_stream.connect(data_dir={str(settings.data_dir)!r})[/] or the same AGL_DATA_DIR"
    )
    if detach:
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console.print("running; Ctrl-C stops everything")
    stop.wait()
    stopped = stack.down(settings)
    console.print(f"stopped: {', '.join(stopped) or 'nothing'} (pids were {info.pids})")


def status(
    ctx: typer.Context,
    interval: Annotated[
        float, typer.Option(min=0.1, max=60.0, help="Seconds between the two scrapes that make a rate.")
    ] = 1.0,
    lag: Annotated[bool, typer.Option(help="Read each consumer group's lag from Kafka.")] = True,
) -> None:
    """Show each part of the local stack, then each role instance's records/s (from its metrics
    endpoint) and each consumer group's lag (from Kafka); exit code 1 if a part is down."""
    from agl_stream.local.stack import local_stack_settings

    settings = settings_of(ctx)
    console = output.console()
    healthy = _show(settings, console)
    _show_metrics(local_stack_settings(settings), interval, lag and _knows_kafka(settings), console)
    if not healthy:
        raise typer.Exit(1)


def _knows_kafka(settings: Settings) -> bool:
    """Whether there is a cluster to ask (without one, status must not wait for a timeout)."""
    from agl_stream.local import stack

    return settings.kafka_bootstrap is not None or stack.read_stack(settings) is not None


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _show_metrics(settings: Settings, interval: float, lag: bool, console: Console) -> None:
    from agl_stream.local import monitor

    seen = asyncio.run(monitor.observe(settings, interval_s=interval, lag=lag))
    lag_of = {g.group: g.lag for g in seen.lags}
    if seen.roles:
        table = output.new_table(
            "role", "pid", "state", "records in/s", "records out/s", "consumer lag", "metrics", title="roles"
        )
        for view in seen.roles:
            lags = [lag_of[g] for g in sorted(view.groups) if g in lag_of]
            table.add_row(
                view.role,
                str(view.pid),
                view.state if view.state == "up" else f"[red]{view.state}[/]",
                _rate(view.in_per_s),
                _rate(view.out_per_s),
                f"{sum(lags):,}" if lags else "-",
                view.url,
            )
        output.show(table, console)
    elif settings.metrics:
        console.print("no role serves metrics here (endpoints are listed in <data dir>/run/metrics/)")
    if seen.kafka_error is not None:
        console.print(f"[red]consumer lag unavailable[/]: Kafka did not answer ({seen.kafka_error})")
    if seen.lags:
        members = {g: sorted({v.role for v in seen.roles if g in v.groups}) for g in lag_of}
        table = output.new_table(
            "consumer group", "role", "topics", "partitions", "lag", title="consumer lag (committed offsets)"
        )
        for group in seen.lags:
            table.add_row(
                group.group,
                ", ".join(members[group.group]) or "-",
                ", ".join(group.topics) or "(nothing committed)",
                str(group.partitions),
                f"{group.lag:,}",
            )
        output.show(table, console)


def supervise(
    ctx: typer.Context,
    roles: Annotated[list[str], typer.Argument(help="Roles to run, e.g. processor gateway ingress.")],
) -> None:
    """Run roles and start each again when it exits, with backoff (what `up` runs; until SIGTERM).

    What runs is written to <data dir>/run/supervisor.json; `agl-stream status` shows it.
    """
    from agl_stream.local import stack, supervisor

    known = (*stack.ROLES, *stack.TRAINING_ROLES)
    unknown = [role for role in roles if role not in known]
    if unknown:
        raise typer.BadParameter(f"unknown role(s) {', '.join(unknown)}; supervise runs {', '.join(known)}")
    supervisor.main(settings_of(ctx), roles)


def down(ctx: typer.Context) -> None:
    """Stop what `agl-stream up` started."""
    from agl_stream.local import stack

    stopped = stack.down(settings_of(ctx))
    output.console().print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")


def dashboard(
    ctx: typer.Context,
    open_: Annotated[bool, typer.Option("--open", help="Open it in the default web browser.")] = False,
) -> None:
    """Print the URL of the web dashboard of the running stack (served by its gateway)."""
    from agl_stream.local import stack

    console = output.console()
    url = stack.dashboard_url(settings_of(ctx))
    if url is None:
        console.print("no gateway answers for this data dir; start the stack with `agl-stream up`")
        raise typer.Exit(1)
    print(url)  # plain: `open "$(agl-stream dashboard)"` works
    if open_:
        import webbrowser

        if not webbrowser.open(url):
            console.print("no web browser could be started here; open the URL above yourself")

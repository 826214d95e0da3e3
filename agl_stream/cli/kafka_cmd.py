"""``agl-stream kafka ...``: the local Apache Kafka broker (jars, start, stop, status)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from agl_stream.cli import output
from agl_stream.cli.context import settings_of

if TYPE_CHECKING:
    from agl_stream.config import Settings
    from agl_stream.kafka.broker import BrokerStatus

kafka_app = typer.Typer(
    help=(
        "The local Kafka broker (KRaft) under <data-dir>/kafka: one node, or a cluster of several "
        "with --brokers (node i on port+2(i-1)). Needs Java 17+ and, once, Maven to fetch the "
        "jars. Not needed when --bootstrap / AGL_KAFKA_BOOTSTRAP points at an existing cluster."
    ),
    no_args_is_help=True,
)


def _with_overrides(settings: Settings, **overrides: Any) -> Settings:
    # Settings is frozen; flags given on this command win over the environment. model_copy
    # does not validate: the options carry their own ranges and start() checks the heap.
    update = {key: value for key, value in overrides.items() if value is not None}
    return settings.model_copy(update=update) if update else settings


@kafka_app.command("jars")
def jars(ctx: typer.Context) -> None:
    """Fetch the Kafka server jars from Maven Central into the cache (once; `start` does it too)."""
    from agl_stream.kafka.jars import ensure_jars

    settings = settings_of(ctx)
    libs = ensure_jars(settings)
    output.console().print(f"Kafka jars ready in [bold]{libs}[/bold]")


@kafka_app.command("start")
def start(
    ctx: typer.Context,
    port: Annotated[
        int | None,
        typer.Option(help="Client port (env AGL_KAFKA_PORT, default 9092).", min=1, max=65535),
    ] = None,
    controller_port: Annotated[
        int | None,
        typer.Option(
            help="KRaft controller port (env AGL_KAFKA_CONTROLLER_PORT, default 9093).",
            min=1,
            max=65535,
        ),
    ] = None,
    heap: Annotated[
        str | None,
        typer.Option(help="JVM heap, e.g. 512m or 2g (env AGL_KAFKA_HEAP, default 512m)."),
    ] = None,
    brokers: Annotated[
        int | None,
        typer.Option(
            help=(
                "Nodes of a local cluster, each a broker and a KRaft voter (env AGL_KAFKA_BROKERS, "
                "default 1); node i listens on --port+2(i-1). Remembered by the data dir."
            ),
            min=1,
            max=9,
        ),
    ] = None,
    jit: Annotated[
        Literal["tiered", "c1"] | None,  # config.KafkaJit (config is imported lazily here)
        typer.Option(
            help=(
                "JIT compilers of the broker's JVM (env AGL_KAFKA_JIT, default tiered): tiered (C1 then "
                "C2) is the cheaper broker once warm; c1 (C1 only) suits a broker that lives seconds."
            ),
        ),
    ] = None,
    wait: Annotated[float, typer.Option(help="Seconds to wait for the broker to answer before giving up.")] = 60.0,
) -> None:
    """Start the broker (or every node not running) in the background and wait until all answer."""
    from agl_stream.kafka import broker

    console = output.console()
    settings = _with_overrides(
        settings_of(ctx),
        kafka_port=port,
        kafka_controller_port=controller_port,
        kafka_heap=heap,
        kafka_brokers=brokers,
        kafka_jit=jit,
    )
    info = broker.start(settings, wait_timeout=wait)
    if info.external:
        console.print(
            f"Using the existing cluster [bold]{info.bootstrap}[/bold] "
            "(AGL_KAFKA_BOOTSTRAP is set); no local broker started."
        )
        return
    verb = f"started in {info.seconds:.1f} s" if info.started else "already running"
    if len(info.pids) > 1:
        pids = ", ".join(f"node {node} pid {pid}" for node, pid in sorted(info.pids.items()))
        console.print(f"Kafka cluster of {len(info.pids)} {verb}: bootstrap [bold]{info.bootstrap}[/bold]")
        console.print(f"  {pids}\n  data {info.data_dir}")
        return
    console.print(f"Kafka broker {verb}: bootstrap [bold]{info.bootstrap}[/bold], pid {info.pid}")
    console.print(f"  data {info.data_dir}\n  log  {info.log_file}")


@kafka_app.command("stop")
def stop(
    ctx: typer.Context,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for a clean shutdown before SIGKILL.")] = 30.0,
    node: Annotated[
        int | None,
        typer.Option(help="Stop only this node of a local cluster; `kafka start` brings it back.", min=1),
    ] = None,
    kill: Annotated[bool, typer.Option(help="With --node: SIGKILL it at once, as a crash would.")] = False,
) -> None:
    """Stop the broker of this data dir (clean shutdown, SIGKILL after --timeout)."""
    from agl_stream.kafka import broker

    console = output.console()
    settings = settings_of(ctx)
    if node is not None:
        pid = broker.stop_node(settings, node, kill=kill, timeout=timeout)
        how = "killed" if kill else "stopped"
        console.print(f"Kafka node {node} {how} (pid {pid})." if pid else f"Kafka node {node} was not running.")
        return
    if kill:
        raise typer.BadParameter("--kill needs --node (the whole cluster stops cleanly)", param_hint="--kill")
    if broker.stop(settings, timeout=timeout):
        console.print(f"Kafka broker stopped ({settings.kafka_dir}).")
    else:
        console.print(f"No Kafka broker was running for {settings.kafka_dir}.")


@kafka_app.command("status")
def status(ctx: typer.Context) -> None:
    """Show whether the broker (each node) of this data dir runs and answers; exit code 1 if one doesn't run."""
    from agl_stream.kafka import broker

    console = output.console()
    settings = settings_of(ctx)
    nodes = broker.nodes_status(settings)
    state = broker.status(settings)
    if settings.kafka_bootstrap is not None:
        console.print(
            f"Clients use the existing cluster {settings.kafka_bootstrap} (AGL_KAFKA_BOOTSTRAP); "
            "below is the local broker only."
        )
    if len(nodes) > 1:
        _cluster_status(settings, nodes)
        return
    if not state.running:
        console.print(f"Kafka broker: [red]not running[/red] ({state.data_dir})")
        raise typer.Exit(1)
    answer = "[green]answering[/green]" if state.answering else "[yellow]not answering yet[/yellow]"
    console.print(f"Kafka broker: [green]running[/green], {answer}")
    console.print(
        f"  bootstrap {state.bootstrap}\n  pid       {state.pid}\n"
        f"  data      {state.data_dir}\n  log       {state.log_file}"
    )


def _cluster_status(settings: Settings, nodes: list[BrokerStatus]) -> None:
    from agl_stream.kafka import broker

    controller = broker.active_controller(settings)
    table = output.new_table(
        "node",
        "state",
        "bootstrap",
        "pid",
        "log",
        title=f"Local Kafka cluster of {len(nodes)} (active controller: node {controller or '-'})",
    )
    for node in nodes:
        state = (
            "[green]answering[/green]"
            if node.answering
            else ("[yellow]not answering[/yellow]" if node.running else "[red]not running[/red]")
        )
        table.add_row(str(node.node_id), state, node.bootstrap, str(node.pid or "-"), str(node.log_file))
    output.show(table)
    if not all(node.running for node in nodes):
        raise typer.Exit(1)  # a degraded cluster fails the check too

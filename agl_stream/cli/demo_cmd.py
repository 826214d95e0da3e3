"""``agl-stream demo``: the main job, the RL loop on CPU (:mod:`agl_stream.demo.loop`).

``--smoke`` runs the backbone's smoke pipeline instead: start the broker (unless AGL_KAFKA_BOOTSTRAP is set), create
the topics, run the ClickHouse sink, produce synthetic spans, wait until the sink has applied
all of them (an offset fence, not a sleep), stop everything it started, then show counts and
SQL results from ClickHouse.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Annotated

import typer

from agl_stream.cli import output
from agl_stream.cli.context import settings_of

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from agl_stream.config import Settings

SMOKE_QUERIES = {
    "spans per name": (
        "SELECT SpanName, count() AS spans, round(quantile(0.5)(Duration) / 1e6, 1) AS p50_ms, "
        "round(quantile(0.95)(Duration) / 1e6, 1) AS p95_ms FROM {db}.otel_traces "
        "GROUP BY SpanName ORDER BY spans DESC"
    ),
    "top rollouts by output tokens": (
        "SELECT RolloutId, count() AS spans, "
        "sum(toUInt64OrZero(SpanAttributes['gen_ai.usage.output_tokens'])) AS output_tokens "
        "FROM {db}.otel_traces GROUP BY RolloutId ORDER BY output_tokens DESC, RolloutId LIMIT 5"
    ),
}


def _progress(console: Console) -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeRemainingColumn(),
        console=console,
    )


async def _smoke(settings: Settings, spans: int, console: Console) -> float:
    from agl_stream.kafka import admin
    from agl_stream.kafka.offsets import wait_for_group
    from agl_stream.local.processes import start_role, stop_role
    from consumers.sink_specs import SPANS, sinks_group_id
    from producers import synthetic_spans as synthetic

    plan = await admin.apply(settings)
    console.print(f"topics: {len(plan.create)} created, {len(plan.unchanged)} already there")
    sink = start_role(settings, "sink", log_path=settings.data_dir / "logs" / "sink.log")
    started = time.monotonic()
    try:
        with _progress(console) as progress:
            produced = progress.add_task("produce spans", total=spans, rate="")
            sunk = progress.add_task("sink into ClickHouse", total=spans, rate="")

            def on_produced(n: int) -> None:
                done = progress.tasks[produced].completed + n
                progress.update(produced, completed=done, rate=f"{done / (time.monotonic() - started):,.0f}/s")

            def on_sunk(done: int, total: int) -> None:
                progress.update(sunk, completed=done, rate=f"{done / (time.monotonic() - started):,.0f}/s")

            ends = await synthetic.produce_spans(settings, spans, on_progress=on_produced)
            # Fence on the sink's committed offsets: they pass ours only after the INSERT.
            await wait_for_group(settings, sinks_group_id(settings, SPANS.lane), ends, timeout=300, on_progress=on_sunk)
        return time.monotonic() - started
    finally:
        if stop_role(sink) != 0:
            console.print(f"[red]the sink exited with an error; see {settings.data_dir / 'logs' / 'sink.log'}[/]")


def _show_results(settings: Settings, console: Console) -> None:
    from agl_stream.clickhouse.client import get_client

    client = get_client(settings, readonly=True)
    db = settings.clickhouse_database
    try:
        total = client.command(f"SELECT count() FROM {db}.otel_traces")
        rollouts = client.command(f"SELECT uniqExact(RolloutId) FROM {db}.otel_traces")
        console.print(f"\n[bold]otel_traces:[/] {total} spans from {rollouts} rollouts\n")
        for title, sql in SMOKE_QUERIES.items():
            result = client.query(sql.format(db=db))
            table = output.new_table(*result.column_names, title=title)
            for row in result.result_rows:
                table.add_row(*(output.cell(v) for v in row))
            console.print(f"[dim]{sql.format(db=db)}[/]")
            output.show(table, console)
    finally:
        client.close()


def demo(
    ctx: typer.Context,
    versions: Annotated[int, typer.Option(min=1, help="Stop once the trainer published this many new policies.")] = 20,
    minutes: Annotated[float, typer.Option(min=0.5, help="Stop after this long in any case.")] = 8.0,
    smoke: Annotated[bool, typer.Option(help="Run the backbone smoke pipeline (synthetic spans) instead.")] = False,
    spans: Annotated[int, typer.Option(min=1, help="With --smoke: how many synthetic spans to push through.")] = 5_000,
    keep_broker: Annotated[bool, typer.Option(help="With --smoke: leave the local broker running.")] = False,
    keep: Annotated[
        bool, typer.Option(help="Leave the local stack running at the end and print its dashboard's URL.")
    ] = False,
) -> None:
    """The main job: train a tiny policy from random weights with the whole RL loop, on CPU.

    Starts every role as a process (broker, rollout processor, gateway with the embedded
    ClickHouse, triplet builder, batcher, trainer, CPU inference backend, LLM proxy, runner),
    runs rounds of the toy task (answer with digits; reward = the answer's digit fraction) while
    the trainer trains, shows the mean reward per policy version from SQL on ClickHouse, and
    stops everything it started.
    """
    settings = settings_of(ctx)
    if "kafka_jit" not in settings.model_fields_set:  # a broker that lives minutes: C1 only
        settings = settings.model_copy(update={"kafka_jit": "c1"})
    console = output.console()
    if smoke:
        _run_smoke(settings, spans, keep_broker, console)
        return
    from agl_stream.demo import loop
    from agl_stream.local import stack

    # A fresh topic prefix per run: the loop starts from random weights and empty topics.
    run = f"demo{int(time.time())}"
    settings = settings.model_copy(update={"topic_prefix": run, "gateway_port": 0, "data_dir": settings.data_dir / run})
    with loop.running_loop(settings, console, keep=keep) as running:
        result = asyncio.run(loop.drive(running, console, versions=versions, minutes=minutes))
        metrics = loop.trainer_metrics(running)
    loop.show(result, console, metrics)
    first, last = result.first_and_last()
    if len(result.versions) < 2 or last <= first:
        console.print("[yellow]the reward did not rise in this run; see the logs under[/] " + str(settings.data_dir))
    if keep:
        url = stack.dashboard_url(settings)
        console.print(f"the local stack keeps running; stop it with `agl-stream --data-dir {settings.data_dir} down`")
        console.print(f"dashboard: [bold]{url or 'the gateway did not answer'}[/]")


def _run_smoke(settings: Settings, spans: int, keep_broker: bool, console: Console) -> None:
    from agl_stream.kafka import broker

    started_broker = False
    if settings.uses_local_broker:
        info = broker.start(settings)
        started_broker = True
        console.print(f"broker: {info.bootstrap} (data in {settings.kafka_dir})")
    else:
        console.print(f"broker: using {settings.bootstrap_servers} (AGL_KAFKA_BOOTSTRAP)")
    try:
        elapsed = asyncio.run(_smoke(settings, spans, console))
        console.print(f"{spans:,} spans produced and sunk in {elapsed:.1f}s ({spans / elapsed:,.0f} spans/s)")
        _show_results(settings, console)
    finally:
        if started_broker and not keep_broker:
            broker.stop(settings)
            console.print("broker stopped")

"""``agl-stream batcher``: finished attempts (agl.triplets) -> training batches (agl.triplet-batches).

The role lives in ``processors.batcher``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
The rules are agl_stream/domain/batching.py.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from agl_stream import metrics
from agl_stream.cli.context import settings_of
from agl_stream.domain.batching import BatchPolicy


class OnStale(str, Enum):
    drop = "drop"
    keep = "keep"


class OnGroupTimeout(str, Enum):
    flush = "flush"
    drop = "drop"


def batcher(
    ctx: typer.Context,
    max_rollouts: Annotated[int, typer.Option(min=1, help="Most records (finished attempts) per batch.")] = 64,
    max_tokens: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(min=1, help="Most prompt + response tokens per batch (default: no limit)."),
    ] = None,
    group_size: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(min=1, help="Records per GRPO group (same group_id); groups are never split. Default: none."),
    ] = None,
    wait_for_groups: Annotated[
        bool,
        typer.Option(
            "--wait-for-groups/--no-wait-for-groups",
            help="Hold a group until it has --group-size records (else a linger flush ships it as it is).",
        ),
    ] = True,
    max_group_wait: Annotated[
        float, typer.Option(min=0.0, help="Seconds a group may stay incomplete before --on-group-timeout applies.")
    ] = 600.0,
    on_group_timeout: Annotated[
        OnGroupTimeout, typer.Option(help="An incomplete group that waited too long: flush it as it is, or drop it.")
    ] = OnGroupTimeout.flush,
    max_staleness: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(min=0, help="Policy versions a record may lag the newest one seen (default: no limit)."),
    ] = None,
    on_stale: Annotated[
        OnStale, typer.Option(help="A record over --max-staleness: drop it, or keep it (counted either way).")
    ] = OnStale.drop,
    linger: Annotated[
        float, typer.Option(min=0.0, help="Seconds a partial batch waits for more before it goes out anyway.")
    ] = 30.0,
    input_topic: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Full name of the topic of triplet records to read (default: <prefix>.triplets).",
        ),
    ] = None,
    output_topic: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            help="Full name of the batches topic, with the input's partition count (default: <prefix>.triplet-batches)."
        ),
    ] = None,
) -> None:
    """Batch finished attempts from agl.triplets into training batches on agl.triplet-batches.

    One batching state per partition of agl.triplets (keyed by group id, so a group is in one
    partition). Every record ends in exactly one batch or is counted as dropped in the next
    batch, across crashes and restarts. Runs until SIGTERM or Ctrl-C.

    Example: agl-stream batcher --max-rollouts 64 --group-size 8 --max-staleness 1

    A replay (agl-stream replay NAME) is batched with --input-topic <prefix>.triplets.replay.NAME
    --output-topic <prefix>.triplet-batches.replay.NAME (its own consumer group).
    """
    try:
        policy = BatchPolicy(
            max_rollouts=max_rollouts,
            max_tokens=max_tokens,
            group_size=group_size,
            wait_for_groups=wait_for_groups,
            max_group_wait_s=max_group_wait,
            on_group_timeout=on_group_timeout.value,
            max_staleness=max_staleness,
            on_stale=on_stale.value,
            linger_s=linger,
        )
    except ValueError as error:
        raise typer.BadParameter(str(error)) from error
    from processors import batcher

    settings = settings_of(ctx)
    with metrics.expose(settings, "batcher"):
        batcher.main(settings, policy, input_topic=input_topic, output_topic=output_topic)

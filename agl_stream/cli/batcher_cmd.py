"""``agl-stream batcher``: finished attempts (agl.triplets) -> training batches (agl.triplet-batches).

The role lives in ``processors.batcher``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
The rules are agl_stream/domain/batching.py.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from agl_stream.cli.context import settings_of

# BatchPolicy's max_staleness default (agl_stream/domain/batching.py loads the models: not at --help);
# tests/unit/test_batching.py keeps every default of the command equal to the policy's.
DEFAULT_MAX_STALENESS = 4


class OnStale(str, Enum):
    drop = "drop"
    keep = "keep"


class OnGroupTimeout(str, Enum):
    flush = "flush"
    drop = "drop"


def _staleness(value: str | int | None) -> int | None:
    """``--max-staleness``: a number of versions (0 or more), or ``none`` for no bound."""
    if value is None or isinstance(value, int):
        return value
    if value.strip().lower() == "none":
        return None
    try:
        versions = int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is neither a number of versions nor 'none'") from None
    if versions < 0:
        raise typer.BadParameter(f"{versions} is negative: a number of versions is 0 or more (or 'none')")
    return versions


def batcher(
    ctx: typer.Context,
    max_rollouts: Annotated[int, typer.Option(min=1, help="Most records (finished attempts) per batch.")] = 64,
    max_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Most prompt + response tokens per batch (default: no limit)."),
    ] = None,
    group_size: Annotated[
        int | None,
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
        OnGroupTimeout,
        typer.Option(
            help="An incomplete group that waited --max-group-wait: flush it as it is (default: its records "
            "train, counted in incomplete_groups), or drop it (counted in dropped_incomplete)."
        ),
    ] = OnGroupTimeout.flush,
    max_staleness: Annotated[
        int | None,
        typer.Option(
            parser=_staleness,
            metavar="K|none",
            help="Policy versions a record may lag the newest one seen and still train: records within the "
            "bound are kept and counted (kept_stale, staleness_counts) and the trainer corrects them with "
            "importance sampling; farther ones go by --on-stale. 'none': no bound.",
        ),
    ] = DEFAULT_MAX_STALENESS,
    on_stale: Annotated[
        OnStale,
        typer.Option(
            help="A record more than --max-staleness versions behind: drop it (default; counted in "
            "dropped_stale), or keep it too (counted in kept_stale)."
        ),
    ] = OnStale.drop,
    linger: Annotated[
        float, typer.Option(min=0.0, help="Seconds a partial batch waits for more before it goes out anyway.")
    ] = 30.0,
    input_topic: Annotated[
        str | None,
        typer.Option(
            help="Full name of the topic of triplet records to read (default: <prefix>.triplets).",
        ),
    ] = None,
    output_topic: Annotated[
        str | None,
        typer.Option(
            help="Full name of the batches topic, with the input's partition count (default: <prefix>.triplet-batches)."
        ),
    ] = None,
) -> None:
    """Batch finished attempts from agl.triplets into training batches on agl.triplet-batches.

    One batching state per partition of agl.triplets (keyed by group id, so a group is in one
    partition). Every record ends in exactly one batch or is counted as dropped in the next
    batch, across crashes and restarts. Runs until SIGTERM or Ctrl-C.

    Defaults: late records are kept and corrected, not dropped. A record up to --max-staleness
    (4) versions behind the newest seen trains, counted in its batch's kept_stale and
    staleness_counts (the trainer applies importance sampling); farther behind it is dropped and
    counted (--on-stale drop). A group still incomplete after --max-group-wait (600 s) is
    flushed as it is (--on-group-timeout flush).

    Example: agl-stream batcher --max-rollouts 64 --group-size 8 --max-staleness 1

    A replay (agl-stream replay NAME) is batched with --input-topic <prefix>.triplets.replay.NAME
    --output-topic <prefix>.triplet-batches.replay.NAME (its own consumer group).
    """
    from agl_stream.domain.batching import BatchPolicy

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
    from agl_stream import metrics
    from processors import batcher

    settings = settings_of(ctx)
    with metrics.expose(settings, "batcher"):
        batcher.main(settings, policy, input_topic=input_topic, output_topic=output_topic)

"""``agl-stream inference``: the tiny policy behind an OpenAI-compatible (vLLM-shaped) API.

The role lives in ``consumers.inference``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from agl_stream.cli.context import settings_of


def inference(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind, 0 for a free one.")] = 8000,
    model_name: Annotated[
        str, typer.Option(help="Model name served (and matched against ModelCheckpoint.model).")
    ] = "agl-tiny",
    seed: Annotated[int, typer.Option(help="Seed of the initial random weights.")] = 0,
    follow: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Load new checkpoints published to agl.resources.")
    ] = True,
    checkpoint: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(exists=True, file_okay=False, help="Start from this checkpoint directory, not random weights."),
    ] = None,
    policy_version: Annotated[int, typer.Option(min=0, help="Policy version of the initial weights.")] = 0,
    max_batch_rows: Annotated[int, typer.Option(min=1, help="Most sequences generated in one batch.")] = 64,
    default_max_tokens: Annotated[
        int, typer.Option(min=1, help="Completion length when a request sets no max_tokens.")
    ] = 256,
    torch_threads: Annotated[int, typer.Option(min=1, help="CPU threads torch may use.")] = 1,
) -> None:
    """Serve the policy model: /v1/chat/completions, /v1/completions, /v1/models, /health.

    Responses follow vLLM's OpenAI server, including return_token_ids (prompt and response
    token ids) and raw logprobs. With --follow (the default) the server reads agl.resources
    and swaps in every newer ModelCheckpoint published for --model-name.

    Example: agl-stream inference --port 8000 --model-name agl-tiny
    """
    settings = settings_of(ctx)
    from consumers import inference

    inference.main(
        settings if follow else None,
        host,
        port,
        torch_threads=torch_threads,
        model_name=model_name,
        seed=seed,
        follow=follow,
        checkpoint=checkpoint,
        policy_version=policy_version,
        max_batch_rows=max_batch_rows,
        default_max_tokens=default_max_tokens,
    )

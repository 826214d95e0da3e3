"""``agl-stream inference``: the policy behind an OpenAI-compatible (vLLM-shaped) API, served on
the CPU (the tiny policy or an HF model folder) or by vLLM as a managed child (``--engine vllm``).

The role lives in ``consumers.inference``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from agl_stream.cli.context import settings_of


def inference(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind, 0 for a free one.")] = 8000,
    model_name: Annotated[
        str,
        typer.Option(
            "--model-name", "--served-model-name", help="Model name served (and matched against ModelCheckpoint.model)."
        ),
    ] = "agl-tiny",
    seed: Annotated[int, typer.Option(help="Seed of the initial random weights.")] = 0,
    follow: Annotated[
        bool, typer.Option("--follow/--no-follow", help="Load new checkpoints published to agl.resources.")
    ] = True,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--model",
            "--checkpoint",
            exists=True,
            file_okay=False,
            help="Hugging Face causal LM folder (or trainer checkpoint) to serve first; default: the tiny policy.",
        ),
    ] = None,
    policy_version: Annotated[int, typer.Option(min=0, help="Policy version of the initial weights.")] = 0,
    max_batch_rows: Annotated[int, typer.Option(min=1, help="Most sequences generated in one batch.")] = 64,
    default_max_tokens: Annotated[
        int, typer.Option(min=1, help="Completion length when a request sets no max_tokens.")
    ] = 256,
    torch_threads: Annotated[int, typer.Option(min=1, help="CPU threads torch may use.")] = 1,
    engine: Annotated[
        str, typer.Option(help="cpu: serve in this process (torch); vllm: run vLLM's OpenAI server as a child.")
    ] = "cpu",
    vllm_command: Annotated[
        str | None,
        typer.Option(help="--engine vllm: the server command, split like a shell (default: python -m vllm's server)."),
    ] = None,
    vllm_arg: Annotated[
        list[str] | None,
        typer.Option(help="--engine vllm: one more argument for the server, repeatable (--vllm-arg=--enforce-eager)."),
    ] = None,
    ready_timeout: Annotated[
        float, typer.Option(min=1.0, help="--engine vllm: seconds a (re)started server may take to answer /health.")
    ] = 900.0,
    drain_timeout: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="--engine vllm: seconds a switch waits for the calls in flight before it stops the old server.",
        ),
    ] = 120.0,
    hold_timeout: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="--engine vllm: seconds a call may wait for a switch before it is answered 503 with Retry-After.",
        ),
    ] = 540.0,
) -> None:
    """Serve the policy model: /v1/chat/completions, /v1/completions, /v1/models, /health.

    Responses follow vLLM's OpenAI server, including return_token_ids (prompt and response
    token ids) and raw logprobs. With --follow (the default) the server reads agl.resources
    and swaps in every newer ModelCheckpoint published for --model-name.

    With --engine vllm, vLLM's OpenAI server runs as a child on --host/--port with --model and
    --served-model-name; each newer published checkpoint restarts it on that folder (a managed
    restart, waiting for /health); the responses are vLLM's own. The role's port is a hand-off
    gate in front of vLLM: a restart holds new calls, lets the ones in flight finish
    (--drain-timeout) and sends the held ones to the new server (--hold-timeout), so no call
    fails; every answer names the policy version that served it (x-agl-policy-version).

    Both engines require the API token (AGL_API_TOKEN, else the data dir's, as `up` writes it)
    beyond loopback, and refuse to start there without one; on loopback only with
    AGL_REQUIRE_TOKEN=1. vLLM gets it as its api-key through a 0600 options file (--config).

    Example: agl-stream inference --port 8000 --model-name agl-tiny
    Example: agl-stream inference --engine vllm --model ./qwen --model-name qwen --vllm-arg=--gpu-memory-utilization=0.5
    """
    from agl_stream.auth import listener_token

    settings = settings_of(ctx)
    if engine not in ("cpu", "vllm"):
        raise typer.BadParameter(f"unknown engine {engine!r}: cpu or vllm", param_hint="--engine")
    token = listener_token(settings, host)  # ConfigError beyond loopback without one, before any start
    if engine == "vllm":
        if port == 0:
            raise typer.BadParameter(
                "--engine vllm needs a fixed port (the server restarts on it)", param_hint="--port"
            )
        if checkpoint is not None and not (checkpoint / "config.json").is_file():
            raise typer.BadParameter(
                f"{checkpoint} is not a Hugging Face model folder (no config.json)", param_hint="--model"
            )
        from consumers import vllm_server
        from consumers.switch_gate import HandoffOptions

        vllm_server.main(
            settings if follow else None,
            vllm_server.VllmOptions(
                model_name=model_name,
                model=checkpoint.resolve() if checkpoint is not None else None,
                host=host,
                port=port,
                follow=follow,
                policy_version=policy_version,
                command=vllm_server.parse_command(vllm_command),
                extra_args=tuple(vllm_arg or ()),
                ready_timeout_s=ready_timeout,
                handoff=HandoffOptions(hold_timeout_s=hold_timeout, drain_timeout_s=drain_timeout),
            ),
            token,
        )
        return
    from agl_stream import metrics
    from consumers import inference

    metrics.set_role("inference")  # served on its own app, at /metrics
    inference.main(
        settings,  # also without --follow: its token and data dir (the server reads no topic then)
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

"""``agl-stream llm-proxy``: the OpenAI-compatible proxy that records every LLM call as a span.

The role lives in ``producers.llm_proxy``, imported when the command runs (its libraries load only then).
The CLI is the one part of ``agl_stream`` above the roles (docs/architecture.md, the layers).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from agl_stream.cli.context import settings_of


def _load_model_list(path: Path) -> list[dict[str, Any]]:
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise typer.BadParameter(f"cannot read {path}: {error}", param_hint="--model-list") from error
    entries = loaded.get("model_list") if isinstance(loaded, dict) else loaded
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and "model_name" in e and "litellm_params" in e for e in entries
    ):
        raise typer.BadParameter(
            f"{path} must hold a LiteLLM model_list: a JSON list (or {{'model_list': [...]}}) of "
            '{"model_name": ..., "litellm_params": {"model": "openai/<served name>", "api_base": ...}}',
            param_hint="--model-list",
        )
    return entries


def llm_proxy(
    ctx: typer.Context,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend",
            metavar="MODEL=URL",
            help=(
                "An OpenAI-compatible backend (vLLM) serving MODEL at URL, e.g. "
                "Qwen/Qwen2.5-7B-Instruct=http://10.0.0.5:8000/v1 (repeatable; a model named "
                "twice is load-balanced)."
            ),
        ),
    ] = None,
    model_list: Annotated[
        Path | None,
        typer.Option(
            help="A LiteLLM Router model_list as JSON, for what --backend cannot say (served names, keys, rpm).",
            exists=True,
            dir_okay=False,
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind (0.0.0.0 for every interface).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to bind, 0 for a free one.")] = 8090,
    api_key: Annotated[
        str | None,
        typer.Option(envvar="AGL_LLM_BACKEND_API_KEY", help="API key the --backend servers expect."),
    ] = None,
    logprobs: Annotated[
        bool,
        typer.Option(
            "--logprobs/--no-logprobs",
            help="Ask the backend for the sampled tokens' logprobs even when the agent did not (training uses them).",
        ),
    ] = True,
    retries: Annotated[
        int, typer.Option(min=0, help="Retries of a failed backend call (on another backend of the model if any).")
    ] = 0,
    timeout: Annotated[float, typer.Option(min=0.1, help="Longest a backend call may take, in seconds.")] = 600.0,
    sequence_block: Annotated[
        int, typer.Option(min=1, help="Span sequence ids reserved per attempt at a time (one processor round trip).")
    ] = 256,
    workers: Annotated[
        int,
        typer.Option(
            min=1, help="Processes sharing the port (LiteLLM costs a few ms of CPU per call: one per core scales)."
        ),
    ] = 1,
    agl_v1_model: Annotated[
        str | None,
        typer.Option(
            metavar="MODEL",
            help=(
                "Also serve Agent Lightning 1.0's protocol (/api/..., /proxy/rollout/..., /healthz) so its "
                "controller, trainer and agents run unchanged here; MODEL is its default_proxy.model_name, "
                "served by the endpoints its trainer registers (POST /api/models) or by --backend MODEL=URL."
            ),
            rich_help_panel="Agent Lightning 1.0",
        ),
    ] = None,
    agl_v1_key: Annotated[
        str | None,
        typer.Option(
            envvar="AGL_V1_KEY",
            help="The key 1.0's clients send (its server's key=): required on every route but /healthz.",
            rich_help_panel="Agent Lightning 1.0",
        ),
    ] = None,
    agl_v1_train_temperature: Annotated[
        float, typer.Option(help="Temperature set on 1.0's train-mode calls.", rich_help_panel="Agent Lightning 1.0")
    ] = 1.0,
    agl_v1_val_temperature: Annotated[
        float, typer.Option(help="Temperature set on 1.0's val-mode calls.", rich_help_panel="Agent Lightning 1.0")
    ] = 0.7,
) -> None:
    """Run the LLM proxy until SIGTERM or Ctrl-C.

    Agents call http://HOST:PORT/rollout/<rollout_id>/attempt/<attempt_id>/v1 (a ProxyLLM
    resource with endpoint http://HOST:PORT/v1 gives them that URL). Each chat or text completion
    is forwarded through LiteLLM with vLLM's return_token_ids, and recorded as one span of the
    attempt (token ids, logprobs, messages) before the agent gets its answer. /v1 without a
    rollout and attempt works too, unrecorded. GET /health shows the counters.

    With --agl-v1-model it also serves Agent Lightning 1.0's server protocol: point 1.0's
    agl_server.url at http://HOST:PORT (rollouts, events and calls land in the stack's log and
    tables: replay, SQL, the dashboard, agl-stream's own trainer).

    Example: agl-stream llm-proxy --backend Qwen/Qwen2.5-0.5B-Instruct=http://127.0.0.1:8000/v1
    """
    from agl_stream import metrics
    from agl_stream.local.stack import local_stack_settings
    from producers import llm_proxy

    try:
        models = llm_proxy.model_list_of(backend or [], api_key=api_key)
    except ValueError as error:
        raise typer.BadParameter(str(error), param_hint="--backend") from error
    if model_list is not None:
        models += _load_model_list(model_list)
    if not models and agl_v1_model is None:
        raise typer.BadParameter(
            "name at least one backend, e.g. --backend Qwen/Qwen2.5-0.5B-Instruct=http://127.0.0.1:8000/v1",
            param_hint="--backend",
        )
    options = llm_proxy.ProxyOptions(
        host=host,
        port=port,
        logprobs=logprobs,
        num_retries=retries,
        timeout_s=timeout,
        sequence_block=sequence_block,
        workers=workers,
        agl_v1=None
        if agl_v1_model is None
        else llm_proxy.AglV1Options(
            model_name=agl_v1_model,
            train_temperature=agl_v1_train_temperature,
            val_temperature=agl_v1_val_temperature,
            include_log_probs=logprobs,
        ),
        agl_v1_key=agl_v1_key or None,
    )
    metrics.set_role("llm-proxy")  # served on its own app, at /metrics
    llm_proxy.main(local_stack_settings(settings_of(ctx)), models, options)

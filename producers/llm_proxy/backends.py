"""The LLM proxy's backends as LiteLLM sees them: ``MODEL=URL`` pairs made a Router's model list
(every backend LiteLLM's ``openai/`` provider, priced at zero), LiteLLM imported quietly, and the
transport its backend client goes through."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from agl_stream.logs import get_logger

log = get_logger("agl.llm_proxy")

ZERO_PRICES = dict.fromkeys(
    ("input_cost_per_token", "output_cost_per_token", "cache_creation_input_token_cost", "cache_read_input_token_cost"),
    0.0,
)
"""Our own models cost nothing per token. LiteLLM prices every call; with an explicit price it
skips looking the model up in its price map, ~1.6 ms of CPU per call here (measured, a third of
LiteLLM's time), and the proxy never reads the price."""


def backend_url(url: str) -> str:
    """A backend's OpenAI base URL: ``http://host:8000`` and ``http://host:8000/v1`` both give ``.../v1``."""
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"backend URL {url!r} must start with http:// or https://")
    return url if url.endswith("/v1") else f"{url}/v1"


def model_list_of(backends: Sequence[str], *, api_key: str | None = None) -> list[dict[str, Any]]:
    """A LiteLLM Router ``model_list`` from ``MODEL=URL`` pairs (a model named twice is load-balanced).

    Every backend is LiteLLM's ``openai/`` provider: the proxy reads raw responses through the
    client that provider uses (see proxy.py's docstring). The backend is asked for the model by
    the same name the agent used.
    """
    model_list = []
    for spec in backends:
        name, sep, url = spec.partition("=")
        if not sep or not name.strip() or not url.strip():
            raise ValueError(f"a backend is MODEL=URL (e.g. Qwen/Qwen2.5-7B=http://127.0.0.1:8000/v1), got {spec!r}")
        name = name.strip()
        params = {"model": f"openai/{name}", "api_base": backend_url(url), "api_key": api_key or "none", **ZERO_PRICES}
        model_list.append({"model_name": name, "litellm_params": params})
    return model_list


def priced(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A model_list entry with zero prices unless it names prices of its own."""
    params = dict(entry.get("litellm_params") or {})
    if not any(key in params for key in ZERO_PRICES):
        params.update(ZERO_PRICES)
    return {**entry, "litellm_params": params}


def import_litellm() -> Any:
    # Without it, importing litellm fetches a price map over the network (5 s timeout) and
    # starts a retry thread; the proxy never prices calls.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True  # else every exception also prints help text to stdout
    litellm.drop_params = False
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    return litellm


def new_inner_transport(litellm: Any) -> httpx.AsyncBaseTransport:
    """LiteLLM's own transport (aiohttp-based: measured faster here), else httpx's."""
    try:
        from litellm.llms.custom_httpx.http_handler import AsyncHTTPHandler

        transport = AsyncHTTPHandler.create_async_transport()
    except Exception as error:  # LiteLLM internals move fast; httpx's transport works everywhere
        log.info("using httpx's transport for backends", reason=f"{type(error).__name__}: {error}")
        transport = None
    if isinstance(transport, httpx.AsyncBaseTransport):
        return transport
    return httpx.AsyncHTTPTransport(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200))

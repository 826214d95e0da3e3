"""The LLM proxy role: OpenAI-compatible, built on LiteLLM, every call a span (proxy.py), served
over HTTP (server.py) to backends made LiteLLM's model list (backends.py), with the backend's raw
answers captured (capture.py) and span sequence ids reserved per attempt (sequence_ids.py)."""

from producers.llm_proxy.agl_v1 import AglV1Options
from producers.llm_proxy.backends import backend_url, model_list_of
from producers.llm_proxy.capture import CALL_HEADER, Capture, CaptureTransport
from producers.llm_proxy.proxy import LLMProxy, ProxyOptions, ProxyStats
from producers.llm_proxy.sequence_ids import SequenceBlocks
from producers.llm_proxy.server import create_app, main, run, serving

__all__ = [
    "CALL_HEADER",
    "AglV1Options",
    "Capture",
    "CaptureTransport",
    "LLMProxy",
    "ProxyOptions",
    "ProxyStats",
    "SequenceBlocks",
    "backend_url",
    "create_app",
    "main",
    "model_list_of",
    "run",
    "serving",
]

"""The inference server role: the tiny policy behind an OpenAI-compatible HTTP API (server.py),
its generation worker (engine.py) and the API's shapes (openai_api.py)."""

from consumers.inference.engine import Engine, Job, Policy, Sampling
from consumers.inference.openai_api import VERSION_HEADER, ChatRequest, CompletionRequest
from consumers.inference.server import InferenceOptions, InferenceServer, create_app, main, run_inference

__all__ = [
    # the API
    "VERSION_HEADER",
    "ChatRequest",
    "CompletionRequest",
    # generation
    "Engine",
    # the server
    "InferenceOptions",
    "InferenceServer",
    "Job",
    "Policy",
    "Sampling",
    "create_app",
    "main",
    "run_inference",
]

"""agl-stream: Agent Lightning as an event-sourced pipeline over Apache Kafka."""

__version__ = "0.1.0"

from agl_stream.emitters import (
    emit_annotation,
    emit_exception,
    emit_message,
    emit_object,
    emit_reward,
    find_final_reward,
    find_reward_spans,
    get_reward_value,
    is_reward_span,
)
from agl_stream.litagent import Hook, LitAgent, rollout
from agl_stream.models import LLM, PromptTemplate, ProxyLLM, Rollout, Span
from agl_stream.store.client import AglStore, connect
from agl_stream.store.types import UNSET, AttemptedRollout

__all__ = [
    "LLM",
    "UNSET",
    "AglStore",
    "AttemptedRollout",
    "Hook",
    "LitAgent",
    "PromptTemplate",
    "ProxyLLM",
    "Rollout",
    "Span",
    "connect",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "find_final_reward",
    "find_reward_spans",
    "get_reward_value",
    "is_reward_span",
    "rollout",
]

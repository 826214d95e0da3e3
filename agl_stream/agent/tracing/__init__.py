"""Tracing of agent attempts: spans stamped with their attempt and sequence id, exported in batches."""

from agl_stream.agent.tracing.buffer import ATTEMPT_ID_KEY, ROLLOUT_ID_KEY, SEQUENCE_ID_KEY, AttemptTrace
from agl_stream.agent.tracing.export_policy import Cut, ExportPolicy, Wait
from agl_stream.agent.tracing.processor import current_attempt
from agl_stream.agent.tracing.tracer import RECORD_ERRORS, AttemptTracer, SpanSink, TracerStats

__all__ = [
    "ATTEMPT_ID_KEY",
    "RECORD_ERRORS",
    "ROLLOUT_ID_KEY",
    "SEQUENCE_ID_KEY",
    "AttemptTrace",
    "AttemptTracer",
    "Cut",
    "ExportPolicy",
    "SpanSink",
    "TracerStats",
    "Wait",
    "current_attempt",
]

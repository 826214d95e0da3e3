"""Agent Lightning 1.0's protocol mapped onto the store: pure shapes and rules, no I/O.

Agent Lightning 1.0 has no runners: its *controller* lists queuing rollouts, starts one agent
process per rollout and reports each rollout's state with a PATCH; the agent calls the model
through a per-rollout proxy URL and posts events (a reward). This module says how that maps onto
agl-stream's store (the I/O edge is ``producers/llm_proxy/agl_v1.py``):

- A 1.0 rollout is a store rollout **started, not queued**: created with its one attempt, whose
  id is 1.0's attempt id ``"0"``, so no runner of ours ever claims it (the 1.0 controller runs
  it) and the proxy's spans are recorded under ``(rollout_id, "0")`` as the 1.0 URL names them.
  The rollout keeps the caller's id (1.0 clients choose ids so that a retried create is
  idempotent). ``is_train`` is the store's mode (train/val); 1.0's ``config`` and ``metadata``
  are kept verbatim under :data:`V1_KEY` in the store rollout's metadata, which also marks the
  rollout as a 1.0 one (the 1.0 listings show only those).
- The 1.0 lifecycle (its state, ``last_attempt_id``, ``error_message``, ``k8s_job_name``, its
  version and update time) lives in the attempt's metadata under :data:`V1_KEY`, and each PATCH
  is **one** attempt update: the attempt's status follows the state (running, succeeded,
  failed), so the rollout finishes as the store's own rollouts do and the triplet builder turns
  its spans into training data. The store's terminal statuses win over the recorded state (a
  rollout cancelled in agl-stream reads as failed in 1.0).
- Events are spans of the attempt: a POSTed event is one span carrying its type and data (a
  reward is also a reward span in agl-stream's layout, so the pipeline scores it); the proxy's
  LLM-call spans read back as ``model_request`` events, rebuilt from the span's GenAI messages,
  token ids and logprobs. :func:`triplet_events` is 1.0's ``format=triplet`` view.
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from agl_stream.domain.llm_calls.messages import json_value
from agl_stream.domain.llm_calls.spans import (
    INPUT_MESSAGES_KEY,
    OUTPUT_MESSAGES_KEY,
    SCOPE_NAME,
    new_span_id,
    new_trace_id,
)
from agl_stream.models import Rollout, Span
from agl_stream.models.base import AttemptStatus, RolloutStatus
from agl_stream.models.rollouts import RolloutConfig
from agl_stream.models.spans import OtelResource, SpanStatus
from agl_stream.wire.semconv import AGL_ANNOTATION, POLICY_VERSION, PRIMARY_REWARD_NAME, RewardAttributes, reward_key

V1_KEY = "agentlightning_v1"
"""Metadata key of the 1.0 fields: on the store rollout (its 1.0 config and metadata) and on its
attempt (the 1.0 lifecycle). A store rollout with it is a 1.0 rollout."""
ATTEMPT_ID = "0"
"""1.0's only attempt id (its controller starts each rollout once)."""
V1State = Literal["queuing", "running", "succeeded", "failed"]
TRANSITIONS: dict[str, frozenset[str]] = {
    "queuing": frozenset({"running", "failed"}),
    "running": frozenset({"succeeded", "failed"}),
}
ATTEMPT_STATUS: dict[str, AttemptStatus] = {"running": "running", "succeeded": "succeeded", "failed": "failed"}
ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
"""Ids a 1.0 client may choose (1.0 uses uuid4 hex): they travel as Kafka keys and URL segments."""
EVENT_TYPE_KEY = "agentlightning.v1.event_type"
EVENT_DATA_KEY = "agentlightning.v1.event_data"
EVENT_SPAN_NAME = "agentlightning.v1.event"
SERVICE_NAME = "agl-stream-agl-v1"


# -- the wire (1.0's field names and defaults) --------------------------------------------------


class _Shape(BaseModel):
    model_config = ConfigDict(extra="ignore")


class LocalConfig(_Shape):
    agent_class: str | None = None
    env_map: dict[str, str] = Field(default_factory=dict)


class K8sConfig(_Shape):
    job_template: str | None = None


class V1RolloutConfig(_Shape):
    timeout_seconds: int = 3600
    local: LocalConfig | None = None
    k8s: K8sConfig | None = None


class RolloutCreate(_Shape):
    input: JsonValue = None
    is_train: bool = True
    config: V1RolloutConfig | None = None
    metadata: dict[str, JsonValue] | None = None
    rollout_id: str | None = Field(default=None, pattern=ROLLOUT_ID_PATTERN)


class StatusPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as 1.0's: an unknown status key is a 422

    state: V1State | None = None
    k8s_job_name: str | None = None
    last_attempt_id: str | None = None
    error_message: str | None = None


class RolloutPatch(_Shape):
    status: StatusPatch | None = None


class EventCreate(_Shape):
    event_type: str = Field(min_length=1, max_length=256)
    data: dict[str, JsonValue] = Field(default_factory=dict)


class ModelEntry(_Shape):
    model: str = Field(min_length=1, max_length=1024)
    endpoint: str = Field(min_length=1, max_length=2048)
    version: int = 0


class PauseBody(_Shape):
    retry_after_seconds: int = Field(default=5, ge=0, le=86_400)
    reason: str | None = None


# -- rollouts --------------------------------------------------------------------------------


def new_rollout(create: RolloutCreate, rollout_id: str, now: float) -> Rollout:
    """The store rollout for a 1.0 create (queuing; the caller starts it with attempt ``"0"``).

    The store's own retry and liveness policy stays off: 1.0's controller enforces its timeout
    and decides the outcome."""
    config = create.config or V1RolloutConfig()
    return Rollout(
        rollout_id=rollout_id,
        input=create.input,
        start_time=now,
        mode="train" if create.is_train else "val",
        status="queuing",
        config=RolloutConfig(),
        metadata={V1_KEY: {"config": config.model_dump(mode="json"), "metadata": dict(create.metadata or {})}},
    )


def new_rollout_id() -> str:
    """An id as 1.0's server makes one when the caller gives none (32 hex characters)."""
    return secrets.token_hex(16)


def is_v1(rollout: Rollout) -> bool:
    return isinstance(rollout.metadata, Mapping) and isinstance(rollout.metadata.get(V1_KEY), Mapping)


def lifecycle_of(attempt_metadata: Any) -> dict[str, Any]:
    """The 1.0 lifecycle recorded on the attempt (empty before the first PATCH)."""
    if isinstance(attempt_metadata, Mapping) and isinstance(attempt_metadata.get(V1_KEY), Mapping):
        return dict(attempt_metadata[V1_KEY])
    return {}


def state_of(status: RolloutStatus, lifecycle: Mapping[str, Any]) -> V1State:
    """The 1.0 state: the store's terminal status when it has one, else what the PATCHes said
    (an attempt's spans make the store's status running before the controller's PATCH does)."""
    if status == "succeeded":
        return "succeeded"
    if status in ("failed", "cancelled"):
        return "failed"
    return "running" if lifecycle.get("state") == "running" else "queuing"


def view(rollout: Rollout, attempt_metadata: Any) -> dict[str, Any]:
    """The 1.0 Rollout JSON of a store rollout (every field present, nulls included)."""
    fields = dict(rollout.metadata[V1_KEY]) if is_v1(rollout) else {}  # type: ignore[index]
    lifecycle = lifecycle_of(attempt_metadata)
    state = state_of(rollout.status, lifecycle)
    error = lifecycle.get("error_message")
    if state == "failed" and error is None and lifecycle.get("state") != "failed":
        error = f"the rollout was {rollout.status} in agl-stream"  # a cancel or a watchdog verdict there
    updated = max(
        float(lifecycle.get("updated_at") or rollout.start_time),
        rollout.end_time or rollout.start_time,
    )
    config = V1RolloutConfig.model_validate(fields.get("config") or {})
    metadata = {"batch_idx": None, "sample_idx_in_batch": None, **dict(fields.get("metadata") or {})}
    return {
        "rollout_id": rollout.rollout_id,
        "input": rollout.input,
        "is_train": rollout.mode == "train",
        "config": config.model_dump(mode="json"),
        "metadata": metadata,
        "status": {
            "state": state,
            "k8s_job_name": lifecycle.get("k8s_job_name"),
            "last_attempt_id": lifecycle.get("last_attempt_id"),
            "error_message": error,
            "version": int(lifecycle.get("version") or 1),
            "created_at": rollout.start_time,
            "updated_at": updated,
        },
    }


class TransitionConflict(ValueError):
    """A PATCH 1.0 refuses with 409: a state change outside its transitions (the same state included)."""


def patched(
    rollout_id: str, state: V1State, lifecycle: Mapping[str, Any], patch: StatusPatch, now: float
) -> tuple[AttemptStatus | None, dict[str, Any]] | None:
    """What a PATCH changes: (the attempt's new status or None, the new lifecycle), or None when
    it changes nothing (no field given). TransitionConflict when 1.0 refuses the state change."""
    given = patch.model_dump(exclude_unset=True)
    target = given.pop("state", None)
    if target is None and not given:
        return None
    if target is not None and target not in TRANSITIONS.get(state, frozenset()):
        raise TransitionConflict(f"Rollout {rollout_id}: cannot transition {state} -> {target}")
    new = {**lifecycle, **given, "state": target or state, "version": int(lifecycle.get("version") or 1) + 1}
    new["updated_at"] = now
    return (ATTEMPT_STATUS[target] if target is not None else None), new


def data_id_of(input: Any) -> str:
    """1.0's ``data_id`` of a terminal item: the input's ``data_id`` or ``instance_id``."""
    if isinstance(input, Mapping):
        return str(input.get("data_id") or input.get("instance_id") or "")
    return ""


# -- events ----------------------------------------------------------------------------------


def _reward_value(data: Mapping[str, Any]) -> float | None:
    value = data.get("value")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def event_span(rollout_id: str, attempt_id: str, sequence_id: int, event: EventCreate, now: float) -> Span:
    """A POSTed event as a span of the attempt: its type and data as attributes, and for a reward
    with a finite number, the reward in agl-stream's layout too (what the pipeline scores)."""
    attributes: dict[str, Any] = {
        EVENT_TYPE_KEY: event.event_type,
        EVENT_DATA_KEY: json.dumps(event.data, separators=(",", ":"), allow_nan=False),
    }
    name = EVENT_SPAN_NAME
    reward = _reward_value(event.data) if event.event_type == "reward" else None
    if reward is not None:
        name = AGL_ANNOTATION
        attributes[reward_key(0, RewardAttributes.REWARD_NAME)] = PRIMARY_REWARD_NAME
        attributes[reward_key(0, RewardAttributes.REWARD_VALUE)] = reward
    return Span(
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        sequence_id=sequence_id,
        trace_id=new_trace_id(),
        span_id=new_span_id(),
        name=name,
        status=SpanStatus(status_code="OK"),
        attributes=attributes,
        start_time=now,
        end_time=now,
        resource=OtelResource(attributes={"service.name": SERVICE_NAME}),
        scope_name=SERVICE_NAME,
    )


def events_of(spans: Iterable[Span]) -> list[dict[str, Any]]:
    """The attempt's 1.0 events, in the spans' order: POSTed events as they came, the proxy's
    LLM calls as ``model_request`` events. Other spans (the agent's own) are not events."""
    events = []
    for span in spans:
        if EVENT_TYPE_KEY in span.attributes:
            try:
                data = json.loads(str(span.attributes.get(EVENT_DATA_KEY) or "{}"))
            except ValueError:
                data = {}
            event_type = str(span.attributes[EVENT_TYPE_KEY])
        elif span.scope_name == SCOPE_NAME:
            event_type, data = "model_request", model_request_of(span)
        else:
            continue
        events.append(
            {
                "event_type": event_type,
                "rollout_id": span.rollout_id,
                "attempt_id": span.attempt_id,
                "timestamp": span.start_time or 0.0,
                "data": data if isinstance(data, dict) else {"value": data},
            }
        )
    return events


def _ints(value: Any) -> list[int] | None:
    return [int(v) for v in value] if isinstance(value, list | tuple) else None


def openai_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """One GenAI-conventions message (role, typed parts) back in OpenAI's chat shape."""
    role = str(message.get("role") or "user")
    texts: list[str] = []
    others: list[Any] = []
    calls: list[dict[str, Any]] = []
    out: dict[str, Any] = {"role": role}
    for part in message.get("parts") or []:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("type")
        if kind == "text":
            texts.append(str(part.get("content") or ""))
        elif kind == "reasoning":
            out["reasoning_content"] = part.get("content")
        elif kind == "tool_call":
            arguments = part.get("arguments")
            calls.append(
                {
                    "id": part.get("id"),
                    "type": "function",
                    "function": {
                        "name": part.get("name"),
                        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                    },
                }
            )
        elif kind == "tool_call_response":
            out["role"] = "tool"
            out["tool_call_id"] = part.get("id")
            texts.append(str(part.get("response") if part.get("response") is not None else ""))
        else:  # images, audio, files: the provider's part as the agent sent it
            others.append(part.get("value"))
    if others:
        out["content"] = [{"type": "text", "text": t} for t in texts] + others
    else:
        out["content"] = "".join(texts) if texts or not calls else None
    if calls:
        out["tool_calls"] = calls
    return out


def model_request_of(span: Span) -> dict[str, Any]:
    """A proxy span as 1.0's ``model_request`` data: the request and the backend's answer rebuilt
    from the span (messages, token ids, logprobs, usage), the server, latency and status."""
    attributes = span.attributes
    model = attributes.get("gen_ai.request.model")
    request: dict[str, Any] = {"model": model}
    inputs = json_value(attributes.get(INPUT_MESSAGES_KEY))
    if isinstance(inputs, list):
        request["messages"] = [openai_message(m) for m in inputs if isinstance(m, Mapping)]
    for key, value in attributes.items():
        if key.startswith("gen_ai.request.") and key != "gen_ai.request.model":
            request[key.removeprefix("gen_ai.request.")] = value
    outputs = json_value(attributes.get(OUTPUT_MESSAGES_KEY))
    choice: dict[str, Any] = {"index": 0}
    if isinstance(outputs, list) and outputs and isinstance(outputs[0], Mapping):
        choice["message"] = openai_message(outputs[0])
        choice["finish_reason"] = outputs[0].get("finish_reason")
    response_ids = _ints(attributes.get("response_token_ids"))
    if response_ids is not None:
        choice["token_ids"] = response_ids
    logprobs = json_value(attributes.get("logprobs.content"))
    if isinstance(logprobs, list):
        choice["logprobs"] = {"content": logprobs}
    input_tokens = attributes.get("gen_ai.usage.input_tokens")
    output_tokens = attributes.get("gen_ai.usage.output_tokens")
    usage = None
    if isinstance(input_tokens, int) and isinstance(output_tokens, int):
        usage = {
            "prompt_tokens": input_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
        }
    failed = span.status.status_code == "ERROR"
    status = attributes.get("http.response.status_code")
    response: dict[str, Any] = {
        "id": attributes.get("gen_ai.response.id"),
        "model": attributes.get("gen_ai.response.model"),
    }
    if failed:
        response["error"] = {"message": span.status.description, "type": attributes.get("error.type")}
    else:
        response["choices"] = [choice]
    prompt_ids = _ints(attributes.get("prompt_token_ids"))
    if prompt_ids is not None:
        response["prompt_token_ids"] = prompt_ids
    if usage is not None:
        response["usage"] = usage
    version = attributes.get(POLICY_VERSION)
    start, end = span.start_time or 0.0, span.end_time or span.start_time or 0.0
    return {
        "model": model,
        "model_version": version,
        "request": request,
        "response": response,
        "server": {
            "model": attributes.get("gen_ai.response.model") or model,
            "endpoint": attributes.get("gen_ai.openai.api_base"),
            "version": version if isinstance(version, int) else 0,
        },
        "latency_ms": round(max(0.0, end - start) * 1000.0, 3),
        "http_status": status if isinstance(status, int) else (500 if failed else 200),
        "status": "error" if failed else "ok",
        "retry_count": 0,
        "usage": usage,
        "finish_reason": choice.get("finish_reason"),
        "routed_experts": None,
    }


def _log_probs(choice: Mapping[str, Any]) -> list[float] | None:
    """The sampled tokens' logprobs of a choice, or None when any is missing or not finite."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, Mapping):
        return None
    if isinstance(logprobs.get("content"), list):
        items = logprobs["content"]
        if not all(isinstance(item, Mapping) and "logprob" in item for item in items):
            return None
        raw = [item["logprob"] for item in items]
    elif isinstance(logprobs.get("token_logprobs"), list):
        raw = list(logprobs["token_logprobs"])
    else:
        return None
    values = []
    for value in raw:
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None
        if not math.isfinite(number):
            return None
        values.append(number)
    return values


def _trimmed_model_request(data: Mapping[str, Any]) -> dict[str, Any]:
    response = data.get("response")
    prompt: Any = []
    answer: Any = []
    log_probs = None
    if isinstance(response, Mapping):
        prompt = response.get("prompt_token_ids") or []
        choices = response.get("choices") or []
        if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
            first = choices[0]
            prompt = prompt or first.get("prompt_token_ids") or []
            answer = first.get("token_ids") or []
            log_probs = _log_probs(first)
    elif isinstance(response, list):  # a stream's chunks, as older 1.0 servers stored them
        for chunk in response:
            if not isinstance(chunk, Mapping):
                continue
            prompt = prompt or chunk.get("prompt_token_ids") or []
            choices = chunk.get("choices") or []
            if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
                answer = [*answer, *(choices[0].get("token_ids") or [])]
    server = data.get("server") if isinstance(data.get("server"), Mapping) else {}
    trimmed: dict[str, Any] = {
        "prompt_token_ids": prompt,
        "response_token_ids": answer,
        "response_log_probs": log_probs,
        "server": {"model": server.get("model"), "version": server.get("version")},  # type: ignore[union-attr]
    }
    if data.get("routed_experts") is not None:
        trimmed["routed_experts"] = data["routed_experts"]
    for key in ("http_status", "status"):
        if key in data:
            trimmed[key] = data[key]
    if isinstance(response, Mapping) and "error" in response:
        trimmed["error"] = response["error"]
    return trimmed


def _trimmed(event: Mapping[str, Any]) -> dict[str, Any]:
    data = event.get("data") or {}
    if event.get("event_type") == "model_request":
        return {**event, "data": _trimmed_model_request(data)}
    if event.get("event_type") == "reward":
        kept = {"value": data.get("value")}
        kept.update({key: data[key] for key in ("source", "reason") if key in data})
        return {**event, "data": kept}
    return dict(event)


def _prompt_key(data: Mapping[str, Any]) -> tuple[int, ...] | None:
    ids = data.get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
        return tuple(ids)
    return None


def triplet_events(events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """1.0's ``format=triplet`` view: model requests cut to token ids, logprobs, server and
    status, rewards to their value; of the model requests with the same prompt token ids only
    the last is kept (those without valid ids are all kept)."""
    trimmed = [_trimmed(event) for event in events]
    last: dict[tuple[int, ...], int] = {}
    for index, event in enumerate(trimmed):
        if event.get("event_type") == "model_request":
            key = _prompt_key(event["data"])
            if key is not None:
                last[key] = index
    return [
        event
        for index, event in enumerate(trimmed)
        if event.get("event_type") != "model_request"
        or (key := _prompt_key(event["data"])) is None
        or last[key] == index
    ]


def without_routed_experts(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {**e, "data": {k: v for k, v in e["data"].items() if k != "routed_experts"}}
        if e.get("event_type") == "model_request" and isinstance(e.get("data"), dict)
        else e
        for e in events
    ]

"""Span naming and attribute conventions shared by emitters, adapters and the span pipeline.

The string values are the wire contract with Agent Lightning: spans written by the original
library and by agl-stream must be interchangeable, so none of these values may change.

Layout of the structured attributes (OTel attributes are flat, so lists are spelled with a
numeric path segment)::

    agentlightning.reward.0.name   = "primary"     # index 0 is always the primary reward
    agentlightning.reward.0.value  = 1.0
    agentlightning.reward.1.name   = "efficiency"
    agentlightning.reward.1.value  = 0.75
    agentlightning.link.0.key_match   = "gen_ai.response.id"
    agentlightning.link.0.value_match = "chatcmpl-123"
    agentlightning.tag.0 = "fast"
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict

__all__ = [
    "AGL_ANNOTATION",
    "AGL_ATTEMPT",
    "AGL_EXCEPTION",
    "AGL_MESSAGE",
    "AGL_OBJECT",
    "AGL_VIRTUAL",
    "ATTEMPT_ID_KEY",
    "PRIMARY_REWARD_NAME",
    "ROLLOUT_ID_KEY",
    "SEQUENCE_ID_KEY",
    "AttributeLink",
    "LightningResourceAttributes",
    "LightningSpanAttributes",
    "LinkAttributes",
    "LinkPydanticModel",
    "RewardAttributes",
    "RewardDimension",
    "RewardPydanticModel",
    "link_key",
    "reward_key",
    "tag_key",
]

AGL_ANNOTATION = "agentlightning.annotation"
"""Span name for annotations: rewards, tags and free-form metadata about part of a rollout."""

AGL_ATTEMPT = "agentlightning.attempt"
"""Span name of an attempt's root: the runner opens it around the agent, so every span the
attempt makes (the agent's, its LLM client's, the LLM proxy's through ``traceparent``) is one
trace and one tree. It ends last, so it takes the attempt's highest sequence id."""

AGL_MESSAGE = "agentlightning.message"
"""Span name for textual log/debug messages."""

AGL_OBJECT = "agentlightning.object"
"""Span name for an arbitrary serialized object."""

AGL_EXCEPTION = "agentlightning.exception"
"""Span name for a recorded exception."""

AGL_VIRTUAL = "agentlightning.virtual"
"""Span name for synthetic nodes (roots, grouping nodes) that adapters add to a span tree."""

PRIMARY_REWARD_NAME = "primary"
"""Dimension name given to a reward emitted as a bare number."""

POLICY_VERSION = "agentlightning.policy_version"
"""agl-stream's own span attribute: the policy version that produced the span. Runners set it on
every span of an attempt (the version of the resources snapshot the attempt runs with); the LLM
proxy sets it on a call's span from the version the inference backend reports for that answer
(``x-agl-policy-version``), which is exact even while a new checkpoint is loading."""

POLICY_VERSION_HEADER = "x-agl-policy-version"
"""HTTP response header by which an inference backend names the policy version that answered."""


class LightningResourceAttributes(str, Enum):
    """Resource attributes that tie a span to its rollout, attempt and position in the attempt."""

    ROLLOUT_ID = "agentlightning.rollout_id"
    ATTEMPT_ID = "agentlightning.attempt_id"
    SPAN_SEQUENCE_ID = "agentlightning.span_sequence_id"


# The same keys as plain strings, for attribute maps (the one definition: import these).
ROLLOUT_ID_KEY: str = LightningResourceAttributes.ROLLOUT_ID.value
ATTEMPT_ID_KEY: str = LightningResourceAttributes.ATTEMPT_ID.value
SEQUENCE_ID_KEY: str = LightningResourceAttributes.SPAN_SEQUENCE_ID.value


class LightningSpanAttributes(str, Enum):
    """Span attribute names (and prefixes) written by the emitters.

    Exception details are absent on purpose: they use OpenTelemetry's own ``exception.*``
    conventions.
    """

    REWARD = "agentlightning.reward"
    """Prefix: ``agentlightning.reward.<i>.name`` / ``.value`` (see :class:`RewardAttributes`)."""

    LINK = "agentlightning.link"
    """Prefix: ``agentlightning.link.<i>.key_match`` / ``.value_match`` (see :class:`LinkAttributes`)."""

    TAG = "agentlightning.tag"
    """Prefix: ``agentlightning.tag.<i>`` holds one free-form tag string."""

    MESSAGE_BODY = "agentlightning.message.body"
    OBJECT_TYPE = "agentlightning.object.type"
    """Type name of the emitted object: the bare name for builtins, ``module.QualName`` otherwise."""

    OBJECT_LITERAL = "agentlightning.object.literal"
    """str()-form of a str/int/float/bool object, or base64 of a bytes object."""

    OBJECT_JSON = "agentlightning.object.json"
    """JSON text of any other (JSON-serializable) object."""


class RewardAttributes(str, Enum):
    """Field names inside one reward dimension (``agentlightning.reward.<i>.<field>``)."""

    REWARD_NAME = "name"
    REWARD_VALUE = "value"


class LinkAttributes(str, Enum):
    """Field names inside one attribute link (``agentlightning.link.<i>.<field>``).

    Unlike an OpenTelemetry span link, which names one concrete span, these links are queries:
    they select every span whose attribute ``key_match`` equals ``value_match``, and the target
    may not have been emitted yet. ``trace_id`` and ``span_id`` as ``key_match`` address a span
    by its identity instead of an attribute.
    """

    KEY_MATCH = "key_match"
    VALUE_MATCH = "value_match"


class RewardDimension(BaseModel):
    """One named component of a (possibly multi-dimensional) reward."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: float


class AttributeLink(BaseModel):
    """A link from a span to the spans whose attribute ``key_match`` equals ``value_match``."""

    model_config = ConfigDict(frozen=True)

    key_match: str
    value_match: str


# Seed spellings, so code ported from Agent Lightning keeps importing the names it knows.
RewardPydanticModel = RewardDimension
LinkPydanticModel = AttributeLink


def reward_key(index: int, field: RewardAttributes) -> str:
    """Flat attribute key of one field of reward dimension ``index``."""
    return f"{LightningSpanAttributes.REWARD.value}.{index}.{field.value}"


def link_key(index: int, field: LinkAttributes) -> str:
    """Flat attribute key of one field of link ``index``."""
    return f"{LightningSpanAttributes.LINK.value}.{index}.{field.value}"


def tag_key(index: int) -> str:
    """Flat attribute key of tag ``index``."""
    return f"{LightningSpanAttributes.TAG.value}.{index}"

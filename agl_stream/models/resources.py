"""Resources: LLM endpoints, prompt templates and checkpoints, versioned as snapshots."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeAlias

from pydantic import Field

from agl_stream.models.base import AglModel, JsonObject, StoredSeconds, UnionMember


class _Endpoint(UnionMember):
    """Fields shared by LLM and ProxyLLM."""

    endpoint: str
    model: str
    api_key: str | None = None
    sampling_parameters: JsonObject = Field(default_factory=dict)


class LLM(_Endpoint):
    """An OpenAI-compatible endpoint and model."""

    avro_name: ClassVar[str] = "agl.LLM"

    resource_type: Literal["llm"] = "llm"


class ProxyLLM(_Endpoint):
    """An LLM behind the agl-stream LLM proxy; ask it for :meth:`get_base_url`."""

    avro_name: ClassVar[str] = "agl.ProxyLLM"

    resource_type: Literal["proxy_llm"] = "proxy_llm"

    def get_base_url(self, rollout_id: str, attempt_id: str) -> str:
        """The base URL a client of this rollout and attempt must use.

        ``/rollout/<rollout_id>/attempt/<attempt_id>`` goes into the path (before a trailing
        ``/v1`` if there is one), so the proxy can attribute every call.
        """
        base = self.endpoint.rstrip("/")
        suffix = ""
        if base.endswith("/v1"):
            base, suffix = base[: -len("/v1")], "/v1"
        return f"{base}/rollout/{rollout_id}/attempt/{attempt_id}{suffix}"


class PromptTemplate(UnionMember):
    """A prompt template."""

    avro_name: ClassVar[str] = "agl.PromptTemplate"

    resource_type: Literal["prompt_template"] = "prompt_template"
    template: str
    engine: Literal["jinja", "f-string", "poml"]

    def format(self, **values: Any) -> str:
        """The template filled in (the ``f-string`` engine, as the seed's ``format``)."""
        if self.engine != "f-string":
            raise NotImplementedError(
                f"format() fills f-string templates only; render a {self.engine} template with its own engine"
            )
        return self.template.format(**values)


class ModelCheckpoint(UnionMember):
    """A trained model checkpoint (one policy version)."""

    avro_name: ClassVar[str] = "agl.ModelCheckpoint"

    resource_type: Literal["model_checkpoint"] = "model_checkpoint"
    uri: str
    model: str
    policy_version: int
    format: str = "hf"
    metadata: JsonObject | None = None


Resource: TypeAlias = Annotated[LLM | ProxyLLM | PromptTemplate | ModelCheckpoint, Field(discriminator="resource_type")]


class ResourcesUpdate(AglModel):
    """An immutable, versioned snapshot of named resources (topic agl.resources)."""

    avro_name: ClassVar[str] = "agl.ResourcesUpdate"

    resources_id: str
    create_time: StoredSeconds
    update_time: StoredSeconds
    version: int
    resources: dict[str, Resource] = Field(default_factory=dict)

    @property
    def policy_version(self) -> int | None:
        """The policy version this snapshot serves: its newest model checkpoint's; None without one."""
        versions = [r.policy_version for r in self.resources.values() if isinstance(r, ModelCheckpoint)]
        return max(versions) if versions else None

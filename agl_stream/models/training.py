"""Training data: triplets, per-attempt triplet records, batches."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from agl_stream.models.base import AglModel, JsonObject, RolloutMode


class Triplet(AglModel):
    """A training sample: one LLM call (``transition``) or consecutive calls merged (``trajectory``)."""

    avro_name: ClassVar[str] = "agl.Triplet"

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float] | None = None
    reward: float | None = None
    metadata: JsonObject = Field(default_factory=dict)
    prompt_extra: JsonObject | None = None
    response_extra: JsonObject | None = None
    # Trajectory aggregation (agl_stream/domain/adapter/trajectory.py): one sample may hold several
    # consecutive calls; the response part then holds inserted tokens (tool results, user turns)
    # between the calls' responses, marked 0 here. None: every response token was generated.
    response_mask: list[int] | None = None
    # Lineage: the LLM-call span ids the sample was built from, in call order (empty in records
    # written before the field existed; their metadata still has the one span_id).
    span_ids: list[str] = Field(default_factory=list)
    calls: int = 1
    # Per call, in call order: the policy version of the server that answered it (the proxy's
    # agentlightning.policy_version span attribute), None where the server named none. Empty in
    # records written before the field existed.
    policy_versions: list[int | None] = Field(default_factory=list)


class TripletRecord(AglModel):
    """The triplets of one finished attempt (topic agl.triplets, key group_id).

    Keyed by group_id so every rollout of a GRPO group lands in one partition, where one
    batcher instance sees the whole group.
    """

    avro_name: ClassVar[str] = "agl.TripletRecord"

    rollout_id: str
    attempt_id: str
    group_id: str
    resources_id: str | None = None
    policy_version: int | None = None
    triplets: list[Triplet] = Field(default_factory=list)
    final_reward: float | None = None
    finish_time: float
    # The rollout's mode: the batcher refuses val and test records (never trained on). None for
    # rollouts enqueued without a mode and for records written before the field existed.
    mode: RolloutMode | None = None


class TripletBatch(AglModel):
    """A training batch (topic agl.triplet-batches, key batch_id)."""

    avro_name: ClassVar[str] = "agl.TripletBatch"

    batch_id: str
    records: list[TripletRecord] = Field(default_factory=list)
    created_time: float
    min_policy_version: int | None = None
    max_policy_version: int | None = None
    n_tokens: int = 0
    # What the batcher decided, and its restart journal (agl_stream/domain/batching.py).
    sequence: int = 0
    source_partition: int | None = None
    input_offsets: list[int] = Field(default_factory=list)
    input_position: int = 0
    newest_policy_version: int | None = None
    group_size: int | None = None
    incomplete_groups: int = 0
    # Records behind newest_policy_version (off-policy, corrected by the trainer), and the
    # histogram of how far behind: staleness_counts[k] = records k versions behind.
    kept_stale: int = 0
    staleness_counts: list[int] = Field(default_factory=list)
    dropped_stale: int = 0
    dropped_incomplete: int = 0
    dropped_duplicate: int = 0
    dropped_eval: int = 0
    dropped_offsets: list[int] = Field(default_factory=list)


class TrainerStep(AglModel):
    """One training step (topic agl.trainer-metrics, key batch_id); see ``schemas/TrainerStep.avsc``."""

    avro_name: ClassVar[str] = "agl.TrainerStep"

    batch_id: str
    model: str
    policy_version: int
    step_time: float
    step_seconds: float
    idle_seconds: float
    tokens: int
    samples: int
    min_policy_version: int | None = None
    staleness: float | None = None
    metrics: dict[str, float] = Field(default_factory=dict)

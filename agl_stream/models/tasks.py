"""Task requests from external systems."""

from __future__ import annotations

from typing import ClassVar

from agl_stream.models.base import AglModel, EpochSeconds, JsonObject, JsonValue, RolloutMode
from agl_stream.models.rollouts import RolloutConfig


class TaskRequest(AglModel):
    """A task from an external system (topic agl.task-requests): the public contract.

    See ``schemas/TaskRequest.avsc`` for the meaning of every field.
    """

    avro_name: ClassVar[str] = "agl.TaskRequest"

    request_id: str
    input: JsonValue
    mode: RolloutMode | None = None
    resources_id: str | None = None
    config: RolloutConfig | None = None
    metadata: JsonObject | None = None
    request_time: EpochSeconds | None = None

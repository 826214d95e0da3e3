"""Dead letters: input that could not be processed, kept with the reason (topic agl.dlq)."""

from __future__ import annotations

from typing import ClassVar

from agl_stream.models.base import AglModel, Int32


class DlqRecord(AglModel):
    """The original bytes of a rejected message, where they came from and why."""

    avro_name: ClassVar[str] = "agl.DlqRecord"

    source_topic: str
    source_partition: Int32
    source_offset: int
    key: bytes | None = None
    value: bytes
    reason: str
    error_type: str
    processor: str
    time: float
    value_size: int = -1
    value_sha256: str = ""

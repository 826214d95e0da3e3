"""A Reply encoded from bytes the processor already has (pure).

Most answers carry the state the processor just wrote to ``agl.rollout-state``; encoding that
state again inside each Reply was the processor's largest cost per event. A Reply's Avro body
is its fields in schema order, and its ``state`` (a ``["null", RolloutState]`` union) is the
branch index followed by the state's own body, so the state's encoded body is spliced in as it
is. ``tests/unit/test_reply_wire.py`` checks the result byte for byte against the codec.
"""

from __future__ import annotations

from collections.abc import Sequence

from agl_stream.models.replies import ReplyOutcome
from agl_stream.wire.avro_primitives import avro_string, zigzag
from agl_stream.wire.codec import HEADER_SIZE, Codec

__all__ = ["ReplyEncoder"]

_OUTCOMES: tuple[ReplyOutcome, ...] = ("applied", "rejected", "empty", "unknown", "notice")


class ReplyEncoder:
    """Encodes Reply records with a state body given as bytes."""

    def __init__(self, codec: Codec) -> None:
        self.header = codec.contract.current["agl.Reply"].header
        schema = codec.contract.current["agl.Reply"].expanded
        fields = [f["name"] for f in schema["fields"]]
        expected = [
            "request_id",
            "outcome",
            "state",
            "error",
            "state_partition",
            "state_offset",
            "covered_partitions",
        ]
        if fields != expected:  # the layout below is this schema's
            raise RuntimeError(f"agl.Reply fields changed ({fields}): update {__name__}")
        symbols = schema["fields"][1]["type"]["symbols"]
        if tuple(symbols) != _OUTCOMES:
            raise RuntimeError(f"agl.ReplyOutcome symbols changed ({symbols}): update {__name__}")

    @staticmethod
    def state_body(encoded_state: bytes) -> bytes:
        """The Avro body of an encoded RolloutState message (without its single-object header)."""
        return encoded_state[HEADER_SIZE:]

    def encode(
        self,
        request_id: str,
        outcome: ReplyOutcome,
        *,
        state_body: bytes | None = None,
        error: str | None = None,
        state_partition: int = -1,
        state_offset: int = -1,
        covered_partitions: Sequence[int] = (),
    ) -> bytes:
        parts = [self.header, avro_string(request_id), zigzag(_OUTCOMES.index(outcome))]
        parts.append(b"\x00" if state_body is None else b"\x02" + state_body)
        parts.append(b"\x00" if error is None else b"\x02" + avro_string(error))
        parts += [zigzag(state_partition), zigzag(state_offset)]
        if covered_partitions:
            parts.append(zigzag(len(covered_partitions)))
            parts += [zigzag(p) for p in covered_partitions]
        parts.append(b"\x00")
        return b"".join(parts)

"""Replies encoded from bytes the processor already has, and read back (pure).

Most answers carry the state the processor just wrote to ``agl.rollout-state``; encoding that
state again inside each Reply was the processor's largest cost per event. A Reply's Avro body
is its fields in schema order, and its ``state`` (a ``["null", RolloutState]`` union) is the
branch index followed by the state's own body, so the state's encoded body is spliced in as it
is. Several answers to one writer go out as one ``agl.ReplyBatch``, whose body is an Avro array
of those Reply bodies (one block: the count, the bodies, then the end marker).
``tests/unit/test_reply_wire.py`` checks the results byte for byte against the codec.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import ValidationError

from agl_stream.errors import MalformedRecordError, RecordTypeError
from agl_stream.models.replies import Reply, ReplyBatch, ReplyOutcome
from agl_stream.wire.avro_primitives import MAX_RECORD_BYTES, avro_string, zigzag
from agl_stream.wire.codec import HEADER_SIZE, Codec

__all__ = ["ReplyEncoder", "replies_of"]

_OUTCOMES: tuple[ReplyOutcome, ...] = ("applied", "rejected", "empty", "unknown", "notice")


class ReplyEncoder:
    """Encodes Reply records with a state body given as bytes."""

    def __init__(self, codec: Codec) -> None:
        self.header = codec.contract.current["agl.Reply"].header
        self.batch_header = codec.contract.current["agl.ReplyBatch"].header
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

    def records(self, bodies: Sequence[bytes], limit: int = MAX_RECORD_BYTES) -> list[bytes]:
        """Reply bodies (from :meth:`body`) as few records as fit ``limit`` bytes each, in order:
        an ``agl.Reply`` for a body alone, an ``agl.ReplyBatch`` for several."""
        groups: list[list[bytes]] = []
        size = limit
        for body in bodies:
            # 16: the batch's framing beyond its header (the count's varint, the end marker).
            if size + len(body) > limit - len(self.batch_header) - 16:
                groups.append([])
                size = 0
            groups[-1].append(body)
            size += len(body)
        return [
            self.header + group[0]
            if len(group) == 1
            else b"".join((self.batch_header, zigzag(len(group)), *group, b"\x00"))
            for group in groups
        ]

    def body(
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
        """A Reply's Avro body (no single-object header)."""
        parts = [avro_string(request_id), zigzag(_OUTCOMES.index(outcome))]
        parts.append(b"\x00" if state_body is None else b"\x02" + state_body)
        parts.append(b"\x00" if error is None else b"\x02" + avro_string(error))
        parts += [zigzag(state_partition), zigzag(state_offset)]
        if covered_partitions:
            parts.append(zigzag(len(covered_partitions)))
            parts += [zigzag(p) for p in covered_partitions]
        parts.append(b"\x00")
        return b"".join(parts)


def replies_of(codec: Codec, data: bytes) -> list[Reply]:
    """The answers in one reply-topic record, an ``agl.Reply`` or an ``agl.ReplyBatch``, in order.

    Raises CodecError (RecordTypeError for a record of another type) like the codec does.
    """
    name, datum = codec.decode_dict(data)
    try:
        if name == ReplyBatch.avro_name:
            return ReplyBatch.model_validate(datum).replies
        if name == Reply.avro_name:
            return [Reply.model_validate(datum)]
    except ValidationError as exc:
        raise MalformedRecordError(f"{name} does not validate: {exc}") from exc
    raise RecordTypeError(f"expected an {Reply.avro_name} or an {ReplyBatch.avro_name}, got a {name}")

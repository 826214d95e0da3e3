"""Avro's primitive framing, written by hand where encoding a whole record through fastavro would
cost more than the bytes themselves (reply records, span batches, the sinks' containers), and
the size every record the pipeline writes stays under. Pure functions, no I/O.
"""

from __future__ import annotations

__all__ = ["MAX_RECORD_BYTES", "avro_bytes", "avro_string", "zigzag"]

MAX_RECORD_BYTES = 1_000_000
"""The largest record value agl-stream writes to a topic (an event, a task, a span batch):
under Kafka's default ``max.message.bytes`` (1 MiB, 1,048,588 with overhead) and the producer's
``max_request_size``, so no broker or client limit is hit whatever a topic's own setting. Writers
refuse (or, for span batches, split at) this size; the processors refuse records over it."""

_SMALL = tuple(bytes([n << 1]) for n in range(64))  # zig-zag of 0..63: one byte


def zigzag(value: int) -> bytes:
    """Avro's variable-length zig-zag encoding of an int or long."""
    if 0 <= value < 64:
        return _SMALL[value]
    n = (value << 1) ^ (value >> 63)
    out = bytearray()
    while n & ~0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def avro_bytes(data: bytes) -> bytes:
    """Avro ``bytes``: the length, then the data."""
    return zigzag(len(data)) + data


def avro_string(text: str) -> bytes:
    """Avro ``string``: the UTF-8 length, then the UTF-8 bytes."""
    return avro_bytes(text.encode())

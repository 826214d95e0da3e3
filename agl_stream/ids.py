"""Identifiers, in the seed's shapes: users grep logs and tables for them.

Rollout ids are ``ro-`` + 12 hex characters when the store client makes them (random, the
seed's shape) and ``ro-`` + 32 hex when the ingress derives them from a request id (128 bits of
SHA-256, agl_stream.domain.ingress.rollout_id_for; the first version kept 12, and rollouts made
then keep those ids). Both shapes are rollout ids everywhere. Attempt ids are ``at-`` + 8,
resources ids ``rs-`` + 12, random. Writers generate ids themselves, so a write needs no round trip.
"""

from __future__ import annotations

import os
import re

ROLLOUT_ID_RE = re.compile(r"ro-(?:[0-9a-f]{12}|[0-9a-f]{32})")


def new_rollout_id() -> str:
    """``ro-`` + 12 random hex characters."""
    return "ro-" + os.urandom(6).hex()


def new_attempt_id() -> str:
    """``at-`` + 8 random hex characters (unique within a rollout is what matters)."""
    return "at-" + os.urandom(4).hex()


def new_resources_id() -> str:
    """``rs-`` + 12 random hex characters."""
    return "rs-" + os.urandom(6).hex()


def new_event_id() -> str:
    """A random (version 4) UUID in its canonical text form (``RolloutEvent.event_id``).

    What ``str(uuid.uuid4())`` gives, without building a UUID object (a third of the cost of
    making an event in ``enqueue_many_rollouts``, measured in the client's profile).
    """
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC 4122 variant
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def is_rollout_id(value: str) -> bool:
    """Whether ``value`` has the shape of a generated rollout id (12 or 32 hex after ``ro-``)."""
    return ROLLOUT_ID_RE.fullmatch(value) is not None

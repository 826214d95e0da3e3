"""Identifiers, in the seed's shapes: users grep logs and tables for them.

Rollout ids are ``ro-`` + 12 hex characters when the store client makes them (random, the
seed's shape) and ``ro-`` + 32 hex when the ingress derives them from a request id (128 bits of
SHA-256, agl_stream.domain.ingress.rollout_id_for; the first version kept 12, and rollouts made
then keep those ids). Both shapes are rollout ids everywhere. Attempt ids are ``at-`` + 8,
resources ids ``rs-`` + 12, random. Writers generate ids themselves, so a write needs no round trip.
"""

from __future__ import annotations

import re
import secrets
import uuid

ROLLOUT_ID_RE = re.compile(r"ro-(?:[0-9a-f]{12}|[0-9a-f]{32})")


def new_rollout_id() -> str:
    """``ro-`` + 12 random hex characters."""
    return "ro-" + secrets.token_hex(6)


def new_attempt_id() -> str:
    """``at-`` + 8 random hex characters (unique within a rollout is what matters)."""
    return "at-" + secrets.token_hex(4)


def new_resources_id() -> str:
    """``rs-`` + 12 random hex characters."""
    return "rs-" + secrets.token_hex(6)


def new_event_id() -> str:
    """A random UUID in its canonical text form (``RolloutEvent.event_id``)."""
    return str(uuid.uuid4())


def is_rollout_id(value: str) -> bool:
    """Whether ``value`` has the shape of a generated rollout id (12 or 32 hex after ``ro-``)."""
    return ROLLOUT_ID_RE.fullmatch(value) is not None

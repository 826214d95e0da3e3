"""Generated ids have the seed's shapes; event ids are canonical version-4 UUIDs."""

from __future__ import annotations

import re
import uuid

from agl_stream.ids import is_rollout_id, new_attempt_id, new_event_id, new_resources_id, new_rollout_id


def test_event_ids_are_canonical_random_uuids() -> None:
    ids = [new_event_id() for _ in range(2000)]
    for text in ids:
        parsed = uuid.UUID(text)
        assert parsed.version == 4 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == text  # canonical: lower case, dashes in place
    assert len(set(ids)) == len(ids)
    # Every random bit varies (none stuck at 0 or 1 outside the version and variant bits).
    ones = 0
    zeros = 0
    for text in ids:
        value = uuid.UUID(text).int
        ones |= value
        zeros |= ~value
    fixed = (0xF << 76) | (0x3 << 62)  # version nibble and variant bits
    assert (ones | fixed) == (1 << 128) - 1 and (zeros | fixed) & ((1 << 128) - 1) == (1 << 128) - 1


def test_rollout_attempt_and_resources_ids_have_the_seeds_shapes() -> None:
    rollouts = {new_rollout_id() for _ in range(1000)}
    assert len(rollouts) == 1000 and all(is_rollout_id(r) and len(r) == 15 for r in rollouts)
    assert all(re.fullmatch(r"at-[0-9a-f]{8}", new_attempt_id()) for _ in range(100))
    assert all(re.fullmatch(r"rs-[0-9a-f]{12}", new_resources_id()) for _ in range(100))

"""Span sequence ids for the proxy's calls: one reserved block per attempt, numbered inside it in
the order calls arrive; unknown attempts remembered as such."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from agl_stream.logs import get_logger
from agl_stream.store.client import AglStore

log = get_logger("agl.llm_proxy")

# -- sequence ids -----------------------------------------------------------------------------


@dataclass
class _Block:
    next: int = 0
    end: int = 0
    unknown: str | None = None  # the processor's reason when the attempt is unknown
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SequenceBlocks:
    """Sequence ids for the proxy's spans, reserved a block per attempt at a time.

    ``reserve(rollout_id, attempt_id, count)`` is ``AglStore.reserve_span_sequence_ids``. Blocks
    live in an LRU of ``capacity`` attempts; a forgotten attempt that calls again gets a new block
    (the ids left in the old one stay unused, which is harmless). An attempt the store refused
    (ValueError) is remembered as unknown, so its later calls cost no round trip.
    """

    def __init__(
        self, reserve: Callable[[str, str, int], Awaitable[int]], *, block: int = 256, capacity: int = 10_000
    ) -> None:
        if block < 1 or capacity < 1:
            raise ValueError("block and capacity must be at least 1")
        self._reserve = reserve
        self.block = block
        self.capacity = capacity
        self._blocks: OrderedDict[tuple[str, str], _Block] = OrderedDict()
        self.reservations = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def _entry(self, key: tuple[str, str]) -> _Block:
        entry = self._blocks.get(key)
        if entry is None:
            entry = self._blocks[key] = _Block()
            while len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(key)
        return entry

    async def next_id(self, rollout_id: str, attempt_id: str) -> int | None:
        """The attempt's next sequence id; None when the store does not know the attempt.

        Other store failures (processor unreachable) raise and leave nothing cached.
        """
        entry = self._entry((rollout_id, attempt_id))
        if entry.next >= entry.end and entry.unknown is None:
            async with entry.lock:  # one reservation at a time per attempt; the others wait for it
                if entry.next >= entry.end and entry.unknown is None:
                    try:
                        first = await self._reserve(rollout_id, attempt_id, self.block)
                    except ValueError as error:
                        entry.unknown = str(error)
                        log.warning(
                            "LLM calls of an unknown rollout or attempt are answered but not recorded",
                            rollout_id=rollout_id,
                            attempt_id=attempt_id,
                            reason=str(error),
                        )
                    else:
                        self.reservations += 1
                        entry.next, entry.end = first, first + self.block
        if entry.unknown is not None:
            return None
        sequence_id = entry.next
        entry.next += 1
        return sequence_id


class SpanStore(AglStore):
    """The proxy's store client: it only writes, so it needs no read side (no gateway)."""

    async def _start_reads(self) -> None:
        return None

"""When to cut a batch of spans: a pure decision, so it is tested without threads, clocks or I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cut:
    """Export the ``count`` oldest queued spans now."""

    count: int


@dataclass(frozen=True)
class Wait:
    """Nothing to cut yet: wait to be woken, or at most ``seconds`` (None: until woken)."""

    seconds: float | None


@dataclass(frozen=True)
class ExportPolicy:
    """A batch is cut when it is full, when its oldest span has waited ``flush_interval_s``, or at once
    while an attempt waits for its spans to be flushed."""

    batch_size: int = 512
    flush_interval_s: float = 0.1

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        if self.flush_interval_s < 0:
            raise ValueError("flush_interval_s must not be negative")

    def decide(self, queued: int, oldest_age_s: float, *, flushing: bool) -> Cut | Wait:
        """``queued`` spans wait, the oldest for ``oldest_age_s``; ``flushing``: someone awaits a flush."""
        if queued <= 0:
            return Wait(None)
        if queued >= self.batch_size or flushing or oldest_age_s >= self.flush_interval_s:
            return Cut(min(queued, self.batch_size))
        return Wait(self.flush_interval_s - oldest_age_s)

    def wakes(self, queued: int) -> bool:
        """Whether the span that made the queue ``queued`` long must wake the exporter.

        Only transitions matter: an idle exporter must learn that there is work, and one waiting
        out the interval that a batch is full. Waking it for every span would cost a cross-thread
        call each (the loop's self-pipe) for nothing.
        """
        return queued == 1 or queued == self.batch_size

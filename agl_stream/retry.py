"""Waiting before trying again: one backoff policy for every retry in agl-stream, one loop.

The runner sends an attempt's outcome, gives an attempt back and the tracer exports spans
through :func:`retrying`, so they all outlast the same failover and log the same lines. Loops
that never give up (a runner's claims, a processor starting over, a sink's INSERT, the
supervisor restarting a role, a read waiting for its gateway) wait :meth:`Backoff.after` their
failures in a row. Every wait is jittered (1 to 1 + ``jitter`` times its base, at random), so
clients that failed together (runners after a broker came back) do not all come back at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from agl_stream.logs import describe, get_logger

log = get_logger("agl.retry")

T = TypeVar("T")


@dataclass(frozen=True)
class Backoff:
    """``tries`` calls at most; between them a wait that starts at ``first_s`` and doubles up to
    ``max_s``, each stretched by up to ``jitter`` of itself at random (never shortened, so a
    policy sized to outlast an outage still does)."""

    tries: int = 6
    first_s: float = 1.0
    max_s: float = 15.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.tries < 1:
            raise ValueError("tries must be at least 1")
        if self.first_s < 0 or self.max_s < self.first_s:
            raise ValueError("need 0 <= first_s <= max_s")
        if self.jitter < 0:
            raise ValueError("jitter must be 0 or more")

    def delays(self) -> list[float]:
        """The waits between the tries (one fewer than ``tries``)."""
        return [self.after(n + 1) for n in range(self.tries - 1)]

    def base(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row (1, 2, ...) before its jitter: doubling,
        capped at ``max_s``."""
        return float(min(self.first_s * 2 ** min(max(failures - 1, 0), 32), self.max_s))

    def after(self, failures: int) -> float:
        """The wait after ``failures`` failures in a row, for a loop that never gives up (a
        runner's claims): :meth:`base` stretched by its jitter."""
        return self.base(failures) * (1.0 + self.jitter * random.random())


FAILOVER = Backoff()
"""Outlasts a broker's failover: 6 tries, at least 1+2+4+8+15 = 30 s of waits between them
(plus what each try takes itself)."""

RESTART = Backoff(first_s=0.5, max_s=30.0)
"""Starting again after a failure of a whole part: the supervisor restarting a role, a processor
rebuilding its partitions, a sink's INSERT or the batcher's send into an engine or broker that is
down (0.5 s doubling to 30 s)."""

REREAD = Backoff(first_s=0.1, max_s=2.0)
"""A read asking again for a gateway that does not answer (restarting): 0.1 s doubling to 2 s."""

ONCE = Backoff(tries=1)
"""One try: for a caller that may not wait (a runner shutting down)."""


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff,
    what: str,
    final: tuple[type[BaseException], ...] = (),
    **context: Any,
) -> T:
    """``await call()`` until it returns, at most ``backoff.tries`` times.

    An exception of a ``final`` type (a refusal: asking again cannot help) is raised at once;
    any other is logged (``what`` failed, with ``context``, the error's type and message) and
    the call is made again after the next backoff delay; the last try's exception is raised.
    Cancellation is never retried.
    """
    delays = backoff.delays()
    for attempt in range(backoff.tries):
        try:
            return await call()
        except asyncio.CancelledError:
            raise
        except Exception as error:
            if isinstance(error, final) or attempt == len(delays):
                raise
            delay = delays[attempt]
            log.warning(
                f"{what} failed; trying again",
                error=describe(error),
                retry_in_s=delay,
                tries_left=backoff.tries - attempt - 1,
                **context,
            )
            await asyncio.sleep(delay)  # backoff while the cluster recovers, not synchronisation
    raise AssertionError("unreachable")  # the last try returned or raised

"""A client started in the background on start-up and again on demand after a failed start.

The gateway's store client (OTLP receiver) and its task producer both need this: a broker that
is down must not stop the gateway from serving reads, and the first request after the broker
comes back must find a working client.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class BackgroundClient(Generic[T]):
    """``start()`` begins ``open()`` in a task; ``get()`` waits for it (restarting a failed one);
    ``close()`` cancels a start in flight or closes what it opened. ``unavailable(message)`` is the
    error ``get()`` raises when the client is not started or cannot start."""

    def __init__(
        self,
        name: str,
        open: Callable[[], Awaitable[T]],
        close: Callable[[T], Awaitable[None]],
        unavailable: Callable[[str], Exception],
    ) -> None:
        self.name = name
        self._open = open
        self._close = close
        self._unavailable = unavailable
        self._starting: asyncio.Task[T] | None = None

    def start(self) -> None:
        self._starting = self._task()

    def _task(self) -> asyncio.Task[T]:
        task = asyncio.create_task(self._run_open(), name=self.name)
        # open() logs its failure; retrieving it here keeps asyncio from reporting it again at exit.
        task.add_done_callback(lambda done: done.cancelled() or done.exception())
        return task

    async def _run_open(self) -> T:
        return await self._open()

    async def get(self, what: str) -> T:
        """The client; ``what`` completes the message of the error when it cannot start."""
        if self._starting is None:
            raise self._unavailable(f"the {self.name} is still starting")
        if self._starting.done() and (self._starting.cancelled() or self._starting.exception() is not None):
            self._starting = self._task()
        try:
            # shield: one caller giving up must not cancel the start the others wait for.
            return await asyncio.shield(self._starting)
        except Exception as error:
            reason = f"{what} ({type(error).__name__}: {error}); is the broker up (`agl-stream status`)?"
            raise self._unavailable(reason) from error

    async def close(self) -> None:
        if self._starting is None:
            return
        starting, self._starting = self._starting, None
        if not starting.done():
            starting.cancel()
        try:
            client = await starting
        except BaseException:  # it never started, so there is nothing to close
            return
        await self._close(client)

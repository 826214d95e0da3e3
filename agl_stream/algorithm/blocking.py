"""A blocking facade of the async store, for synchronous algorithms.

Concurrency model: the store lives on the run's event loop; a synchronous algorithm runs in a
worker thread and calls the facade, which submits each coroutine to that loop and waits for its
result. Calling it from the loop's own thread would wait on itself forever, so that is refused.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any


class BlockingStore:
    """``store.enqueue_rollout(...)`` returns the rollout instead of a coroutine; every other
    attribute of the wrapped store is passed through as it is."""

    def __init__(self, store: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._store = store
        self._loop = loop

    @property
    def wrapped(self) -> Any:
        """The async store behind the facade."""
        return self._store

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._store, name)
        if not inspect.iscoroutinefunction(value):
            return value
        return self._blocking(value)

    def _blocking(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self._loop:
                raise RuntimeError(
                    f"BlockingStore.{method.__name__} called on the store's own event loop: await the async store"
                )
            return asyncio.run_coroutine_threadsafe(method(*args, **kwargs), self._loop).result()

        call.__name__ = method.__name__
        call.__doc__ = method.__doc__
        return call

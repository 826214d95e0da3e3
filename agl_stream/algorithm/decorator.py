"""``@algo``: an algorithm written as a plain (sync or async) function over the store.

The function declares what it wants by keyword parameter name, as in the seed:
``store``, ``train_dataset``, ``val_dataset``, ``llm_proxy``, ``adapter``,
``initial_resources``. Only the parameters it declares are passed.

Stateless beyond the wrapped function (the components are the base class's).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from agl_stream.algorithm.base import Algorithm
from agl_stream.errors import AlgorithmError

INJECTED = ("store", "train_dataset", "val_dataset", "llm_proxy", "adapter", "initial_resources")
"""Parameter names an ``@algo`` function may declare, each filled from its run."""

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class FunctionalAlgorithm(Algorithm):
    """An :class:`Algorithm` made of one function by :func:`algo`."""

    __name__: str  # the function's, as its other attributes (functools.update_wrapper)

    def __init__(self, func: Callable[..., Any]) -> None:
        if not callable(func):
            raise AlgorithmError(f"@algo decorates a function, not a {type(func).__name__}")
        self.func = func
        self._parameters = inspect.signature(func).parameters
        unknown = [
            name
            for name, parameter in self._parameters.items()
            if name not in INJECTED and parameter.kind not in _VARIADIC and parameter.default is inspect.Parameter.empty
        ]
        if unknown:
            raise AlgorithmError(
                f"@algo {getattr(func, '__qualname__', func)!r}: parameter(s) {unknown} cannot be filled; "
                f"an algorithm function takes any of {list(INJECTED)} by name"
            )
        self._async = inspect.iscoroutinefunction(func)
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def is_async(self) -> bool:
        return self._async

    def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> Any:
        """Call the function with the components it declares (awaitable when it is async).

        AlgorithmError when a dataset is given that the function takes no parameter for: the
        data would silently not run.
        """
        for name, value in (("train_dataset", train_dataset), ("val_dataset", val_dataset)):
            if value is not None and name not in self._parameters:
                raise AlgorithmError(
                    f"{name} was given but algorithm {getattr(self.func, '__qualname__', self.func)!r} "
                    f"takes no {name} parameter"
                )
        available: dict[str, Callable[[], Any]] = {
            "store": self.get_store,
            "adapter": self.get_adapter,
            "llm_proxy": self.get_llm_proxy,
            "initial_resources": self.get_initial_resources,
            "train_dataset": lambda: train_dataset,
            "val_dataset": lambda: val_dataset,
        }
        arguments = {name: get() for name, get in available.items() if name in self._parameters}
        return self.func(**arguments)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calling the decorated name calls the function itself, as in the seed."""
        return self.func(*args, **kwargs)


def algo(func: Callable[..., Any]) -> FunctionalAlgorithm:
    """Make an algorithm of a function over the store.

    >>> @algo
    ... async def run_once(*, store, train_dataset):
    ...     made = await store.enqueue_many_rollouts([{"input": t, "mode": "train"} for t in train_dataset])
    ...     await store.wait_for_rollouts(rollout_ids=[r.rollout_id for r in made])
    """
    return FunctionalAlgorithm(func)

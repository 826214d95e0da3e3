"""The algorithm base: what an algorithm is given, and how a Trainer run drives it.

Concurrency model: an algorithm instance serves one Trainer run at a time. The run sets its
components (store, adapter, initial resources, LLM proxy, the trainer) before calling ``run``;
an async ``run`` is awaited on the run's event loop, a synchronous one runs in a worker thread
with a blocking facade of the store (:class:`agl_stream.algorithm.blocking.BlockingStore`).

As in the seed, an algorithm is the strategy: it decides which rollouts to enqueue (with which
resources, in which mode), waits for them through the store and learns from what they produced
(rewards and spans through the store's reads, SQL on the read side). The runners, the store's
roles and whatever processes the algorithm asks for (:meth:`Algorithm.roles`) are the
Trainer's to start and stop: an algorithm never manages processes itself, so a streaming
algorithm (VERL/GRPO over the triplet builder, batcher and trainer roles) is the same shape as
a loop over the store.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from agl_stream.config import Settings
from agl_stream.domain.adapter import AdapterConfig
from agl_stream.errors import AglError

RunnerResources = Literal["pinned", "latest"]
"""How runners pick the resources of an attempt (``agl-stream runner --resources``)."""


class MissingComponentError(AglError, ValueError):
    """An algorithm asked for a component (store, trainer, adapter) its run has not set."""


class TrainerLike(Protocol):
    """What an algorithm may rely on from the trainer that drives it."""

    n_runners: int


@dataclass(frozen=True)
class RoleSpec:
    """A process an algorithm needs beside the store and the runners: ``agl-stream <args>``.

    The Trainer starts each before the runners (in the order given), waits for ``health_url``
    to answer 200 when one is named, and stops them all when the run ends. A VERL-style
    algorithm names the triplet builder, batcher, trainer, inference server and LLM proxy here.
    """

    name: str  # its log file: <data dir>/logs/trainer-<run id>/<name>.log
    args: tuple[str, ...]
    health_url: str | None = None


class Algorithm:
    """Base class of algorithms: override :meth:`run` (sync or async).

    ``run(train_dataset, val_dataset)`` gets the loaded datasets (lists of JSON-able tasks, or
    None); the store, adapter, initial resources and LLM proxy come from the getters.
    """

    runner_resources: RunnerResources = "pinned"
    """"pinned": each rollout runs with the resources it was enqueued with (the seed's runner);
    "latest": with the newest resources at claim time (streaming RL on fresh policies)."""

    _trainer_ref: weakref.ReferenceType[Any] | None = None
    _store: Any = None
    _adapter: AdapterConfig | None = None
    _initial_resources: Mapping[str, Any] | None = None
    _llm_proxy: str | None = None

    def is_async(self) -> bool:
        """Whether :meth:`run` is a coroutine function (awaited; otherwise run in a thread)."""
        return inspect.iscoroutinefunction(self.run)

    # -- components the Trainer sets ------------------------------------------------------------

    def set_trainer(self, trainer: TrainerLike) -> None:
        # A weak reference, as in the seed: the trainer owns the algorithm, not the other way.
        self._trainer_ref = weakref.ref(trainer)

    def get_trainer(self) -> TrainerLike:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            raise MissingComponentError("no trainer drives this algorithm (or it is gone); use Trainer.fit")
        return trainer

    def set_store(self, store: Any) -> None:
        """The store of the run: an ``AglStore`` (async ``run``) or its ``BlockingStore`` (sync ``run``)."""
        self._store = store

    def get_store(self) -> Any:
        if self._store is None:
            raise MissingComponentError("no store has been set for this algorithm; use Trainer.fit")
        return self._store

    def set_adapter(self, adapter: AdapterConfig) -> None:
        """The trace adapter's settings (the seed's ``TracerTraceToTriplet`` options)."""
        self._adapter = adapter

    def get_adapter(self) -> AdapterConfig:
        if self._adapter is None:
            raise MissingComponentError("no adapter has been set for this algorithm")
        return self._adapter

    def set_initial_resources(self, resources: Mapping[str, Any]) -> None:
        self._initial_resources = resources

    def get_initial_resources(self) -> Mapping[str, Any] | None:
        return self._initial_resources

    def set_llm_proxy(self, llm_proxy: str | None) -> None:
        """The base URL of an ``agl-stream llm-proxy`` the algorithm may publish as a ProxyLLM."""
        self._llm_proxy = llm_proxy

    def get_llm_proxy(self) -> str | None:
        return self._llm_proxy

    # -- what the algorithm does --------------------------------------------------------------

    def roles(self, settings: Settings) -> Sequence[RoleSpec]:
        """Processes this algorithm needs beside the store and the runners (default: none)."""
        return ()

    def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> Any:
        """Run the algorithm over the datasets; returns None (or an awaitable of None when async)."""
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


class FastAlgorithm(Algorithm):
    """An algorithm for quick developer loops (``Trainer.dev`` accepts only these): it trains
    nothing heavy and finishes when the datasets have run."""

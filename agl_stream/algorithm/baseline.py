"""``Baseline``: run the datasets through the agent, report the rewards, train nothing.

The seed's Baseline is a smoke test of the plumbing; this one is also the number to beat: each
epoch enqueues the training tasks (mode ``train``) and then the validation tasks (mode ``val``),
waits for them with the store's ``wait_for_rollouts`` (notified, not polled), and at the end
reads the mean reward per mode of its rollouts with SQL (:mod:`agl_stream.algorithm.report`).

Concurrency model: one ``run`` at a time per instance, on the run's event loop; ``report`` is
replaced when a run ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from agl_stream.algorithm.base import FastAlgorithm
from agl_stream.algorithm.datasets import epoch_orders
from agl_stream.algorithm.report import ModeReport, rewards_by_mode
from agl_stream.errors import DatasetError
from agl_stream.logs import get_logger

log = get_logger("agl.algorithm.baseline")

ENQUEUE_CHUNK = 256
"""Rollouts per enqueue call when nothing bounds them (one produce batch, one wait for folds)."""


class Baseline(FastAlgorithm):
    """Run every task of the datasets ``n_epochs`` times and report the mean reward per mode.

    Args:
        n_epochs: passes over the datasets (train, then val, in each).
        shuffle: a new order of each dataset in every epoch, from ``seed``.
        seed: the shuffling seed (the same seed, the same orders).
        max_in_flight: most rollouts enqueued and unfinished at once (None: a whole epoch at
            once); it keeps a long dataset from filling the queue far ahead of the runners.
        timeout: seconds to wait for the rollouts of one batch before giving up on them (None:
            as long as they take; the watchdog ends attempts that exceed their RolloutConfig).
        train_split, polling_interval, span_verbosity: the seed's Baseline arguments, accepted
            so its code runs; unused here (the datasets come split, waits are notified, spans
            are in ClickHouse: ``agl-stream sql``).

    After ``run``, ``report`` holds the per-mode result (:class:`ModeReport` by mode).
    """

    def __init__(
        self,
        *,
        n_epochs: int = 1,
        shuffle: bool = False,
        seed: int | None = 0,
        max_in_flight: int | None = None,
        timeout: float | None = None,
        train_split: float = 0.5,
        polling_interval: float = 5.0,
        span_verbosity: Literal["keys", "key_values", "none"] = "keys",
    ) -> None:
        if n_epochs < 1:
            raise DatasetError(f"n_epochs must be at least 1, got {n_epochs}")
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1 (or None), got {max_in_flight}")
        if not 0.0 < train_split < 1.0:
            raise ValueError("train_split must be between 0 and 1")  # the seed's check, kept for its callers
        self.n_epochs = n_epochs
        self.shuffle = shuffle
        self.seed = seed
        self.max_in_flight = max_in_flight
        self.timeout = timeout
        self.train_split = train_split
        self.polling_interval = polling_interval
        self.span_verbosity = span_verbosity
        self.report: dict[str, ModeReport] = {}
        self.rollout_ids: list[str] = []

    def plan(
        self, train_dataset: Sequence[Any] | None, val_dataset: Sequence[Any] | None
    ) -> list[list[tuple[Literal["train", "val"], Any]]]:
        """The (mode, task) pairs of each epoch, in the order they are enqueued."""
        train = list(train_dataset or [])
        val = list(val_dataset or [])
        if not train and not val:
            raise DatasetError("Baseline needs a train_dataset or a val_dataset with at least one task")
        train_orders = epoch_orders(len(train), epochs=self.n_epochs, shuffle=self.shuffle, seed=self.seed)
        # The validation orders come from a generator of their own, so adding validation data
        # does not change the order of the training data.
        val_seed = None if self.seed is None else self.seed + 1
        val_orders = epoch_orders(len(val), epochs=self.n_epochs, shuffle=self.shuffle, seed=val_seed)
        return [
            [("train", train[i]) for i in train_order] + [("val", val[i]) for i in val_order]
            for train_order, val_order in zip(train_orders, val_orders, strict=True)
        ]

    async def run(self, train_dataset: Sequence[Any] | None = None, val_dataset: Sequence[Any] | None = None) -> None:
        store = self.get_store()
        epochs = self.plan(train_dataset, val_dataset)
        resources_id = None
        initial = self.get_initial_resources()
        if initial is not None:
            # Published once; every rollout of the run names this snapshot (pinned resources).
            resources_id = (await store.add_resources(initial)).resources_id
        self.rollout_ids = []
        for number, epoch in enumerate(epochs, start=1):
            log.info("baseline epoch", epoch=number, of=len(epochs), rollouts=len(epoch))
            self.rollout_ids += await self._run_epoch(store, epoch, resources_id)
        self.report = await rewards_by_mode(store, self.rollout_ids)
        for mode, report in self.report.items():
            log.info(
                "baseline rewards",
                mode=mode or "none",
                rollouts=report.rollouts,
                succeeded=report.succeeded,
                failed=report.failed,
                mean_reward=report.mean_reward,
            )

    async def _run_epoch(
        self, store: Any, epoch: list[tuple[Literal["train", "val"], Any]], resources_id: str | None
    ) -> list[str]:
        """Enqueue in chunks, at most two in flight, so the queue never runs dry while a chunk
        finishes and never holds more than ``max_in_flight``."""
        chunk = max(1, self.max_in_flight // 2) if self.max_in_flight is not None else ENQUEUE_CHUNK
        window = self.max_in_flight if self.max_in_flight is not None else len(epoch)
        made: list[str] = []
        in_flight: list[list[str]] = []
        for start in range(0, len(epoch), chunk):
            while in_flight and sum(map(len, in_flight)) + min(chunk, len(epoch) - start) > window:
                await self._wait(store, in_flight.pop(0))
            part = epoch[start : start + chunk]
            requests = [{"input": task, "mode": mode, "resources_id": resources_id} for mode, task in part]
            ids = [r.rollout_id for r in await store.enqueue_many_rollouts(requests)]
            made += ids
            in_flight.append(ids)
        for ids in in_flight:
            await self._wait(store, ids)
        return made

    async def _wait(self, store: Any, ids: list[str]) -> None:
        finished = await store.wait_for_rollouts(rollout_ids=ids, timeout=self.timeout)
        if len(finished) < len(ids):
            log.warning("rollouts did not finish in time", unfinished=len(ids) - len(finished), timeout=self.timeout)

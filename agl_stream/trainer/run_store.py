"""The store a Trainer run hands its algorithm: an ``AglStore`` that remembers the rollouts it
created, so the run's progress and summary cover exactly those (not other users' rollouts on a
shared cluster, nor an earlier run's).

Concurrency model: as ``AglStore``, one event loop; the id set only grows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agl_stream.config import Settings
from agl_stream.models import Rollout
from agl_stream.store.client import AglStore
from agl_stream.store.types import AttemptedRollout, EnqueueRolloutRequest


class RunStore(AglStore):
    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._run_rollouts: dict[str, None] = {}  # insertion-ordered set

    @property
    def run_rollout_ids(self) -> list[str]:
        """The rollouts this store created, oldest first."""
        return list(self._run_rollouts)

    # Every create goes through these two (enqueue_rollout and start_rollout included).
    async def enqueue_many_rollouts(
        self, requests: Sequence[Mapping[str, Any] | EnqueueRolloutRequest]
    ) -> list[Rollout]:
        rollouts = await super().enqueue_many_rollouts(requests)
        self._run_rollouts.update(dict.fromkeys(r.rollout_id for r in rollouts))
        return rollouts

    async def start_rollouts(
        self, rollouts: Sequence[Rollout], *, attempt_id: str | None = None, worker_id: str | None = None
    ) -> list[AttemptedRollout]:
        started = await super().start_rollouts(rollouts, attempt_id=attempt_id, worker_id=worker_id)
        self._run_rollouts.update(dict.fromkeys(r.rollout_id for r in started))
        return started

"""Rewards per mode of a set of rollouts, from SQL on the read side.

A rollout's reward is the final reward of its latest attempt (the attempt that decided its
status): the primary value (``agentlightning.reward.0.value``) of the reward span with the
highest sequence id in that attempt, as ``find_final_reward`` reads it from the spans. Rewards in
the legacy encodings (AgentOps outputs, a bare ``reward`` attribute) are not counted here.

:func:`rewards_by_mode` reads behind a fence at the end of ``rollout-state`` and ``spans``: a
rollout that a store client saw finish has its state and every span in those topics (runners
flush an attempt's spans before they report it), so the answer counts all of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agl_stream.config import Settings
from agl_stream.kafka.offsets import fence_at_end
from agl_stream.wire.semconv import RewardAttributes, reward_key

REWARD_VALUE_KEY = reward_key(0, RewardAttributes.REWARD_VALUE)
"""The primary reward's attribute: dimension 0 is always the primary one."""

REWARDS_BY_MODE = """
SELECT ifNull(r.mode, '') AS mode,
       count() AS rollouts,
       countIf(r.status = 'succeeded') AS succeeded,
       countIf(r.status = 'failed') AS failed,
       countIf(r.status = 'cancelled') AS cancelled,
       countIf(w.reward IS NOT NULL) AS rewarded,
       avg(w.reward) AS mean_reward
FROM (
    SELECT rollout_id, mode, status FROM {db}.rollouts FINAL WHERE rollout_id IN {{ids:Array(String)}}
) AS r
LEFT JOIN (
    SELECT s.RolloutId AS rollout_id,
           argMax(toFloat64OrNull(s.SpanAttributes[{{reward_key:String}}]), s.SequenceId) AS reward
    FROM {db}.otel_traces AS s FINAL
    INNER JOIN (
        SELECT rollout_id, argMax(attempt_id, sequence_id) AS attempt_id
        FROM {db}.attempts FINAL WHERE rollout_id IN {{ids:Array(String)}} GROUP BY rollout_id
    ) AS latest ON latest.rollout_id = s.RolloutId AND latest.attempt_id = s.AttemptId
    WHERE s.RolloutId IN {{ids:Array(String)}} AND mapContains(s.SpanAttributes, {{reward_key:String}})
    GROUP BY s.RolloutId
) AS w ON w.rollout_id = r.rollout_id
GROUP BY mode
ORDER BY mode
"""


@dataclass(frozen=True)
class ModeReport:
    """The rollouts of one mode: how they ended and their mean reward (None: none had one)."""

    mode: str  # "train", "val", "test", or "" for rollouts enqueued without a mode
    rollouts: int
    succeeded: int
    failed: int
    cancelled: int
    rewarded: int
    mean_reward: float | None

    @property
    def unfinished(self) -> int:
        return self.rollouts - self.succeeded - self.failed - self.cancelled


def rewards_query(settings: Settings, rollout_ids: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """The SQL and its parameters."""
    return REWARDS_BY_MODE.format(db=settings.clickhouse_database), {
        "ids": list(rollout_ids),
        "reward_key": REWARD_VALUE_KEY,
    }


def reports_from_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, ModeReport]:
    """The query's rows, by mode."""
    reports = {}
    for row in rows:
        mean = row["mean_reward"]
        reports[str(row["mode"])] = ModeReport(
            mode=str(row["mode"]),
            rollouts=int(row["rollouts"]),
            succeeded=int(row["succeeded"]),
            failed=int(row["failed"]),
            cancelled=int(row["cancelled"]),
            rewarded=int(row["rewarded"]),
            mean_reward=None if mean is None else float(mean),
        )
    return reports


async def rewards_by_mode(store: Any, rollout_ids: Sequence[str], *, fenced: bool = True) -> dict[str, ModeReport]:
    """Per mode, the rollouts among ``rollout_ids`` and their mean reward (SQL on ``store``'s read side).

    ``fenced``: wait until the read side applied everything written so far to the rollout
    states and spans (see the module docstring); False for a progress display that may lag.
    """
    if not rollout_ids:
        return {}
    side = store.side
    if side is None:
        raise RuntimeError("the store is not started")
    settings: Settings = store.settings
    fence: dict[str, dict[int, int]] | None = None
    if fenced:
        fence = {**await fence_at_end(settings, "rollout-state"), **await fence_at_end(settings, "spans")}
    sql, parameters = rewards_query(settings, rollout_ids)
    result = await side.query(sql, parameters, fence=fence or None, timeout=60.0)
    return reports_from_rows(result.dicts())

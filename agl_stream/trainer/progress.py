"""What a Trainer run shows: a live line (rollouts, reward, policy version) and the summary.

Both read the run's rollouts with SQL on the read side (:mod:`agl_stream.algorithm.report`):
the live line without a fence (it may lag the runners by the sinks' flush interval), the
summary behind one (it counts every rollout the run created).

Concurrency model: :meth:`RunProgress.follow` is one task on the run's event loop and the only
writer of the display; rich redraws it from its own thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table

from agl_stream.algorithm.report import ModeReport, rewards_by_mode
from agl_stream.logs import describe, get_logger
from agl_stream.trainer.run_store import RunStore

log = get_logger("agl.trainer")

REFRESH_S = 2.0
"""Seconds between two reads of the live line: one SQL query each, kept cheap for the gateway."""


@dataclass
class FitResult:
    """What a run did, from SQL on the read side (``modes``) and from the processes it started."""

    run_id: str
    seconds: float
    modes: dict[str, ModeReport]  # by mode ("train", "val", ...): counts and mean reward
    rollout_ids: list[str]
    policy_version: int | None  # of the latest resources when the run ended
    stack_started: bool  # the run started the local stack (and stopped it)
    log_dir: Path
    pids: dict[str, int] = field(default_factory=dict)  # every process the run started, stopped since

    def mean_reward(self, mode: str) -> float | None:
        report = self.modes.get(mode)
        return report.mean_reward if report is not None else None


def _status(modes: dict[str, ModeReport], version: int | None) -> str:
    succeeded = sum(r.succeeded for r in modes.values())
    failed = sum(r.failed for r in modes.values())
    rewards = " ".join(
        f"{mode or 'none'} {report.mean_reward:.3f}" for mode, report in modes.items() if report.mean_reward is not None
    )
    parts = [f"{succeeded} ok, {failed} failed", f"reward {rewards}" if rewards else "no reward yet"]
    parts.append(f"policy v{version}" if version is not None else "no policy version")
    return " | ".join(parts)


class RunProgress:
    """The live line of a run; a no-op when ``enabled`` is False."""

    def __init__(self, console: Console, *, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> RunProgress:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]rollouts"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._progress.start()
            self._task = self._progress.add_task("rollouts", total=0, status="starting runners ...")
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, *, enqueued: int, modes: dict[str, ModeReport], version: int | None) -> None:
        if self._progress is None or self._task is None:
            return
        finished = sum(r.rollouts - r.unfinished for r in modes.values())
        self._progress.update(self._task, total=enqueued, completed=finished, status=_status(modes, version))

    async def follow(self, store: RunStore) -> None:
        """Refresh the line every ``REFRESH_S`` until cancelled; a failed read skips one refresh."""
        if not self.enabled:
            return
        while True:
            ids = store.run_rollout_ids
            try:
                modes = await rewards_by_mode(store, ids, fenced=False) if ids else {}
                latest = await store.get_latest_resources()
            except asyncio.CancelledError:
                raise
            except Exception as error:  # the display must never end a run (a gateway restarting...)
                log.debug("progress read failed", error=describe(error))
            else:
                self.update(
                    enqueued=len(ids), modes=modes, version=latest.policy_version if latest is not None else None
                )
            await asyncio.sleep(REFRESH_S)  # the display's refresh period, not a wait on state


def show_summary(console: Console, result: FitResult) -> None:
    """The run's summary table (from SQL) and where its logs are."""
    table = Table(title=f"run {result.run_id}: rollouts and rewards per mode (SQL on the read side)")
    for column in ("mode", "rollouts", "succeeded", "failed", "cancelled", "with a reward", "mean reward"):
        table.add_column(column, justify="right")
    for mode, report in result.modes.items():
        table.add_row(
            mode or "none",
            str(report.rollouts),
            str(report.succeeded),
            str(report.failed),
            str(report.cancelled),
            str(report.rewarded),
            "-" if report.mean_reward is None else f"{report.mean_reward:.4f}",
        )
    console.print(table)
    version = "none" if result.policy_version is None else str(result.policy_version)
    console.print(
        f"{len(result.rollout_ids)} rollouts in {result.seconds:.1f}s; policy version {version}; "
        f"logs in {result.log_dir}"
    )

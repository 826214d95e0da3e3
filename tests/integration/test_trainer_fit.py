"""``Trainer.fit`` end to end on the session's broker: it starts the store's roles itself (the
broker is given, so no broker), runs the agent in two runner processes, reports the rewards
per mode from SQL, and leaves no process it started behind, also when interrupted (Ctrl-C)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from rich.console import Console

import agl_stream as agl
from agl_stream.config import Settings
from agl_stream.local.processes import role_alive
from tests.integration.agents import scripted
from tests.integration.helpers import REWARD_BY_MODE, clickhouse

pytestmark = pytest.mark.integration

# The scripted agent's reward is i % 2: train mean 0.5 (i = 0..5), val mean 1.0 (odd i only).
TRAIN = [{"kind": "ok", "i": i} for i in range(6)]
VAL = [{"kind": "ok", "i": i} for i in (1, 3)]


def _settings(kafka_bootstrap: str, data_dir: Path) -> Settings:
    return Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=data_dir, topic_prefix=f"f{uuid4().hex[:10]}", gateway_port=0
    )


def _alive(pids: dict[str, int]) -> dict[str, int]:
    return {name: pid for name, pid in pids.items() if role_alive(pid)}


def test_fit_runs_baseline_reports_rewards_from_sql_and_leaves_no_process(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = _settings(kafka_bootstrap, tmp_path)
    trainer = agl.Trainer(algorithm=agl.Baseline(), n_runners=2, settings=settings, console=Console(quiet=True))
    result = trainer.fit(scripted, TRAIN, VAL)

    assert result.stack_started
    assert {mode: (r.rollouts, r.succeeded, r.failed) for mode, r in result.modes.items()} == {
        "train": (6, 6, 0),
        "val": (2, 2, 0),
    }
    assert result.mean_reward("train") == pytest.approx(0.5)
    assert result.mean_reward("val") == pytest.approx(1.0)
    assert len(result.rollout_ids) == 8
    assert isinstance(trainer.algorithm, agl.Baseline) and trainer.algorithm.report == result.modes

    # Every process the run started (two runners, the supervisor and the store's roles) is gone.
    assert {"runner-0", "runner-1", "supervisor", "processor", "gateway"} <= set(result.pids)
    assert _alive(result.pids) == {}

    # The same numbers from ClickHouse, read here after the run (the gateway let go of the engine).
    db = settings.clickhouse_database
    with clickhouse(settings) as client:
        rows = client.query(REWARD_BY_MODE.format(db=db)).result_rows
        workers = {w for (w,) in client.query(f"SELECT DISTINCT worker_id FROM {db}.attempts FINAL").result_rows}
    assert [(mode, count) for mode, count, _ in rows] == [("train", 6), ("val", 2)]
    assert {mode: mean for mode, _, mean in rows} == pytest.approx(
        {mode: result.mean_reward(mode) for mode in ("train", "val")}
    )
    # The runner processes did the work, each under the worker id the run gave it.
    assert workers and workers <= {f"{result.run_id}-runner-0", f"{result.run_id}-runner-1"}


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """SIGINT handled as in a fresh Python process (KeyboardInterrupt, which asyncio.run turns
    into cancelling the run): an earlier test in the same worker process may have left another
    handler installed, under which Ctrl-C never reaches the run."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("python_sigint")
def test_ctrl_c_stops_everything_the_run_started(kafka_bootstrap: str, tmp_path: Path) -> None:
    @agl.algo
    async def interrupted(*, store: Any, train_dataset: Any) -> None:
        made = await store.enqueue_many_rollouts([{"input": task, "mode": "train"} for task in train_dataset])
        await store.wait_for_rollouts(rollout_ids=[made[0].rollout_id])
        # Ctrl-C while rollouts are in flight: SIGINT to this process, as a terminal sends it.
        signal.raise_signal(signal.SIGINT)

    settings = _settings(kafka_bootstrap, tmp_path)
    trainer = agl.Trainer(
        algorithm=interrupted, n_runners=2, settings=settings, runner_grace_s=1.0, console=Console(quiet=True)
    )
    slow = [{"kind": "sleep", "seconds": 30}] * 3 + [{"kind": "ok", "i": 1}]
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(scripted, [{"kind": "ok", "i": 1}, *slow])
    assert {"runner-0", "runner-1", "supervisor", "processor", "gateway"} <= set(trainer.started_pids)
    assert _alive(trainer.started_pids) == {}
    assert trainer.last_result is None

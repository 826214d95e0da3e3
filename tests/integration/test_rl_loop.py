"""The whole RL loop on CPU, every role a real process: the reward rises with the policy versions.

Threshold: the mean reward of the rollouts of the last 3 policy versions exceeds that of the
first 3 by at least 0.1 (``DemoResult.rose``). A random policy scores ~0.15 on the digits task.
The demo's learning rate (0.01) stays near it for ~8 versions, so the test trains at 0.05, as
`agl-stream trainer --lr` allows: measured here, 0.12 at version 0, 0.8 at version 4, 0.98 at
version 8. Means are over rollouts, not versions. The loop stops as soon as the rise shows
over at least 8 rollouts of the last versions, up to 14 versions: on a busy machine a version
may run only a couple of rollouts and a run of six was once not enough (0.15 -> 0.25, with
version 5 at 0.53). The trainer's seed is 0; sampling in the inference server is not seeded.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from uuid import uuid4

import pytest
from rich.console import Console

from agl_stream.config import Settings
from agl_stream.demo import loop

pytestmark = pytest.mark.integration


def test_the_reward_rises_with_the_policy_versions(kafka_bootstrap: str, tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap, data_dir=tmp_path, topic_prefix=f"l{uuid4().hex[:10]}", gateway_port=0
    )
    console = Console(quiet=True)
    with loop.running_loop(settings, console, trainer_options=("--lr", "0.05")) as running:
        result = asyncio.run(loop.drive(running, console, versions=14, minutes=15, until=loop.DemoResult.rose))
    first, last = result.first_and_last()
    assert result.rose(), f"reward did not rise: first {first:.3f}, last {last:.3f}: {result.versions}"
    # Every finished attempt, its rollout, its spans and its triplets carry the policy version
    # they ran with, and every training step is in the trainer_steps table.
    for table in ("spans", "attempts", "rollouts", "triplet_records"):
        with_version, total = result.coverage[table]
        assert total > 0 and with_version == total, (table, result.coverage)
    assert result.coverage["trainer_steps"][0] >= len(result.versions) - 1, result.coverage

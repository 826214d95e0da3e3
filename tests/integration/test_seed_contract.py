"""The store contract side by side: the same sequences against the seed and against agl-stream.

Each sequence below is data (operations with symbolic references, see
``tests/seed_scripts/contract_runner.py``). The seed's python runs all of them once, each on a
fresh ``InMemoryLightningStore`` of Agent Lightning 0.3.0, in one subprocess started before the
stack (its import is slow); each test runs its sequence against the shared stack through
``AglStore`` with the same interpreter, then compares the two lists of observations step by step.

Where the two stores differ on purpose, the step names the difference (``"by_design": KEY``) and
:data:`BY_DESIGN` says why and what agl-stream observes instead; every other difference fails.
Sequences whose outcome depends on timing or on the processor's batching run several rounds.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from agl_stream import AglStore, connect
from agl_stream.config import Settings
from agl_stream.models import LLM, RolloutConfig, Span
from agl_stream.store.types import EnqueueRolloutRequest
from tests.seed_scripts.contract_runner import Observation, run_sequences
from tests.seed_venv import SEED_CHILD_ENV

pytestmark = pytest.mark.integration

RUNNER = Path(__file__).parents[1] / "seed_scripts" / "contract_runner.py"
Op = dict[str, Any]

# -- the sequences ---------------------------------------------------------------------------


def _rounds(count: int, make: Callable[[str], list[Op]]) -> list[Op]:
    """``count`` rounds of one sequence, each with symbols of its own (``r1`` -> ``k0r1``)."""
    return [op for k in range(count) for op in make(f"k{k}")]


def _fifo_round(k: str) -> list[Op]:
    names = [f"{k}r{i}" for i in range(3)]
    return [
        *({"op": "enqueue_rollout", "input": {"round": k, "i": i}, "as": n} for i, n in enumerate(names)),
        *({"op": "dequeue_rollout", "worker": "w1"} for _ in names),
        {"op": "dequeue_rollout", "worker": "w1"},
        *({"op": "update_attempt", "rollout": n, "attempt": "latest", "status": "succeeded"} for n in names),
        *({"op": "get_rollout_by_id", "rollout": n} for n in names),
    ]


def _retry_round(k: str) -> list[Op]:
    r = f"{k}r"
    config = {"max_attempts": 3, "retry_condition": ["failed"]}
    return [
        {"op": "enqueue_rollout", "input": {"retry": k}, "config": config, "as": r},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "update_attempt", "rollout": r, "attempt": "latest", "status": "failed"},
        {"op": "get_rollout_by_id", "rollout": r},
        {"op": "dequeue_rollout", "worker": "w2"},
        {"op": "update_attempt", "rollout": r, "attempt": f"{r}.a2", "status": "failed"},
        {"op": "get_rollout_by_id", "rollout": r},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "update_attempt", "rollout": r, "attempt": "latest", "status": "failed"},
        {"op": "get_rollout_by_id", "rollout": r},
        {"op": "query_attempts", "rollout": r},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "get_worker_by_id", "worker": "w2"},
    ]


def _timeout_round(k: str) -> list[Op]:
    r, once = f"{k}r", f"{k}once"
    return [
        # Timed out with a retry left: requeued by the watchdog, claimable again. The second
        # attempt must outlive the three reads and the update below on a loaded machine.
        {
            "op": "enqueue_rollout",
            "input": {"timeout": k},
            "config": {"timeout_seconds": 2.0, "max_attempts": 2, "retry_condition": ["timeout"]},
            "as": r,
        },
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "dequeue_rollout", "worker": "w2", "within": 15},
        {"op": "query_attempts", "rollout": r, "by_design": "watchdog_end_time"},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "update_attempt", "rollout": r, "attempt": "latest", "status": "succeeded"},
        {"op": "wait_for_rollouts", "rollouts": [r], "timeout": 10},
        # Timed out without retries: failed.
        {"op": "enqueue_rollout", "input": {"timeout once": k}, "config": {"timeout_seconds": 0.3}, "as": once},
        {"op": "dequeue_rollout", "worker": "w3"},
        {"op": "dequeue_rollout", "worker": "w4", "within": 1.0},
        {"op": "wait_for_rollouts", "rollouts": [once], "timeout": 10},
        {"op": "query_attempts", "rollout": once, "by_design": "watchdog_end_time"},
    ]


def _unresponsive_round(k: str) -> list[Op]:
    r = f"{k}r"
    return [
        {
            "op": "enqueue_rollout",
            "input": {"unresponsive": k},
            "config": {"unresponsive_seconds": 3.0, "max_attempts": 2, "retry_condition": ["unresponsive"]},
            "as": r,
        },
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "add_span", "rollout": r, "attempt": f"{r}.a1", "sequence_id": 1},
        {"op": "get_rollout_by_id", "rollout": r},
        {"op": "dequeue_rollout", "worker": "w2", "within": 15},
        {"op": "query_attempts", "rollout": r, "by_design": "watchdog_end_time"},
        {"op": "update_attempt", "rollout": r, "attempt": "latest", "status": "succeeded"},
        {"op": "get_rollout_by_id", "rollout": r},
    ]


SEQUENCES: dict[str, list[Op]] = {
    "fifo_and_read_your_writes": _rounds(6, _fifo_round),
    "enqueue_many_keeps_order": [
        {
            "op": "enqueue_many_rollouts",
            "requests": [
                {"input": {"i": 0}, "mode": "train", "as": "r0"},
                {"input": {"i": 1}, "mode": "val", "metadata": {"m": 1}, "as": "r1"},
                {"input": {"i": 2}, "config": {"max_attempts": 2, "retry_condition": ["failed"]}, "as": "r2"},
            ],
        },
        {"op": "dequeue_rollout"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "get_worker_by_id", "worker": "w1"},
    ],
    "start_rollout_and_start_attempt": [
        {"op": "start_rollout", "input": {"s": 1}, "mode": "train", "metadata": {"a": 1}, "worker": "w1", "as": "r1"},
        {"op": "get_rollout_by_id", "rollout": "r1"},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "query_attempts", "rollout": "r1"},
        {"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status": "failed"},
        {"op": "get_rollout_by_id", "rollout": "r1"},
        {"op": "start_attempt", "rollout": "r1", "worker": "w2", "by_design": "reopened_end_time"},
        {"op": "get_rollout_by_id", "rollout": "r1", "by_design": "reopened_end_time"},
        {"op": "get_latest_attempt", "rollout": "r1"},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "get_worker_by_id", "worker": "w2"},
        {"op": "update_attempt", "rollout": "r1", "attempt": "r1.a2", "status": "succeeded"},
        {"op": "get_rollout_by_id", "rollout": "r1"},
        {"op": "query_attempts", "rollout": "r1"},
        {"op": "start_attempt", "rollout": "ro-000000000bad"},
        {"op": "enqueue_rollout", "input": {"s": 2}, "as": "r2"},
        {"op": "get_latest_attempt", "rollout": "r2"},
        {"op": "start_attempt", "rollout": "r2"},
        {"op": "get_rollout_by_id", "rollout": "r2"},
        {"op": "dequeue_rollout"},
    ],
    "failed_attempts_retry_then_fail": [
        *_rounds(4, _retry_round),
        {"op": "enqueue_rollout", "input": {"no retry": 1}, "config": {"max_attempts": 3}, "as": "n1"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "update_attempt", "rollout": "n1", "attempt": "latest", "status": "failed"},
        {"op": "get_rollout_by_id", "rollout": "n1"},
        {
            "op": "enqueue_rollout",
            "input": {"other condition": 1},
            "config": {"max_attempts": 3, "retry_condition": ["timeout"]},
            "as": "n2",
        },
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "update_attempt", "rollout": "n2", "attempt": "latest", "status": "failed"},
        {"op": "get_rollout_by_id", "rollout": "n2"},
        {"op": "dequeue_rollout", "worker": "w1"},
    ],
    "timeouts_requeue_then_fail": _rounds(3, _timeout_round),
    "unresponsive_attempts_requeue": _rounds(2, _unresponsive_round),
    "a_late_runner_after_its_attempt_was_judged_unresponsive": [
        {"op": "enqueue_rollout", "input": {"late": 1}, "config": {"unresponsive_seconds": 0.3}, "as": "r1"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "dequeue_rollout", "worker": "w2", "within": 1.0},
        {"op": "wait_for_rollouts", "rollouts": ["r1"], "timeout": 10},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "add_span", "rollout": "r1", "attempt": "r1.a1", "sequence_id": 1},
        {"op": "get_latest_attempt", "rollout": "r1", "by_design": "finished_is_final"},
        {"op": "update_attempt", "rollout": "r1", "attempt": "r1.a1", "status": "succeeded"},
        {"op": "get_rollout_by_id", "rollout": "r1", "by_design": "finished_is_final"},
        {"op": "get_worker_by_id", "worker": "w1"},
    ],
    "update_rollout_statuses": [
        *({"op": "enqueue_rollout", "input": {"u": i}, "as": f"r{i}"} for i in range(1, 4)),
        {"op": "update_rollout", "rollout": "r1", "status": "cancelled"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "update_rollout", "rollout": "r2", "status": "requeuing"},
        {"op": "get_rollout_by_id", "rollout": "r2"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "update_rollout", "rollout": "r3", "metadata": None, "mode": "test"},
        {"op": "update_rollout", "rollout": "r3", "input": {"u": "changed"}, "config": {"max_attempts": 4}},
        {"op": "update_rollout", "rollout": "r3", "status": "succeeded"},
        {"op": "get_latest_attempt", "rollout": "r3"},
        {"op": "update_rollout", "rollout": "r2", "status": "failed"},
        {"op": "wait_for_rollouts", "rollouts": ["r1", "r2", "r3"], "timeout": 5},
        {"op": "update_rollout", "rollout": "ro-000000000bad", "status": "cancelled"},
        {"op": "update_attempt", "rollout": "ro-000000000bad", "attempt": "latest", "status": "failed"},
        {"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status": "failed"},
        {"op": "update_attempt", "rollout": "r2", "attempt": "at-00000bad", "status": "failed"},
    ],
    "resources_pinned_at_enqueue": [
        {"op": "add_resources", "resources": {"policy": {"model": "m1"}}, "as": "rs1"},
        {"op": "enqueue_rollout", "input": {"p": 1}, "as": "r1"},
        {"op": "add_resources", "resources": {"policy": {"model": "m2"}}, "as": "rs2"},
        {"op": "get_latest_resources"},
        {"op": "enqueue_rollout", "input": {"p": 2}, "as": "r2"},
        {"op": "enqueue_rollout", "input": {"p": 3}, "resources": "rs1", "as": "r3"},
        {"op": "enqueue_many_rollouts", "requests": [{"input": {"p": 4}, "as": "r4"}]},
        {"op": "update_resources", "target": "rs1", "resources": {"policy": {"model": "m1b"}}},
        {"op": "get_latest_resources"},
        {"op": "get_resources_by_id", "target": "rs1"},
        {"op": "get_resources_by_id", "target": "rs2"},
        {"op": "get_resources_by_id", "target": "rs-000000000bad"},
        {"op": "start_rollout", "input": {"p": 5}, "as": "r5"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "get_rollout_by_id", "rollout": "r3"},
        {"op": "enqueue_rollout", "input": {"p": 6}, "resources": "rs-000000000bad", "by_design": "unknown_resources"},
        {"op": "update_resources", "target": "rs-000000000new", "resources": {"policy": {"model": "x"}}},
        {"op": "get_resources_by_id", "target": "rs-000000000new"},
    ],
    "workers_follow_their_attempts": [
        {"op": "update_worker", "worker": "w1", "stats": {"gpu": 0.5}},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "enqueue_rollout", "input": {"w": 1}, "as": "r1"},
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "update_worker", "worker": "w1", "stats": {"gpu": 0.9}},
        {"op": "update_worker", "worker": "w1"},
        {"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status": "succeeded"},
        {"op": "get_worker_by_id", "worker": "w1"},
        {"op": "dequeue_rollout", "worker": "w2"},
        {"op": "get_worker_by_id", "worker": "w2"},
        {"op": "update_worker", "worker": "w3"},
        {"op": "query_workers"},
        {"op": "query_workers", "status_in": ["idle"]},
        {"op": "get_worker_by_id", "worker": "w-nobody"},
    ],
    "spans_and_sequence_ids": [
        {"op": "start_rollout", "input": {"spans": 1}, "as": "r1"},
        {"op": "get_next_span_sequence_id", "rollout": "r1", "attempt": "r1.a1"},
        {"op": "get_next_span_sequence_id", "rollout": "r1", "attempt": "r1.a1"},
        {"op": "add_span", "rollout": "r1", "attempt": "r1.a1", "sequence_id": 3, "name": "agent"},
        {"op": "add_span", "rollout": "r1", "attempt": "r1.a1", "sequence_id": 3, "name": "agent"},  # a duplicate
        {"op": "get_rollout_by_id", "rollout": "r1"},
        {
            "op": "add_many_spans",
            "spans": [
                {"rollout": "r1", "attempt": "r1.a1", "sequence_id": 4, "name": "llm"},
                {"rollout": "r1", "attempt": "r1.a1", "sequence_id": 5, "name": "reward"},
            ],
        },
        {"op": "query_spans", "rollout": "r1", "attempt": "latest"},
        {"op": "query_spans", "rollout": "r1", "name": "llm"},
        {"op": "query_spans", "rollout": "r1", "attempt": "r1.a1", "name_contains": "a", "sort_order": "desc"},
        {"op": "get_next_span_sequence_id", "rollout": "r1", "attempt": "r1.a1"},
        {"op": "add_span", "rollout": "r1", "attempt": "r1.a1", "sequence_id": 100},
        {"op": "get_next_span_sequence_id", "rollout": "r1", "attempt": "r1.a1"},
        {"op": "get_many_span_sequence_ids", "pairs": [["r1", "r1.a1"], ["r1", "r1.a1"], ["r1", "r1.a1"]]},
        {"op": "add_span", "rollout": "r1", "attempt": "at-00000bad", "sequence_id": 1},
        {"op": "add_span", "rollout": "ro-000000000bad", "attempt": "at-00000bad", "sequence_id": 1},
        {"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status": "succeeded"},
        {"op": "get_rollout_by_id", "rollout": "r1"},
        {"op": "query_spans", "rollout": "r1"},
        {"op": "get_next_span_sequence_id", "rollout": "r1", "attempt": "at-00000bad", "by_design": "unknown_ids"},
        {"op": "query_spans", "rollout": "r1", "attempt": "at-00000bad"},
        {"op": "query_spans", "rollout": "ro-000000000bad"},
    ],
    "sequence_ids_of_a_second_attempt": [
        {"op": "start_rollout", "input": {"seq": 1}, "as": "r1"},
        {"op": "get_many_span_sequence_ids", "pairs": [["r1", "r1.a1"], ["r1", "r1.a1"]]},
        {"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status": "failed"},
        {"op": "start_attempt", "rollout": "r1", "by_design": "reopened_end_time"},
        {
            "op": "get_next_span_sequence_id",
            "rollout": "r1",
            "attempt": "r1.a2",
            "by_design": "sequence_scope",
            "per_attempt": 1,
        },
        {
            "op": "get_next_span_sequence_id",
            "rollout": "r1",
            "attempt": "r1.a1",
            "by_design": "sequence_scope",
            "per_attempt": 3,
        },
        {
            "op": "get_next_span_sequence_id",
            "rollout": "r1",
            "attempt": "r1.a2",
            "by_design": "sequence_scope",
            "per_attempt": 2,
        },
    ],
    "wait_for_rollouts_subsets_and_unknown_ids": [
        {"op": "enqueue_rollout", "input": {"w": 1}, "as": "r1"},
        {"op": "enqueue_rollout", "input": {"w": 2}, "as": "r2"},
        {"op": "start_rollout", "input": {"w": 3}, "as": "r3"},
        {"op": "update_attempt", "rollout": "r3", "attempt": "latest", "status": "succeeded"},
        {"op": "wait_for_rollouts", "rollouts": ["r1", "r3", "ro-000000000bad"], "timeout": 0.2},
        {"op": "wait_for_rollouts", "rollouts": ["r1", "r2"], "timeout": 0},
        {"op": "update_rollout", "rollout": "r1", "status": "cancelled"},
        {"op": "wait_for_rollouts", "rollouts": ["r1", "r2", "r3"], "timeout": 0.2},
        {"op": "wait_for_rollouts", "rollouts": ["ro-000000000bad"], "timeout": 0.1},
        {"op": "wait_for_rollouts", "rollouts": [], "timeout": 0.1},
    ],
    "reads_and_query_filters": [
        *({"op": "enqueue_rollout", "input": {"q": i}, "as": f"r{i}"} for i in range(1, 5)),
        {"op": "dequeue_rollout", "worker": "w1"},
        {"op": "update_rollout", "rollout": "r2", "status": "cancelled"},
        {"op": "get_rollout_by_id", "rollout": "r1"},
        {"op": "get_rollout_by_id", "rollout": "r2"},
        {"op": "get_rollout_by_id", "rollout": "ro-000000000bad"},
        {"op": "query_rollouts", "rollout_id_in": ["r1", "r2", "r3", "r4"]},
        {"op": "query_rollouts", "rollout_id_in": ["r1", "r2", "r3", "r4"], "status_in": ["queuing"]},
        {"op": "query_rollouts", "rollout_id_in": ["r1", "r2", "r3", "r4"], "sort_by": "start_time"},
        {
            "op": "query_rollouts",
            "rollout_id_in": ["r1", "r2", "r3", "r4"],
            "sort_by": "start_time",
            "sort_order": "desc",
            "limit": 2,
            "offset": 1,
        },
        {"op": "query_rollouts", "rollout_id_in": ["r1", "r3"], "status_in": ["cancelled"], "filter_logic": "or"},
        {"op": "query_rollouts", "rollout_id_in": ["ro-000000000bad"]},
        {"op": "query_attempts", "rollout": "r3"},
        {"op": "get_latest_attempt", "rollout": "r1"},
        {"op": "query_attempts", "rollout": "ro-000000000bad"},
        {"op": "get_latest_attempt", "rollout": "ro-000000000bad"},
    ],
    "illegal_attempt_transitions": [
        {"op": "start_rollout", "input": {"t": 1}, "as": "r1"},
        {"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status": "succeeded"},
        {"op": "update_attempt", "rollout": "r1", "attempt": "latest", "status": "running", "by_design": "illegal"},
        {"op": "get_rollout_by_id", "rollout": "r1", "by_design": "illegal_aftermath"},
    ],
}

# -- differences by design ---------------------------------------------------------------------

_VALUE_ERROR: Observation = {"error": "ValueError"}


def _contract_error(seed: Any, step: Op) -> Any:
    return _VALUE_ERROR


def _watchdog_verdicts_end(seed: Any, step: Op) -> Any:
    return [{**a, "ended": True} if a["status"] in ("timeout", "unresponsive") else a for a in seed]


def _per_attempt(seed: Any, step: Op) -> Any:
    return step["per_attempt"]


def _live_again(seed: Any, step: Op) -> Any:
    return {**seed, "ended": False}


def _stays_failed(seed: Any, step: Op) -> Any:
    if "attempt" in seed and "rollout" in seed:  # the rollout: failed, as its waiters were told
        return {**seed, "status": "failed"}
    return {**seed, "status": "unresponsive", "ended": True}  # the attempt: not revived


def _refused_change(seed: Any, step: Op) -> Any:
    return {**seed, "status": "succeeded", "ended": True, "attempt": {**seed["attempt"], "status": "succeeded"}}


# Each one is listed in the README ("What differs by design": the store contract where the
# seed's in-memory store departs from it).
BY_DESIGN: dict[str, Callable[[Any, Op], Any]] = {
    # The seed's own contract (the LightningStore docstrings) says these raise ValueError; its
    # in-memory store does not check: enqueue takes an unknown resources id and sequence ids are
    # issued for any id. agl-stream keeps the contract for these changes (README: "the same ...
    # errors"). Reads of an unknown id's spans, attempts and latest attempt answer empty in
    # both, and update_resources on an unknown id creates it in both: the seed's users and
    # algorithms rely on them.
    "unknown_resources": _contract_error,
    "unknown_ids": _contract_error,
    # "The counter may be scoped per rollout or per attempt" (the contract): the seed counts
    # per rollout, agl-stream per attempt (the counter lives in the attempt's state), so a new
    # attempt starts at 1 and an old one goes on where it stood. The step says what it gets.
    "sequence_scope": _per_attempt,
    # "Terminal statuses must set end_time" (the contract, update_attempt): the seed sets it for
    # succeeded and failed only; agl-stream also for the watchdog's timeout and unresponsive.
    "watchdog_end_time": _watchdog_verdicts_end,
    # A manual attempt reopens a finished rollout (preparing): the seed keeps the old end_time
    # on the now live rollout; agl-stream clears it (end_time is set while terminal only).
    "reopened_end_time": _live_again,
    # A finished rollout is final: wait_for_rollouts has told its waiters. In the seed, a span
    # revives an attempt judged unresponsive even when the verdict failed its rollout (no
    # retry left), and the attempt's late success then turns the failed rollout succeeded;
    # agl-stream revives an unresponsive attempt only while its rollout is unfinished (a retry
    # pending), so the late attempt records its success and the rollout stays failed.
    "finished_is_final": _stays_failed,
    # The seed accepts any attempt status change, so a succeeded attempt can go back to
    # running and drag its finished rollout with it; agl-stream refuses it (test_store.py,
    # test_illegal_transitions_are_errors_not_silent) and the rollout stays succeeded.
    "illegal": _contract_error,
    "illegal_aftermath": _refused_change,
}


def _expected(step: Op, seed: Any) -> Any:
    key = step.get("by_design")
    return seed if key is None else BY_DESIGN[key](seed, step)


# -- running both ---------------------------------------------------------------------------------


class _SeedRun:
    """The seed's subprocess, started once and read on first use."""

    def __init__(self, python: Path) -> None:
        self._process = subprocess.Popen(
            [str(python), str(RUNNER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **SEED_CHILD_ENV},
        )
        self._request = json.dumps({"tag": "seed", "sequences": SEQUENCES})
        self._results: dict[str, list[Observation]] | None = None

    def results(self) -> dict[str, list[Observation]]:
        if self._results is None:
            out, err = self._process.communicate(self._request, timeout=600)
            assert self._process.returncode == 0, f"the seed's runner failed:\n{err[-4000:]}"
            self._results = json.loads(out)
        return self._results

    def stop(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


@pytest.fixture(scope="session")
def seed_run(seed_python: Path) -> Any:
    """Session-scoped only so that it starts before the stack (pytest sets up the wider scopes
    first, in argument order) and the seed's slow import overlaps the stack's start."""
    run = _SeedRun(seed_python)
    yield run
    run.stop()


class AglBackend:
    """agl-stream's types for the interpreter."""

    def config(self, spec: Mapping[str, Any]) -> RolloutConfig:
        return RolloutConfig(**spec)

    def resources(self, spec: Mapping[str, Any]) -> dict[str, LLM]:
        return {
            name: LLM(resource_type="llm", endpoint="http://127.0.0.1:1/v1", model=r["model"], sampling_parameters={})
            for name, r in spec.items()
        }

    def span(self, rollout_id: str, attempt_id: str, sequence_id: int, name: str) -> Span:
        return Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            sequence_id=sequence_id,
            trace_id=f"{sequence_id:032x}",
            span_id=f"{sequence_id:016x}",
            name=name,
            attributes={"step": sequence_id},
            start_time=1.0,
            end_time=2.0,
        )

    def enqueue_request(self, fields: Mapping[str, Any]) -> EnqueueRolloutRequest:
        return EnqueueRolloutRequest(**fields)

    async def dequeue_within(self, store: AglStore, worker_id: str | None, seconds: float) -> Any:
        return await store.dequeue_rollout(worker_id=worker_id, wait=seconds)  # held by the processor


async def _prepare(store: AglStore) -> str | None:
    """The shared stack's queue emptied of other tests' rollouts; its latest resources now."""
    for _ in range(1000):
        if await store.dequeue_rollout(worker_id="w-drain") is None:
            break
    else:
        raise AssertionError("the queue never ran dry")
    latest = await store.get_latest_resources()
    return None if latest is None else latest.resources_id


async def _run_ours(settings: Settings, name: str) -> list[Observation]:
    async with connect(**settings.model_dump(exclude_none=True)) as store:

        async def same_store() -> AglStore:
            return store

        tag = f"c{uuid.uuid4().hex[:8]}"
        results = await run_sequences(
            {name: SEQUENCES[name]}, AglBackend(), same_store, tag=lambda _: tag, before=_prepare
        )
    return results[name]


def _delta(expected: Any, actual: Any) -> Any:
    """What differs, key by key for mappings (so a report shows the difference, not the record)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        keys = [k for k in {**expected, **actual} if expected.get(k, "<missing>") != actual.get(k, "<missing>")]
        return {k: _delta(expected.get(k, "<missing>"), actual.get(k, "<missing>")) for k in keys}
    return {"seed": expected, "agl-stream": actual}


def _compare(name: str, seed: list[Observation], ours: list[Observation]) -> None:
    steps = SEQUENCES[name]
    assert len(seed) == len(ours) == len(steps)
    differences = []
    for index, (step, theirs, mine) in enumerate(zip(steps, seed, ours, strict=True)):
        expected = _expected(step, theirs["result"])
        if mine["result"] != expected:
            differences.append(f"step {index} {json.dumps(step)}:\n    {json.dumps(_delta(expected, mine['result']))}")
    assert not differences, f"{name}: {len(differences)} differences\n" + "\n".join(differences)


@pytest.mark.parametrize("name", list(SEQUENCES))
async def test_same_observations_as_the_seed(name: str, seed_run: _SeedRun, stack_settings: Settings) -> None:
    ours = await _run_ours(stack_settings, name)
    seed = await asyncio.to_thread(seed_run.results)
    _compare(name, seed[name], ours)

"""Prometheus metrics of the real stack (the shared one: processor, gateway, ingress): what the
roles count matches what Kafka holds, the lag gauges come back to 0, and `agl-stream status`
shows each role with its rates and each consumer group's lag."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agl_stream import connect, metrics
from agl_stream.auth import auth_headers
from agl_stream.config import Settings
from agl_stream.kafka.admin import group_positions
from agl_stream.local import monitor
from agl_stream.local.processes import role_alive, role_environment
from consumers.sink_specs import ROLLOUT_STATE, sinks_group_id

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _url(settings: Settings, role: str) -> str:
    live = [e for e in monitor.read_endpoints(settings) if e.role == role and role_alive(e.pid)]
    assert len(live) == 1, f"one live {role} endpoint expected, found {live}"
    return live[0].url


async def _scrape(settings: Settings, role: str) -> Samples:
    async with httpx.AsyncClient(headers=auth_headers(settings), trust_env=False, timeout=60) as client:
        response = await client.get(_url(settings, role))
    response.raise_for_status()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def _total(samples: Samples, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(value for (n, have), value in samples.items() if n == name and wanted <= have)


async def _wait_for(what: str, check: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.1)  # polling a condition


async def _settled(settings: Settings, role: str, group: str, topic: str) -> tuple[float, int]:
    """Once ``group`` committed everything on ``topic``, and no record arrived meanwhile: what the
    role counted in from it and the topic's end offsets (summed over partitions)."""
    found: list[tuple[float, int]] = []

    async def quiet() -> bool:
        committed, ends = await group_positions(settings, lambda g: g == group, [topic])
        end = sum(o for (t, _), o in ends.items() if t == topic)
        if sum(o for (t, _), o in committed.get(group, {}).items() if t == topic) != end:
            return False
        counted = _total(await _scrape(settings, role), "agl_records_in_total", group=group, topic=topic)
        _, again = await group_positions(settings, lambda g: g == group, [topic])
        if sum(o for (t, _), o in again.items() if t == topic) != end:
            return False
        found.append((counted, end))
        return True

    await _wait_for(f"{group} caught up on {topic}", quiet)
    return found[-1]


async def test_counters_match_the_log_lag_returns_to_zero_and_status_shows_roles(stack_settings: Settings) -> None:
    settings = stack_settings
    rollouts, states = settings.topic("rollouts"), settings.topic("rollout-state")
    processor = f"{settings.topic_prefix}.processor.rollouts"
    sink = sinks_group_id(settings, ROLLOUT_STATE.lane)

    in_0, end_0 = await _settled(settings, "processor", processor, rollouts)
    sink_0, state_end_0 = await _settled(settings, "gateway", sink, states)
    sent_0 = metrics.RECORDS_OUT.labels(metrics.role(), rollouts)._value.get()
    n = 40
    async with connect(**settings.model_dump(exclude_none=True)) as store:
        enqueued = await store.enqueue_many_rollouts([{"input": {"metrics": i}} for i in range(n)])
        assert await store.get_rollout_by_id(enqueued[-1].rollout_id) is not None  # fenced: the sink applied it
    assert metrics.RECORDS_OUT.labels(metrics.role(), rollouts)._value.get() - sent_0 == n  # this client's count

    in_1, end_1 = await _settled(settings, "processor", processor, rollouts)
    assert end_1 - end_0 >= n
    assert in_1 - in_0 == end_1 - end_0, "the processor counted each event on agl.rollouts once"
    sink_1, state_end_1 = await _settled(settings, "gateway", sink, states)
    assert state_end_1 > state_end_0
    assert sink_1 - sink_0 == state_end_1 - state_end_0, "the sink counted each state record once"
    after = await _scrape(settings, "processor")
    assert _total(after, "agl_records_out_total", topic=states) > 0
    assert _total(after, "agl_handle_seconds_count", group=processor) > 0
    assert _total(after, "agl_fold_seconds_count") > 0
    gateway = await _scrape(settings, "gateway")
    assert _total(gateway, "agl_fence_wait_seconds_count") >= 1  # the fenced read above
    assert _total(gateway, "agl_sink_flush_seconds_count", sink=ROLLOUT_STATE.name) > 0

    async def lag_is_zero() -> bool:
        lags = [
            v
            for (name, labels), v in (await _scrape(settings, "processor")).items()
            if name == "agl_consumer_lag_records" and dict(labels)["topic"] == rollouts
        ]
        return bool(lags) and not any(lags)

    await _wait_for("the processor's lag gauges read 0", lag_is_zero)

    shown = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "agl_stream", "status", "--interval", "0.3"],
        env={**role_environment(settings), "COLUMNS": "250"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    for expected in ("roles", "processor", "gateway", "ingress", "consumer lag", processor, sink):
        assert expected in shown.stdout, f"{expected!r} not in:\n{shown.stdout}"
    assert "Traceback" not in shown.stderr

"""`topics apply` against the real broker: idempotent, drift reported, never "fixed" silently."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka.admin import NewTopic

from agl_stream.config import Settings
from agl_stream.kafka import admin
from agl_stream.topics import load_topic_specs

pytestmark = pytest.mark.integration


async def test_apply_twice_changes_nothing_the_second_time(settings: Settings) -> None:
    first = await admin.apply(settings)
    assert {c.name for c in first.create} == {s.full_name(settings.topic_prefix) for s in load_topic_specs()}
    second = await admin.apply(settings)
    assert second.changes_nothing and not second.drift
    assert len(second.unchanged) == len(first.create)


async def test_drift_is_reported_not_changed(settings: Settings) -> None:
    client = admin.admin_client(settings)
    await client.start()
    try:
        # Someone created the spans topic by hand with the wrong partition count and retention.
        await client.create_topics([NewTopic(settings.topic("spans"), 2, 1, topic_configs={"retention.ms": "60000"})])
        # Metadata reaches brokers asynchronously: wait until the topic is visible.
        deadline = time.monotonic() + 30
        while settings.topic("spans") not in await client.list_topics():
            assert time.monotonic() < deadline, "hand-made topic never became visible"
            await asyncio.sleep(0.05)
    finally:
        await client.close()
    plan = await admin.apply(settings)
    drifted = {(d.topic, d.setting) for d in plan.drift}
    spans = settings.topic("spans")
    assert (spans, "partitions") in drifted
    assert (spans, "retention.ms") in drifted
    assert spans not in {c.name for c in plan.create}
    # Still drifted the second time: apply reports, it does not repartition.
    again = await admin.plan(settings)
    again_drifted = {(d.topic, d.setting) for d in again.drift}
    assert (spans, "partitions") in again_drifted
    # Now that agl.rollouts exists (4 partitions), the broken co-partitioning shows too.
    assert any("co-partitioned" in setting for _, setting in again_drifted)

"""Kafka admin edge: read what topics exist and create the declared ones that don't; read what
consumer groups committed (for lag)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from agl_stream.config import Settings
from agl_stream.errors import TopicError
from agl_stream.topics import MANAGED_CONFIGS, ActualTopic, TopicPlan, TopicSpec, load_topic_specs, plan_topics

# Kafka error code for a create that lost a race with another creator.
_TOPIC_ALREADY_EXISTS = 36


def admin_client(settings: Settings) -> AIOKafkaAdminClient:
    return AIOKafkaAdminClient(**settings.kafka_client_options(), request_timeout_ms=30000)


async def describe_topics(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, ActualTopic]:
    """Partitions, replication and managed configs of those of `names` that exist."""
    existing = set(await admin.list_topics())
    wanted = [n for n in names if n in existing]
    if not wanted:
        return {}
    described = await admin.describe_topics(wanted)
    configs = await _topic_configs(admin, wanted)
    result = {}
    for topic in described:
        if topic["error_code"] != 0:
            raise TopicError(f"cannot describe topic {topic['topic']}: error code {topic['error_code']}")
        partitions = topic["partitions"]
        result[topic["topic"]] = ActualTopic(
            name=topic["topic"],
            partitions=len(partitions),
            replication=min((len(p["replicas"]) for p in partitions), default=0),
            configs=configs.get(topic["topic"], {}),
        )
    return result


async def _topic_configs(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, dict[str, str]]:
    resources = [ConfigResource(ConfigResourceType.TOPIC, n, dict.fromkeys(MANAGED_CONFIGS)) for n in names]
    responses = await admin.describe_configs(resources)
    configs: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.to_object()["resources"]:
            entries: Any = resource["config_entries"]
            configs[resource["resource_name"]] = {e["config_names"]: e["config_value"] for e in entries}
    return configs


async def broker_count(admin: AIOKafkaAdminClient) -> int:
    cluster = await admin.describe_cluster()
    return len(cluster["brokers"])


async def plan(settings: Settings, specs: list[TopicSpec] | None = None) -> TopicPlan:
    specs = specs if specs is not None else load_topic_specs()
    admin = admin_client(settings)
    await admin.start()
    try:
        return await _plan(admin, settings, specs)
    finally:
        await admin.close()


async def _plan(admin: AIOKafkaAdminClient, settings: Settings, specs: list[TopicSpec]) -> TopicPlan:
    names = [s.full_name(settings.topic_prefix) for s in specs]
    actual = await describe_topics(admin, names)
    return plan_topics(
        specs,
        actual,
        prefix=settings.topic_prefix,
        brokers=await broker_count(admin),
        replication_override=settings.replication_factor,
    )


async def apply(settings: Settings, specs: list[TopicSpec] | None = None) -> TopicPlan:
    """Create the declared topics that are missing; return the plan (drift is only reported)."""
    specs = specs if specs is not None else load_topic_specs()
    admin = admin_client(settings)
    await admin.start()
    try:
        topic_plan = await _plan(admin, settings, specs)
        if topic_plan.create:
            response = await admin.create_topics(
                [
                    NewTopic(c.name, c.partitions, c.replication, topic_configs=dict(c.configs))
                    for c in topic_plan.create
                ]
            )
            errors = {t[0]: t[1] for t in response.topic_errors if t[1] != 0}
            unexpected = {name: code for name, code in errors.items() if code != _TOPIC_ALREADY_EXISTS}
            if unexpected:
                raise TopicError(f"creating topics failed (Kafka error codes): {unexpected}")
            if errors:
                # Someone created them between our look and our create (metadata propagates
                # asynchronously): look again, so what they created is checked for drift.
                again = await _plan(admin, settings, specs)
                topic_plan = TopicPlan(
                    create=tuple(c for c in topic_plan.create if c.name not in errors),
                    drift=again.drift,
                    unchanged=tuple(
                        n for n in again.unchanged if n not in {c.name for c in topic_plan.create} or n in errors
                    ),
                )
        return topic_plan
    finally:
        await admin.close()


async def create_topic_like(settings: Settings, declared: str, name: str) -> bool:
    """Create topic ``name`` with the partitions and configs of the declared topic ``declared``
    (short name, e.g. ``"triplets"``) unless it exists; True when this call created it."""
    [spec] = [s for s in load_topic_specs() if s.name == declared]
    admin = admin_client(settings)
    await admin.start()
    try:
        if name in set(await admin.list_topics()):
            return False
        replication = spec.replication_for(await broker_count(admin), settings.replication_factor)
        response = await admin.create_topics(
            [NewTopic(name, spec.partitions, replication, topic_configs=spec.configs_for(replication))]
        )
        codes = [t[1] for t in response.topic_errors if t[1] != 0]
        if codes and codes != [_TOPIC_ALREADY_EXISTS]:
            raise TopicError(f"creating topic {name} failed (Kafka error codes): {codes}")
        return not codes
    finally:
        await admin.close()


async def group_positions(
    settings: Settings, groups: Callable[[str], bool], topics: Iterable[str] = ()
) -> tuple[dict[str, dict[tuple[str, int], int]], dict[tuple[str, int], int]]:
    """What each consumer group ``groups`` accepts has committed, per (topic, partition), and the
    log-end offset of every partition of the topics they committed on and of ``topics``: lag is
    the difference."""
    admin = admin_client(settings)
    await admin.start()
    committed: dict[str, dict[tuple[str, int], int]] = {}
    try:
        listed = await admin.list_consumer_groups()
        for group in sorted(str(g[0]) for g in listed if groups(str(g[0]))):
            try:
                offsets = await admin.list_consumer_group_offsets(group)
            except KafkaError:  # a group being rebalanced or a coordinator moving: shown without it
                continue
            committed[group] = {(tp.topic, tp.partition): m.offset for tp, m in offsets.items() if m.offset >= 0}
        topics = sorted({topic for offsets in committed.values() for topic, _ in offsets} | set(topics))
        existing = set(await admin.list_topics())
        described = await admin.describe_topics([t for t in topics if t in existing]) if topics else []
    finally:
        await admin.close()
    tps = [TopicPartition(d["topic"], p["partition"]) for d in described for p in d["partitions"]]
    if not tps:
        return committed, {}
    consumer = AIOKafkaConsumer(**settings.kafka_client_options(), enable_auto_commit=False)
    await consumer.start()
    try:
        ends = await consumer.end_offsets(tps)
    finally:
        await consumer.stop()
    return committed, {(tp.topic, tp.partition): int(end) for tp, end in ends.items()}

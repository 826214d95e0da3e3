"""The topic declarations and the pure reconciliation plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_stream.errors import TopicError
from agl_stream.topics import ActualTopic, TopicSpec, check_specs, load_topic_specs, plan_topics

DESIGN_TOPICS = {
    "rollouts",
    "rollout-state",
    "spans",
    "resources",
    "workers",
    "task-requests",
    "triplets",
    "triplet-batches",
    "dlq",
}
# Topics agl-stream adds beyond the original design's list (docs/design-notes.md, "Topics"); its
# agl.tasks gave way to store-requests (claims the processor answers, not bound to partitions).
EXTRA_TOPICS = {"trainer-metrics", "store-requests"}


def test_every_topic_in_the_design_is_declared() -> None:
    specs = {s.name: s for s in load_topic_specs()}
    assert set(specs) == DESIGN_TOPICS | EXTRA_TOPICS
    assert specs["rollouts"].partitions == specs["spans"].partitions
    assert specs["resources"].cleanup_policy == "compact"
    assert specs["workers"].cleanup_policy == "compact"
    assert specs["rollouts"].retention_ms == -1


def _spec(name: str, partitions: int = 4, co: tuple[str, ...] = ()) -> TopicSpec:
    return TopicSpec(
        name=name,
        key="rollout_id",
        value_schema="agl.Span",
        partitions=partitions,
        replication=3,
        min_insync_replicas=2,
        cleanup_policy="delete",
        retention_ms=-1,
        co_partitioned_with=co,
    )


def test_co_partitioned_topics_must_have_equal_partitions() -> None:
    with pytest.raises(TopicError, match="equal partition counts"):
        check_specs([_spec("rollouts", 4, ("spans",)), _spec("spans", 8)])
    with pytest.raises(TopicError, match="undeclared"):
        check_specs([_spec("rollouts", 4, ("spans",))])
    with pytest.raises(TopicError, match="twice"):
        check_specs([_spec("a"), _spec("a")])


def test_bad_declaration_file_is_a_topic_error(tmp_path: Path) -> None:
    bad = tmp_path / "topics.toml"
    bad.write_text('[[topic]]\nname = "x"\n')
    with pytest.raises(TopicError, match="invalid topic declaration"):
        load_topic_specs(bad)


def test_plan_creates_missing_topics_capped_to_the_brokers() -> None:
    plan = plan_topics([_spec("spans")], {}, prefix="agl", brokers=1)
    assert [c.name for c in plan.create] == ["agl.spans"]
    created = plan.create[0]
    assert created.replication == 1
    assert created.configs["min.insync.replicas"] == "1"
    assert not plan.changes_nothing


def test_plan_reports_drift_and_creates_nothing_for_existing_topics() -> None:
    spec = _spec("spans")
    configs = spec.configs_for(1)
    same = ActualTopic(name="agl.spans", partitions=4, replication=1, configs=configs)
    plan = plan_topics([spec], {"agl.spans": same}, prefix="agl", brokers=1)
    assert plan.changes_nothing and not plan.drift and plan.unchanged == ("agl.spans",)

    drifted = ActualTopic(name="agl.spans", partitions=2, replication=1, configs={**configs, "retention.ms": "1000"})
    plan = plan_topics([spec], {"agl.spans": drifted}, prefix="agl", brokers=1)
    assert plan.changes_nothing
    assert {(d.setting, d.declared, d.actual) for d in plan.drift} == {
        ("partitions", "4", "2"),
        ("retention.ms", "-1", "1000"),
    }


def test_plan_checks_co_partitioning_on_the_cluster() -> None:
    rollouts, spans = _spec("rollouts", 4, ("spans",)), _spec("spans", 4)
    actual = {
        "agl.rollouts": ActualTopic(name="agl.rollouts", partitions=4, replication=1, configs=rollouts.configs_for(1)),
        "agl.spans": ActualTopic(name="agl.spans", partitions=6, replication=1, configs=spans.configs_for(1)),
    }
    plan = plan_topics([rollouts, spans], actual, prefix="agl", brokers=1)
    assert any("co-partitioned" in d.setting for d in plan.drift)

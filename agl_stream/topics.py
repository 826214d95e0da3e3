"""Topic declarations (``topics/topics.toml``) and the pure plan that reconciles them with a cluster.

The Kafka admin calls live in ``agl_stream.kafka.admin``; this module does no I/O beyond
reading the declaration file.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agl_stream.errors import TopicError
from agl_stream.resources import resource_path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# Topic configs we manage. Anything else set on a topic is left alone.
MANAGED_CONFIGS = ("cleanup.policy", "retention.ms", "min.insync.replicas", "max.message.bytes")


class TopicSpec(BaseModel):
    """One declared topic, name without the prefix."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z][a-z0-9.-]*$")
    key: str
    value_schema: str
    partitions: int = Field(ge=1)
    replication: int = Field(ge=1)
    min_insync_replicas: int = Field(ge=1)
    cleanup_policy: Literal["delete", "compact", "compact,delete"]
    retention_ms: int = Field(ge=-1)
    max_message_bytes: int | None = Field(None, ge=1024)
    co_partitioned_with: tuple[str, ...] = ()
    written_by: tuple[str, ...] = ()  # role names (the declarations' [roles] table)
    read_by: tuple[str, ...] = ()
    doc: str = ""

    def full_name(self, prefix: str) -> str:
        return f"{prefix}.{self.name}"

    def replication_for(self, brokers: int, override: int | None = None) -> int:
        """Wanted replication, capped at the brokers there are (a local broker has one)."""
        return min(override or self.replication, brokers)

    def configs_for(self, replication: int) -> dict[str, str]:
        """Topic configs as Kafka spells them; min ISR never exceeds what replication allows."""
        configs = {
            "cleanup.policy": self.cleanup_policy,
            "retention.ms": str(self.retention_ms),
            "min.insync.replicas": str(min(self.min_insync_replicas, max(1, replication - 1))),
        }
        if self.max_message_bytes is not None:
            configs["max.message.bytes"] = str(self.max_message_bytes)
        return configs


class ActualTopic(BaseModel):
    """What the cluster says about an existing topic (or will, for one `topics apply` creates)."""

    model_config = ConfigDict(frozen=True)

    name: str
    partitions: int
    replication: int
    configs: dict[str, str]


class Drift(BaseModel):
    model_config = ConfigDict(frozen=True)

    topic: str
    setting: str
    declared: str
    actual: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.setting} is {self.actual}, declared {self.declared}"


class TopicPlan(BaseModel):
    """What `topics apply` will do (create) and what it reports but leaves alone (drift)."""

    model_config = ConfigDict(frozen=True)

    create: tuple[ActualTopic, ...] = ()
    drift: tuple[Drift, ...] = ()
    unchanged: tuple[str, ...] = ()

    @property
    def changes_nothing(self) -> bool:
        return not self.create


def load_topic_specs(path: Path | None = None) -> list[TopicSpec]:
    """Read and check the declarations (defaults applied, co-partitioning verified)."""
    return load_topology(path)[0]


def load_topology(path: Path | None = None) -> tuple[list[TopicSpec], dict[str, str]]:
    """The declared topics and the roles that write and read them (name -> what the role is);
    every role a topic names must be declared, and every topic has a writer and a reader."""
    path = path or resource_path("topics/topics.toml")
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise TopicError(f"cannot read topic declarations {path}: {exc}") from exc
    roles = {str(name): str(what) for name, what in raw.get("roles", {}).items()}
    defaults = raw.get("defaults", {})
    try:
        specs = [TopicSpec(**{**defaults, **entry}) for entry in raw.get("topic", [])]
    except ValidationError as exc:
        raise TopicError(f"invalid topic declaration in {path}: {exc}") from exc
    check_specs(specs)
    for spec in specs:
        if not spec.written_by or not spec.read_by:
            raise TopicError(f"{path}: topic {spec.name!r} needs written_by and read_by (role names)")
        unknown = sorted(set(spec.written_by + spec.read_by) - set(roles))
        if unknown:
            raise TopicError(f"{path}: topic {spec.name!r} names roles not in [roles]: {unknown}")
    return specs, roles


def topology_table(specs: list[TopicSpec], roles: dict[str, str], prefix: str = "agl") -> str:
    """The topology as Markdown: one row per topic (who writes it, who reads it), then the roles."""
    lines = ["| topic | key | written by | read by | what |", "|---|---|---|---|---|"]
    for spec in specs:
        compacted = " (compacted)" if "compact" in spec.cleanup_policy else ""
        lines.append(
            f"| `{spec.full_name(prefix)}`{compacted} | {spec.key} | {', '.join(spec.written_by)} "
            f"| {', '.join(spec.read_by)} | {spec.doc} |"
        )
    lines += ["", "Roles in the table:", ""]
    lines += [f"- **{name}**: {what}" for name, what in roles.items()]
    return "\n".join(lines) + "\n"


def check_specs(specs: list[TopicSpec]) -> None:
    """Names unique, co-partitioned topics declared with equal partition counts."""
    by_name: dict[str, TopicSpec] = {}
    for spec in specs:
        if spec.name in by_name:
            raise TopicError(f"topic {spec.name!r} is declared twice")
        by_name[spec.name] = spec
    for spec in specs:
        for other_name in spec.co_partitioned_with:
            other = by_name.get(other_name)
            if other is None:
                raise TopicError(f"{spec.name} is co-partitioned with undeclared topic {other_name!r}")
            if other.partitions != spec.partitions:
                raise TopicError(
                    f"{spec.name} ({spec.partitions} partitions) and {other.name} "
                    f"({other.partitions}) must have equal partition counts: processors join "
                    "them by partition"
                )


def plan_topics(
    specs: list[TopicSpec],
    actual: dict[str, ActualTopic],
    *,
    prefix: str,
    brokers: int,
    replication_override: int | None = None,
) -> TopicPlan:
    """Compare declarations with the cluster: topics to create, and drift to report."""
    create: list[ActualTopic] = []
    drift: list[Drift] = []
    unchanged: list[str] = []
    for spec in specs:
        name = spec.full_name(prefix)
        replication = spec.replication_for(brokers, replication_override)
        configs = spec.configs_for(replication)
        existing = actual.get(name)
        if existing is None:
            create.append(ActualTopic(name=name, partitions=spec.partitions, replication=replication, configs=configs))
            continue
        found = _drift_of(name, spec.partitions, replication, configs, existing)
        drift.extend(found)
        if not found:
            unchanged.append(name)
    # Co-partitioning must hold on the cluster too, not only in the file.
    for spec in specs:
        for other_name in spec.co_partitioned_with:
            a = actual.get(spec.full_name(prefix))
            b = actual.get(f"{prefix}.{other_name}")
            if a is not None and b is not None and a.partitions != b.partitions:
                drift.append(
                    Drift(
                        topic=a.name,
                        setting=f"partitions (co-partitioned with {b.name})",
                        declared=str(b.partitions),
                        actual=str(a.partitions),
                    )
                )
    return TopicPlan(create=tuple(create), drift=tuple(drift), unchanged=tuple(unchanged))


def _drift_of(
    name: str, partitions: int, replication: int, configs: dict[str, str], existing: ActualTopic
) -> list[Drift]:
    found = []
    if existing.partitions != partitions:
        found.append(Drift(topic=name, setting="partitions", declared=str(partitions), actual=str(existing.partitions)))
    if existing.replication != replication:
        found.append(
            Drift(topic=name, setting="replication", declared=str(replication), actual=str(existing.replication))
        )
    for key, want in configs.items():
        have = existing.configs.get(key)
        if have != want:
            found.append(Drift(topic=name, setting=key, declared=want, actual=str(have)))
    return found

"""The topology (who writes and who reads each topic, topics/topics.toml) against the code and the docs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agl_stream.errors import TopicError
from agl_stream.topics import load_topology, topology_table

ROOT = Path(__file__).resolve().parents[2]

# Where each declared role's code lives ("external systems" and "operators" are not ours).
ROLE_FILES = {
    "processor": ["processors/rollouts.py"],
    "ingress": ["processors/ingress.py"],
    "triplets": ["processors/triplets.py"],
    "batcher": ["processors/batcher.py"],
    "gateway": ["consumers/gateway*.py", "consumers/clickhouse_sink.py", "consumers/sink_specs.py"],
    "trainer": ["consumers/trainer.py"],
    "inference": ["consumers/inference/*.py", "consumers/vllm_server.py"],
    "runner": ["consumers/runner.py"],
    "otlp-kafka": ["consumers/otlp_kafka.py"],
    "replay": ["producers/replay*.py"],
    "demo": ["producers/synthetic_spans.py"],
    "enqueue": ["agl_stream/cli/enqueue_cmd.py"],
    "store client": ["agl_stream/store/*.py"],
}
# Topics a role's code names without writing or reading them.
NAMED_ONLY = {
    ("processor", "replies"),  # the per-client reply topics' prefix (agl_stream/store/replies.py)
    ("store client", "replies"),
    ("store client", "rollout-state"),  # its read fences name the state partition the processor wrote
}
_TOPIC_CALL = re.compile(r"""\btopic\(\s*["']([a-z][a-z0-9-]*)["']\s*\)""")


def _sources(role: str) -> list[Path]:
    return sorted(path for pattern in ROLE_FILES[role] for path in ROOT.glob(pattern))


def test_every_role_is_declared_and_has_code() -> None:
    _, roles = load_topology()
    assert set(ROLE_FILES) == set(roles) - {"external systems", "operators"}
    for role in ROLE_FILES:
        assert _sources(role), f"no source files for role {role}"


def test_the_topics_a_roles_code_names_are_declared_for_that_role() -> None:
    specs, _ = load_topology()
    declared: dict[str, set[str]] = {role: set() for role in ROLE_FILES}
    for spec in specs:
        for role in {*spec.written_by, *spec.read_by} & set(ROLE_FILES):
            declared[role].add(spec.name)
    for role in ROLE_FILES:
        named = {name for path in _sources(role) for name in _TOPIC_CALL.findall(path.read_text())}
        undeclared = {name for name in named if name not in declared[role] and (role, name) not in NAMED_ONLY}
        assert not undeclared, f"{role} names topics topics.toml does not give it: {sorted(undeclared)}"


def test_the_sinks_read_what_the_topology_says_the_gateway_reads() -> None:
    from consumers.sink_specs import SPECS

    specs, _ = load_topology()
    read_by_gateway = {spec.name for spec in specs if "gateway" in spec.read_by}
    assert {sink.topic for sink in SPECS} <= read_by_gateway


def test_the_architecture_docs_table_is_the_rendered_topology() -> None:
    specs, roles = load_topology()
    text = (ROOT / "docs" / "architecture.md").read_text()
    match = re.search(r"<!-- topology:[^\n]*-->\n(.*?)<!-- /topology -->", text, re.S)
    assert match is not None, "docs/architecture.md lost its topology markers"
    assert match.group(1) == topology_table(specs, roles), "run `agl-stream topics table` into docs/architecture.md"


def test_a_topic_without_readers_or_naming_an_unknown_role_is_refused(tmp_path: Path) -> None:
    base = '[roles]\nwriter = "w"\n\n[[topic]]\nname = "t"\nkey = "k"\nvalue_schema = "agl.X"\npartitions = 1\n'
    base += 'replication = 1\nmin_insync_replicas = 1\ncleanup_policy = "delete"\nretention_ms = -1\n'
    path = tmp_path / "topics.toml"
    path.write_text(base + 'written_by = ["writer"]\n')
    with pytest.raises(TopicError, match="needs written_by and read_by"):
        load_topology(path)
    path.write_text(base + 'written_by = ["writer"]\nread_by = ["nobody"]\n')
    with pytest.raises(TopicError, match="nobody"):
        load_topology(path)
    path.write_text(base + 'written_by = ["writer"]\nread_by = ["writer"]\n')
    assert [spec.name for spec in load_topology(path)[0]] == ["t"]

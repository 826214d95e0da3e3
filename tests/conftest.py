"""Shared fixtures.

Integration tests talk to a real Kafka broker: the one named by AGL_KAFKA_BOOTSTRAP, or else
one broker started for the whole session on free ports in a temporary folder (stopped at the
end). Each test then gets its own topic prefix and data dir, so tests never see each other's
topics or local state and need no cleanup.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from uuid import uuid4

import pytest

from agl_stream.config import Settings
from agl_stream.kafka import broker
from agl_stream.ports import free_ports

# The brokers of a test live seconds to minutes: C1 only, so no C2 compiling takes the cores
# while they work (AGL_KAFKA_JIT; roles and CLI runs the tests start inherit it).
os.environ.setdefault("AGL_KAFKA_JIT", "c1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Tests that run the seed's own python (`-m seed` selects them, `-m "not seed"` skips the
    # seed's virtualenv install).
    for item in items:
        if "seed_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.seed)


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap servers of the broker the tests use (started here unless given)."""
    given = os.environ.get("AGL_KAFKA_BOOTSTRAP")
    if given:
        yield given
        return
    port, controller_port = free_ports(2)
    # kafka_libs_dir keeps its default, so the Maven jar cache is shared with `make jars`.
    local = Settings(
        kafka_bootstrap=None,
        data_dir=tmp_path_factory.mktemp("session-broker"),
        kafka_port=port,
        kafka_controller_port=controller_port,
    )
    info = broker.start(local)
    try:
        yield info.bootstrap
    finally:
        broker.stop(local)


@pytest.fixture
def settings(kafka_bootstrap: str, tmp_path: Path) -> Settings:
    """Settings for one test: the session's broker, a fresh data dir, topics of its own."""
    return Settings(
        kafka_bootstrap=kafka_bootstrap,
        data_dir=tmp_path,
        topic_prefix=f"t{uuid4().hex[:10]}",
    )


@pytest.fixture(scope="session")
def stack_settings(kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Settings]:
    """A local stack (rollout processor + gateway) on the session's broker, shared by store tests.

    Store tests isolate themselves by the rollouts they create, so one stack serves them all.
    """
    from tests.integration.helpers import local_stack

    with local_stack(kafka_bootstrap, tmp_path_factory.mktemp("stack")) as settings:
        yield settings


@pytest.fixture(scope="session")
def seed_python() -> Path:
    """The python of the seed's own virtualenv (Agent Lightning 0.3.0 from PyPI, cached)."""
    from tests.seed_venv import ensure_seed_venv

    return ensure_seed_venv()

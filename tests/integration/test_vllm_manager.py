"""The vLLM manager's managed restarts, against a real HTTP server process standing in for vLLM
(tests/fake_vllm_server.py: vLLM's flags, /health, /v1/models with the served folder as root)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from agl_stream.models import ModelCheckpoint
from agl_stream.ports import free_ports
from consumers.vllm_server import VllmManager, VllmOptions

pytestmark = pytest.mark.integration

FAKE_SERVER = Path(__file__).parents[1] / "fake_vllm_server.py"


def model_folder(root: Path, name: str, *, refuse: bool = False) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    if refuse:
        (folder / "refuse-to-start").write_text("")
    return folder


async def eventually(check: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait until ``check()`` holds (it reads state another task or process changes)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_each_offered_version_restarts_the_server_on_its_folder(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    options = VllmOptions(
        model_name="m",
        model=model_folder(tmp_path, "base"),
        port=port,
        follow=False,
        command=(sys.executable, str(FAKE_SERVER)),
        extra_args=("--enforce-eager",),
        ready_timeout_s=30,
        stop_timeout_s=10,
        poll_s=0.05,
    )
    manager = VllmManager(None, options)
    run = asyncio.create_task(manager.run())
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(base_url=url, trust_env=False) as http:

            async def served() -> str:
                card = (await http.get("/v1/models")).json()["data"][0]
                assert card["id"] == "m"
                return str(card["root"])

            await manager.wait_for_version(0, timeout=30)
            assert await served() == str(tmp_path / "base")
            first = manager.server.pid
            assert first is not None

            manager.offer(ModelCheckpoint(uri=str(model_folder(tmp_path, "v1")), model="m", policy_version=1))
            await manager.wait_for_version(1, timeout=30)
            assert await served() == str(tmp_path / "v1")
            assert manager.server.pid != first and not alive(first)  # stopped by its PID, not left behind

            # A version whose server cannot start is marked failed; the previous folder is served again.
            manager.offer(
                ModelCheckpoint(uri=str(model_folder(tmp_path, "v2", refuse=True)), model="m", policy_version=2)
            )
            await eventually(lambda: 2 in manager.failed and manager.server.running())
            assert manager.version == 1
            await eventually(lambda: manager.server.model == tmp_path / "v1")
            await manager.server.wait_ready(http)
            assert await served() == str(tmp_path / "v1")

            # A folder that is not a model is refused without touching the running server.
            running = manager.server.pid
            manager.offer(ModelCheckpoint(uri=str(tmp_path / "missing"), model="m", policy_version=3))
            await eventually(lambda: 3 in manager.failed)
            assert manager.server.pid == running

            # A server that dies is started again on the folder it served.
            restarts = manager.restarts
            assert running is not None
            os.kill(running, signal.SIGKILL)
            await eventually(lambda: manager.restarts > restarts and manager.server.pid not in (None, running))
            await manager.server.wait_ready(http)
            assert await served() == str(tmp_path / "v1")

            manager.offer(ModelCheckpoint(uri=f"file://{model_folder(tmp_path, 'v4')}", model="m", policy_version=4))
            await manager.wait_for_version(4, timeout=30)
            assert await served() == str(tmp_path / "v4")
            last = manager.server.pid
    finally:
        manager.stop()
        await asyncio.wait_for(run, 30)
    assert last is not None and not alive(last)
    async with httpx.AsyncClient(trust_env=False) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{url}/health")


async def test_the_first_start_fails_the_role_when_the_model_cannot_be_served(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    options = VllmOptions(
        model_name="m",
        model=model_folder(tmp_path, "broken", refuse=True),
        port=port,
        follow=False,
        command=(sys.executable, str(FAKE_SERVER)),
        poll_s=0.05,
    )
    with pytest.raises(Exception, match="exited with status 3"):
        await asyncio.wait_for(VllmManager(None, options).run(), 30)

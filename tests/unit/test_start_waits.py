"""Waiting for a starting process: as long as it lives, up to its start budget, with progress
that names it, and one clear error (what to do, the end of its log) when it exits or runs out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agl_stream.config import Settings
from agl_stream.errors import AglError
from agl_stream.local.processes import RoleGroup, RoleStartError, start_budget, wait_started
from agl_stream.ports import free_port

# A role that loads for a while (its heavy imports), saying so first, then serves /health.
SLOW_SERVER = """
import http.server, sys, time
print("loading the model", flush=True)
time.sleep(float(sys.argv[2]))  # the slow start under test, not a wait of the test's
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def _start(group: RoleGroup, name: str, role: str, *args: str) -> subprocess.Popen[bytes]:
    log = open(group.log_path(name), "wb")
    process = subprocess.Popen([sys.executable, "-c", *args], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    group.processes[name], group.roles[name] = process, role
    return process


def test_a_slow_role_is_waited_for_with_progress_naming_it(tmp_path: Path) -> None:
    lines: list[str] = []
    group = RoleGroup(Settings(data_dir=tmp_path, start_timeout_s=300), tmp_path, progress=lines.append)
    port = free_port()
    with group:
        _start(group, "inference", "inference", SLOW_SERVER, str(port), "3")
        group.wait_http("inference", f"http://127.0.0.1:{port}/health")
    assert lines, "no progress was reported while the role loaded"
    assert all(line.startswith("waiting for inference (http://127.0.0.1:") for line in lines)
    assert any("loading the model" in line for line in lines), lines[-3:]
    assert f"of {Settings().model_start_timeout_s:.0f} s" in lines[0]  # a model server's budget


def test_a_role_that_exits_while_starting_is_one_clear_error_with_its_log(tmp_path: Path) -> None:
    group = RoleGroup(Settings(data_dir=tmp_path), tmp_path)
    with group:
        _start(group, "runner-0", "runner", "import sys; print('no module named foo_agent'); sys.exit(3)")
        with pytest.raises(RoleStartError) as raised:
            group.wait_http("runner-0", f"http://127.0.0.1:{free_port()}/health")
    message = str(raised.value)
    first = message.splitlines()[0]
    assert first.startswith("runner-0 (the runner role, http://127.0.0.1:")
    assert "exited with code 3 while starting" in first and str(group.log_path("runner-0")) in first
    assert "no module named foo_agent" in message
    assert isinstance(raised.value, AglError)  # the CLI prints it as one error, not a traceback


def test_a_role_that_outlives_its_budget_says_which_setting_gives_it_more(tmp_path: Path) -> None:
    group = RoleGroup(Settings(data_dir=tmp_path, start_timeout_s=1.0), tmp_path)
    with group:
        process = _start(group, "llm-proxy", "llm-proxy", SLOW_SERVER, str(free_port()), "600")
        with pytest.raises(RoleStartError) as raised:
            group.wait_http("llm-proxy", "http://127.0.0.1:1/health")
        assert process.poll() is None  # alive: it was the budget that ran out
    first = str(raised.value).splitlines()[0]
    assert "was still starting after" in first and "its budget: 1 s" in first and "AGL_START_TIMEOUT_S" in first
    assert "loading the model" in str(raised.value)


def test_model_servers_get_the_model_budget() -> None:
    settings = Settings(start_timeout_s=100, model_start_timeout_s=900)
    assert start_budget(settings, "inference") == 900
    assert start_budget(settings, "gateway") == start_budget(settings, "llm-proxy") == 100


def test_wait_started_returns_the_first_ready_value(tmp_path: Path) -> None:
    answers = iter([None, None, {"ready": True}])
    value = wait_started(
        "a part", lambda: next(answers), budget_s=60, exit_code=lambda: None, log_path=tmp_path / "none.log"
    )
    assert value == {"ready": True}

"""Keeps the local stack's roles running: a role that exits is started again, with backoff.

Concurrency model: one process (``agl-stream supervise``, started by ``agl-stream up``), one
thread: a loop that polls its children every 0.2 s; signal handlers only set a flag.

The roles are its children; what runs is written to ``<run dir>/supervisor.json`` after every
change (pid, restarts, last exit of each role), which ``agl-stream status`` shows and ``up`` /
``down`` read. A role that exits is started again after a backoff that doubles from 0.5 s to
30 s while it keeps failing (a role that ran a minute counts as recovered). SIGTERM stops every
role (SIGTERM, then SIGKILL after 30 s) and then the supervisor.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agl_stream.config import Settings
from agl_stream.local.processes import start_role, stop_role
from agl_stream.logs import get_logger
from agl_stream.retry import RESTART

log = get_logger("agl.supervisor")

STATUS_FILE = "supervisor.json"
RECOVERED_AFTER_S = 60.0
_POLL_S = 0.2


def backoff(failures_in_a_row: int) -> float:
    """Seconds before starting a role again after its ``failures_in_a_row``-th exit in a row."""
    return RESTART.after(failures_in_a_row)


@dataclass
class RoleStatus:
    pid: int | None = None
    restarts: int = 0
    started_at: float = 0.0
    last_exit_code: int | None = None
    last_exit_at: float | None = None
    failing: int = 0  # exits in a row without a minute of running in between
    restart_at: float | None = None


class Supervisor:
    def __init__(self, settings: Settings, roles: list[str]) -> None:
        self.settings = settings
        self.roles = roles
        self.status = {role: RoleStatus() for role in roles}
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def run(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._stop)
        for role in self.roles:
            self._start(role)
        self._write()
        while not self.stopping:
            if self._check(time.time()):
                self._write()
            time.sleep(_POLL_S)  # polling children's exit status; the signal handler sets stopping
        for role in reversed(self.roles):
            child = self.children.get(role)
            if child is not None:
                self.status[role].last_exit_code = stop_role(child)
                self.status[role].pid = None
        self._write()
        log.info("supervisor stopped", restarts={r: s.restarts for r, s in self.status.items()})

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopping = True

    def _check(self, now: float) -> bool:
        changed = False
        for role in self.roles:
            state, child = self.status[role], self.children.get(role)
            if child is not None and child.poll() is not None:
                state.failing = 1 if now - state.started_at >= RECOVERED_AFTER_S else state.failing + 1
                state.last_exit_code, state.last_exit_at, state.pid = child.returncode, now, None
                state.restart_at = now + backoff(state.failing)
                del self.children[role]
                log.warning(
                    "role exited; starting it again",
                    role=role,
                    exit_code=child.returncode,
                    in_s=round(state.restart_at - now, 2),
                    restarts=state.restarts,
                )
                changed = True
            if role not in self.children and state.restart_at is not None and now >= state.restart_at:
                state.restarts += 1
                self._start(role)
                changed = True
        return changed

    def _start(self, role: str) -> None:
        child = start_role(self.settings, role, log_path=self.settings.run_dir / f"{role}.log")
        self.children[role] = child
        state = self.status[role]
        state.pid, state.started_at, state.restart_at = child.pid, time.time(), None

    def _write(self) -> None:
        data = {"pid": os.getpid(), "roles": {role: asdict(state) for role, state in self.status.items()}}
        path = self.settings.run_dir / STATUS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2))
        tmp.replace(path)  # readers never see half a file


def read_status(run_dir: Path) -> dict[str, RoleStatus]:
    """What the supervisor last wrote: each role's status (empty when there is none)."""
    try:
        data = json.loads((run_dir / STATUS_FILE).read_text())
        return {role: RoleStatus(**fields) for role, fields in data["roles"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def main(settings: Settings, roles: list[str]) -> None:
    """Run the supervisor in the foreground until SIGTERM/SIGINT (``agl-stream supervise``)."""
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    Supervisor(settings, roles).run()

"""How the agent given to ``Trainer.fit`` reaches the runner processes.

Runners are ``agl-stream runner`` processes: the library never imports a role, and a process
forked from a caller that has threads or an event loop (a notebook, rich's display, aiokafka) is
not safe to run anything in. So the agent travels, in this order of preference:

1. **pickled** into an agent file beside the run's logs (0600), with the runner hooks:
   ``cloudpickle`` when it is installed (it also carries functions and classes defined in
   ``__main__``, a notebook or a local scope, by value), else the standard ``pickle`` (module-
   level names only). Each runner gets the agent as it is when ``fit`` is called, as the seed's
   forked runners do. Limits: what the agent holds must pickle (no open clients, locks,
   sockets, or files: make them lazily, in the rollout); each runner has its own copy, so
   changes a runner makes to the agent stay in that runner; ``agent.trainer`` is not set there.
2. **by import spec** ``pkg.module:name`` when it cannot be pickled and it is a module-level
   name of an importable module (not ``__main__``): each runner imports that module, so it sees
   the agent as the module makes it (changes made after import are not carried).
3. A string given to ``fit`` is such a spec, used as it is.

The runner processes get the caller's ``sys.path`` (as ``PYTHONPATH``), so whatever the caller
could import, they can.

Stateless: functions of the agent and the run's directory.
"""

from __future__ import annotations

import importlib
import os
import pickle
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl_stream.agent.litagent import FunctionalLitAgent, Hook, LitAgent
from agl_stream.auth import write_private
from agl_stream.errors import TrainerError
from agl_stream.logs import get_logger

log = get_logger("agl.trainer")

AGENT_FILE_FORMAT = 1
"""The agent file's layout; ``consumers.runner.load_agent_file`` reads it (the same number there)."""

AGENT_FILE = "agent.pkl"
_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def as_agent(agent: Any) -> LitAgent[Any] | str:
    """What ``fit`` accepts as an agent: a LitAgent (or its class, made without arguments), a
    plain function (wrapped as ``@rollout`` would), or a ``pkg.module:name`` string."""
    if isinstance(agent, str):
        if not _SPEC.match(agent):
            raise TrainerError(f"agent {agent!r}: a string agent is an import spec 'pkg.module:name'")
        return agent
    if isinstance(agent, LitAgent):
        return agent
    if isinstance(agent, type) and issubclass(agent, LitAgent):
        return agent()
    if callable(agent):
        return FunctionalLitAgent(agent)
    raise TrainerError(
        f"a value of type {type(agent).__name__} is not an agent: give a LitAgent, a @rollout function "
        "or 'pkg.module:name'"
    )


def importable_spec(agent: Any) -> str | None:
    """``pkg.module:name`` under which importing gives this very object, if there is one."""
    modules = dict.fromkeys([getattr(agent, "__module__", None), type(agent).__module__])
    for module_name in modules:
        if not isinstance(module_name, str) or module_name in ("__main__", "__mp_main__", "builtins"):
            continue
        try:
            module = importlib.import_module(module_name)
        except Exception:  # a module that cannot be imported again cannot be a spec
            continue
        qualname = getattr(agent, "__qualname__", None)  # set on @rollout agents (update_wrapper)
        if isinstance(qualname, str) and "<locals>" not in qualname and _resolve(module, qualname) is agent:
            return f"{module_name}:{qualname}"
        for name, value in vars(module).items():
            if value is agent:
                return f"{module_name}:{name}"
    return None


def _resolve(module: Any, dotted: str) -> Any:
    target = module
    for part in dotted.split("."):
        target = getattr(target, part, None)
        if target is None:
            return None
    return target


def _dumps(payload: dict[str, Any]) -> bytes:
    try:
        import cloudpickle
    except ImportError:  # the standard pickle: module-level names only
        return pickle.dumps(payload)
    data: bytes = cloudpickle.dumps(payload)
    return data


def ship(agent: LitAgent[Any] | str, hooks: Sequence[Hook], directory: Path) -> list[str]:
    """The ``agl-stream runner`` arguments that give a runner this agent and these hooks.

    Writes ``directory/agent.pkl`` unless a bare spec will do. TrainerError when neither way
    works, with the pickling error and what to change.
    """
    hooks = list(hooks)
    if isinstance(agent, str):
        if not hooks:
            return ["--agent", agent]
        data, why = _pickle(agent=None, agent_spec=agent, hooks=hooks)
        if data is None:
            raise TrainerError(f"the runner hooks cannot be pickled for the runner processes: {why}")
    else:
        data, why = _pickle(agent=agent, agent_spec=None, hooks=hooks)
        if data is None:
            spec = importable_spec(agent)
            if spec is None:
                raise TrainerError(
                    f"the agent cannot reach the runner processes: it cannot be pickled ({why}), and it is no "
                    "module-level name of an importable module. Create clients, locks and files inside the rollout "
                    "(not in __init__), or define the agent at module level and pass 'pkg.module:name' to fit()"
                )
            log.warning("the agent cannot be pickled; runners import it by name instead", spec=spec, error=why)
            if not hooks:
                return ["--agent", spec]
            data, why = _pickle(agent=None, agent_spec=spec, hooks=hooks)
            if data is None:
                raise TrainerError(f"the runner hooks cannot be pickled for the runner processes: {why}")
    path = directory / AGENT_FILE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_private(path, data)
    return ["--agent-file", str(path)]


def _pickle(*, agent: LitAgent[Any] | None, agent_spec: str | None, hooks: list[Hook]) -> tuple[bytes | None, str]:
    """The agent file's bytes, or None and why pickling failed."""
    payload = {"format": AGENT_FILE_FORMAT, "agent": agent, "agent_spec": agent_spec, "hooks": hooks}
    try:
        return _dumps(payload), ""
    except Exception as error:  # pickling fails in many ways (PicklingError, TypeError, AttributeError...)
        return None, f"{type(error).__name__}: {error}"


def child_environment() -> dict[str, str]:
    """``PYTHONPATH`` for runner processes: this process's import path, so they import what it can."""
    entries = [entry for entry in sys.path if entry and os.path.isdir(entry)]
    inherited = os.environ.get("PYTHONPATH")
    if inherited:
        entries += [entry for entry in inherited.split(os.pathsep) if entry and entry not in entries]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(entries))}

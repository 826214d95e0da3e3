"""The agent API: ``LitAgent`` subclasses and the ``@rollout`` decorator, plus runner hooks.

A runner hands an agent three things per attempt: the task (the rollout's ``input``), the named
resources of the rollout's resources snapshot, and the rollout itself (an ``AttemptedRollout``).
A ``LitAgent`` receives all three; a function decorated with ``@rollout`` declares what it wants
by parameter type (or, without annotations, by the seed's parameter names):

    ``LLM`` / ``llm``                   the first LLM resource; a ``ProxyLLM`` becomes an ``LLM``
                                        whose endpoint is this attempt's proxy URL
    ``ProxyLLM``                        the first ProxyLLM resource, as it is
    ``PromptTemplate`` / ``prompt_template``  the first prompt template
    ``Rollout`` / ``rollout``           the rollout being run
    ``dict`` / ``resources``            all named resources

A parameter whose *name* is a resource name gets that resource (``policy: LLM`` picks
``resources["policy"]``), so agents with several LLMs can say which is which.

An agent returns ``None`` (the tracer captured everything), a number (the final reward, emitted
as a reward span), or a list of spans (agl ``Span`` records or OpenTelemetry ``ReadableSpan``).
"""

from __future__ import annotations

import functools
import inspect
import typing
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from agl_stream.models import LLM, PromptTemplate, ProxyLLM, Rollout

T = TypeVar("T")

RolloutResult = Any
"""``None``, a float reward, or a list of spans (see the module docstring)."""

NamedResources = Mapping[str, Any]


class LitAgent(Generic[T]):
    """Base class of agents: override ``rollout`` (or ``rollout_async``), or the mode-specific
    ``training_rollout``/``validation_rollout`` (and their ``_async`` forms).

    The runner calls ``training_rollout[_async]`` for rollouts in ``train`` mode and
    ``validation_rollout[_async]`` otherwise; by default both call ``rollout[_async]``.
    """

    _runner_ref: weakref.ReferenceType[Any] | None = None
    _trainer_ref: weakref.ReferenceType[Any] | None = None

    # The seed's accessors: the runner sets itself (and a trainer itself) on the agent it runs.
    def set_runner(self, runner: Any) -> None:
        self._runner_ref = weakref.ref(runner)

    def get_runner(self) -> Any:
        """The runner running this agent; ValueError before one is set (or once it is gone)."""
        return _deref(self._runner_ref, "runner")

    @property
    def runner(self) -> Any:
        return self.get_runner()

    def set_trainer(self, trainer: Any) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def get_trainer(self) -> Any:
        """The trainer this agent is trained by; ValueError before one is set."""
        return _deref(self._trainer_ref, "trainer")

    @property
    def trainer(self) -> Any:
        return self.get_trainer()

    def get_tracer(self) -> Any:
        """The tracer of this agent's runner (or of its trainer)."""
        owner = self.get_runner() if self._runner_ref is not None else self.get_trainer()
        return owner.tracer

    @property
    def tracer(self) -> Any:
        return self.get_tracer()

    def __getstate__(self) -> dict[str, Any]:
        # A Trainer ships the agent to runner processes by pickling it: the runner and trainer
        # it is attached to here stay here (weak references cannot be pickled anyway).
        state = dict(vars(self))
        state.pop("_runner_ref", None)
        state.pop("_trainer_ref", None)
        return state

    def is_async(self) -> bool:
        """Whether the runner should await the ``_async`` methods (true when any is overridden)."""
        cls = type(self)
        return any(
            getattr(cls, name) is not getattr(LitAgent, name)
            for name in ("rollout_async", "training_rollout_async", "validation_rollout_async")
        )

    def rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout() or rollout_async()")

    async def rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout() or rollout_async()")

    def training_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        return self.rollout(task, resources, rollout)

    def validation_rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        return self.rollout(task, resources, rollout)

    async def training_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        return await self.rollout_async(task, resources, rollout)

    async def validation_rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        return await self.rollout_async(task, resources, rollout)

    # Hooks on the agent itself (the seed's LitAgent has them too); runner hooks are ``Hook``.
    def on_rollout_start(self, task: T, rollout: Rollout) -> None:
        """Called before the rollout runs (default: nothing)."""

    def on_rollout_end(self, task: T, rollout: Rollout, spans: list[Any]) -> None:
        """Called after the rollout ran, with its spans (default: nothing)."""


def _deref(ref: weakref.ReferenceType[Any] | None, what: str) -> Any:
    found = ref() if ref is not None else None
    if found is None:
        raise ValueError(f"no {what} has been set for this agent (or it is gone)")
    return found


class Hook:
    """Runner hooks; override the ones you need. All are awaited; exceptions are logged, not raised.

    ``on_rollout_start`` runs before anything else of an attempt, ``on_trace_start`` inside the
    attempt's tracing context just before the agent, ``on_trace_end`` right after the agent
    (still inside the context: spans made there belong to the attempt), ``on_rollout_end``
    after the spans were flushed, with them, before the attempt's final status is reported.
    """

    async def on_rollout_start(self, *, agent: LitAgent[Any], runner: Any, rollout: Rollout) -> None:
        pass

    async def on_trace_start(self, *, agent: LitAgent[Any], runner: Any, tracer: Any, rollout: Rollout) -> None:
        pass

    async def on_trace_end(self, *, agent: LitAgent[Any], runner: Any, tracer: Any, rollout: Rollout) -> None:
        pass

    async def on_rollout_end(self, *, agent: LitAgent[Any], runner: Any, rollout: Rollout, spans: list[Any]) -> None:
        pass


@dataclass(frozen=True)
class _Wanted:
    """What one parameter of a decorated function asks for."""

    name: str
    kind: str  # "llm", "proxy_llm", "raw_llm", "prompt_template", "rollout", "resources", "named"
    required: bool


_BY_NAME = {"llm": "llm", "prompt_template": "prompt_template", "rollout": "rollout", "resources": "resources"}


def _kind_of(annotation: Any) -> str | None:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        kinds = {_kind_of(arg) for arg in typing.get_args(annotation) if arg is not type(None)}
        kinds.discard(None)
        return kinds.pop() if len(kinds) == 1 else None
    target = origin or annotation
    if not isinstance(target, type):
        return None
    if issubclass(target, ProxyLLM):
        return "proxy_llm"
    if issubclass(target, LLM):
        return "llm"
    if issubclass(target, PromptTemplate):
        return "prompt_template"
    if issubclass(target, Rollout):
        return "rollout"
    if issubclass(target, Mapping) or target is dict:
        return "resources"
    return None


def _wanted_parameters(func: Callable[..., Any]) -> list[_Wanted]:
    signature = inspect.signature(func)
    parameters = list(signature.parameters.values())
    if not parameters or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise TypeError(f"{func.__qualname__}: the first parameter of a rollout function must take the task")
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable forward references: fall back to parameter names
        hints = {}
    wanted = []
    for parameter in parameters[1:]:
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        kind = _kind_of(hints.get(parameter.name)) or _BY_NAME.get(parameter.name)
        required = parameter.default is inspect.Parameter.empty
        if kind is None:
            if required:
                # A resource named like the parameter may still fill it; checked per call.
                kind = "named"
            else:
                continue
        wanted.append(_Wanted(parameter.name, kind, required))
    return wanted


def _first(resources: NamedResources, types: tuple[type, ...]) -> Any:
    return next((value for value in resources.values() if isinstance(value, types)), None)


def _as_llm(resource: Any, rollout: Rollout) -> Any:
    """A ProxyLLM becomes a plain LLM pointed at this attempt's proxy URL (the seed's strip_proxy)."""
    attempt = getattr(rollout, "attempt", None)
    if isinstance(resource, ProxyLLM) and attempt is not None:
        return LLM(
            endpoint=resource.get_base_url(rollout.rollout_id, attempt.attempt_id),
            model=resource.model,
            api_key=resource.api_key,
            sampling_parameters=dict(resource.sampling_parameters),
        )
    return resource


def resolve_arguments(wanted: list[_Wanted], resources: NamedResources, rollout: Rollout) -> dict[str, Any]:
    """Keyword arguments for one call of a decorated function (ValueError names what is missing)."""
    arguments: dict[str, Any] = {}
    for want in wanted:
        named = resources.get(want.name)
        value: Any
        if want.kind == "rollout":
            value = rollout
        elif want.kind == "resources":
            value = dict(resources)
        elif want.kind == "llm":
            chosen = named if isinstance(named, (LLM, ProxyLLM)) else _first(resources, (LLM, ProxyLLM))
            value = _as_llm(chosen, rollout)
        elif want.kind == "proxy_llm":
            value = named if isinstance(named, ProxyLLM) else _first(resources, (ProxyLLM,))
        elif want.kind == "raw_llm":  # an LLM or ProxyLLM as published (llm_rollout(strip_proxy=False))
            value = named if isinstance(named, (LLM, ProxyLLM)) else _first(resources, (LLM, ProxyLLM))
        elif want.kind == "prompt_template":
            value = named if isinstance(named, PromptTemplate) else _first(resources, (PromptTemplate,))
        else:
            value = named
        if value is None:
            if want.required:
                have = ", ".join(f"{k} ({type(v).__name__})" for k, v in resources.items()) or "none"
                raise ValueError(
                    f"rollout parameter {want.name!r} wants a {want.kind} resource, and the rollout's resources "
                    f"have none (resources: {have}); publish one with store.add_resources/update_resources"
                )
            continue
        arguments[want.name] = value
    return arguments


class FunctionalLitAgent(LitAgent[T]):
    """A LitAgent made from one function by :func:`rollout`."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func = func
        self.wanted = _wanted_parameters(func)
        self._async = inspect.iscoroutinefunction(func)
        functools.update_wrapper(self, func)  # type: ignore[arg-type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **kwargs)

    def is_async(self) -> bool:
        return self._async

    def rollout(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        if self._async:
            raise RuntimeError(f"{self.func.__qualname__} is async: call rollout_async")
        return self.func(task, **resolve_arguments(self.wanted, resources, rollout))

    async def rollout_async(self, task: T, resources: NamedResources, rollout: Rollout) -> RolloutResult:
        if not self._async:
            raise RuntimeError(f"{self.func.__qualname__} is not async: call rollout")
        result: Awaitable[RolloutResult] = self.func(task, **resolve_arguments(self.wanted, resources, rollout))
        return await result


def rollout(func: Callable[..., Any]) -> FunctionalLitAgent[Any]:
    """Make an agent of a (sync or async) function ``f(task, ...resources by type...)``.

    >>> @rollout
    ... async def agent(task: dict, llm: LLM) -> float: ...
    """
    return FunctionalLitAgent(func)


@overload
def llm_rollout(func: Callable[..., Any], *, strip_proxy: bool = True) -> FunctionalLitAgent[Any]: ...
@overload
def llm_rollout(
    func: None = None, *, strip_proxy: bool = True
) -> Callable[[Callable[..., Any]], FunctionalLitAgent[Any]]: ...
def llm_rollout(
    func: Callable[..., Any] | None = None, *, strip_proxy: bool = True
) -> FunctionalLitAgent[Any] | Callable[[Callable[..., Any]], FunctionalLitAgent[Any]]:
    """The seed's ``@llm_rollout``: an agent ``f(task, llm[, rollout])``. ``llm`` is the first LLM
    resource; a ProxyLLM arrives as an LLM whose endpoint is this attempt's proxy URL (the seed's
    ``strip_proxy=True``); with ``strip_proxy=False`` it arrives as the ProxyLLM itself."""

    def make(f: Callable[..., Any]) -> FunctionalLitAgent[Any]:
        agent: FunctionalLitAgent[Any] = FunctionalLitAgent(f)
        if not strip_proxy:
            agent.wanted = [_Wanted(w.name, "raw_llm", w.required) if w.kind == "llm" else w for w in agent.wanted]
        return agent

    return make(func) if func is not None else make


@overload
def prompt_rollout(func: Callable[..., Any]) -> FunctionalLitAgent[Any]: ...
@overload
def prompt_rollout(func: None = None) -> Callable[[Callable[..., Any]], FunctionalLitAgent[Any]]: ...
def prompt_rollout(
    func: Callable[..., Any] | None = None,
) -> FunctionalLitAgent[Any] | Callable[[Callable[..., Any]], FunctionalLitAgent[Any]]:
    """The seed's ``@prompt_rollout``: an agent ``f(task, prompt_template[, rollout])`` whose
    prompt template an algorithm tunes (the first prompt template resource)."""
    return FunctionalLitAgent(func) if func is not None else FunctionalLitAgent

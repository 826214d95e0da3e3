"""Built-in algorithms by name: ``Trainer(algorithm="baseline")`` or
``Trainer(algorithm={"name": "baseline", "n_epochs": 2})``.

A plain mapping of names to classes (no import strings): what is registered is what this
package imported. ``"verl"`` and ``"grpo"`` are both :class:`VERL` (GRPO is its default
estimator): ``Trainer(algorithm={"name": "verl", "config": {...}})``. ``"apo"`` is :class:`APO`:
``Trainer(algorithm={"name": "apo", "gradient_model": ..., "beam_rounds": 2})``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agl_stream.algorithm.apo import APO
from agl_stream.algorithm.base import Algorithm
from agl_stream.algorithm.baseline import Baseline
from agl_stream.algorithm.verl import VERL
from agl_stream.errors import AlgorithmError

AlgorithmFactory = Callable[..., Algorithm]

ALGORITHMS: dict[str, AlgorithmFactory] = {"baseline": Baseline, "verl": VERL, "grpo": VERL, "apo": APO}
"""Name (lower case) -> factory taking the algorithm's keyword arguments."""


def register_algorithm(name: str, factory: AlgorithmFactory) -> None:
    """Offer ``factory`` under ``name`` (case-insensitive); a name is registered once."""
    key = name.lower()
    if key in ALGORITHMS and ALGORITHMS[key] is not factory:
        raise AlgorithmError(f"an algorithm named {name!r} is registered already ({ALGORITHMS[key]!r})")
    ALGORITHMS[key] = factory


def make_algorithm(spec: Any) -> Algorithm | None:
    """An algorithm from what ``Trainer(algorithm=...)`` accepts.

    ``spec``: an Algorithm (as it is), an Algorithm subclass (made without arguments), a
    registered name, a mapping ``{"name": ..., **keyword arguments}`` (``"type"`` is accepted
    for the name, as the seed's configs spell it), or None (no algorithm).
    """
    if spec is None or isinstance(spec, Algorithm):
        return spec
    if isinstance(spec, type) and issubclass(spec, Algorithm):
        return spec()
    if isinstance(spec, str):
        return _factory(spec)()
    if isinstance(spec, Mapping):
        arguments = dict(spec)
        name = arguments.pop("name", None) or arguments.pop("type", None)
        if not isinstance(name, str):
            raise AlgorithmError(f"an algorithm mapping names its algorithm with 'name', got keys {sorted(spec)}")
        try:
            return _factory(name)(**arguments)
        except TypeError as error:
            if isinstance(error, AlgorithmError):
                raise
            raise AlgorithmError(f"algorithm {name!r} does not take these arguments: {error}") from error
    if callable(spec):
        raise AlgorithmError(
            f"{getattr(spec, '__qualname__', spec)!r} is a plain function: decorate it with @agl.algo to make it an "
            "algorithm (it gets store, train_dataset, val_dataset... by parameter name)"
        )
    raise AlgorithmError(
        f"a value of type {type(spec).__name__} is not an algorithm: give an Algorithm, a name or a mapping"
    )


def _factory(name: str) -> AlgorithmFactory:
    try:
        return ALGORITHMS[name.lower()]
    except KeyError:
        raise AlgorithmError(f"no algorithm named {name!r}; registered: {sorted(ALGORITHMS)}") from None

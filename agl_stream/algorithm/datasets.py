"""Datasets of tasks: what ``Trainer.fit`` accepts, turned into one list of JSON-able tasks, and
the order an algorithm runs them in over its epochs.

A task becomes a rollout's ``input``, which travels as JSON (Avro string) through Kafka, so a
dataset must hold JSON-able values; a task that is not is refused here, with its position,
before anything is enqueued. Accepted sources (duck-typed: no dataset library is imported):

- a list or tuple, or any sized and indexable sequence of tasks;
- a Hugging Face ``datasets.Dataset`` (``to_list()``), a pyarrow ``Table`` (``to_pylist()``) or a
  pandas ``DataFrame`` (one dict per row);
- a path (``str`` or ``os.PathLike``) to a JSON-lines file (``.jsonl``, ``.ndjson``: one task
  per line), a JSON file holding one array (``.json``), or a parquet file (``.parquet``, read
  with pyarrow when it is installed);
- any other iterable of tasks (a generator), read once.

Pure functions over values, besides reading the file a path names.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agl_stream.errors import DatasetError

TaskDataset = Sequence[Any]
"""A loaded dataset: tasks (rollout inputs), each JSON-able."""

JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})


def load_dataset(source: Any, *, name: str = "dataset") -> list[Any] | None:
    """``source`` as a list of tasks (None stays None). ``name`` names it in errors.

    Raises DatasetError for a missing or unreadable file, an unknown file type, a value that is
    no dataset (a dict, a string that names no file, a number) or a task that is not JSON.
    """
    if source is None:
        return None
    tasks = _read(source, name)
    for index, task in enumerate(tasks):
        _check_json(task, index, name)
    return tasks


def _read(source: Any, name: str) -> list[Any]:
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source), name)
    if isinstance(source, (bytes, bytearray)):
        raise DatasetError(f"{name}: bytes are not a dataset; give a list of tasks or a file path")
    if isinstance(source, Mapping):
        # A dict is most likely one task, or columns of a table: either way not a sequence of tasks.
        raise DatasetError(
            f"{name}: a dict is not a dataset; give a list of tasks (wrap a single task in a list: [task])"
        )
    for method, arguments in (("to_list", ()), ("to_pylist", ())):
        convert = getattr(source, method, None)
        if callable(convert):  # Hugging Face datasets.Dataset, pyarrow.Table: rows as dicts
            rows = convert(*arguments)
            if isinstance(rows, list):
                return rows
    if callable(getattr(source, "to_dict", None)) and hasattr(source, "columns"):  # a pandas DataFrame
        return list(source.to_dict("records"))
    if isinstance(source, Sequence):
        return list(source)
    if hasattr(source, "__len__") and hasattr(source, "__getitem__"):
        return [source[index] for index in range(len(source))]
    if isinstance(source, Iterable):
        return list(source)
    raise DatasetError(
        f"{name}: a value of type {type(source).__name__} is not a dataset; give a list of tasks, "
        "a Hugging Face dataset, or the path of a .jsonl, .json or .parquet file"
    )


def _read_file(path: Path, name: str) -> list[Any]:
    if not path.is_file():
        raise DatasetError(f"{name}: no such file {path} (a string dataset is a file path)")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _read_jsonl(path, name)
    if suffix == ".json":
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as error:
            raise DatasetError(f"{name}: cannot read {path} as JSON: {error}") from error
        if not isinstance(value, list):
            raise DatasetError(f"{name}: {path} holds a JSON {type(value).__name__}; a dataset file holds one array")
        return value
    if suffix == ".parquet":
        return _read_parquet(path, name)
    raise DatasetError(f"{name}: {path} is neither .jsonl, .ndjson, .json nor .parquet")


def _read_jsonl(path: Path, name: str) -> list[Any]:
    tasks = []
    try:
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, separators) hold no task
                try:
                    tasks.append(json.loads(line))
                except ValueError as error:
                    raise DatasetError(f"{name}: {path} line {number} is not JSON: {error}") from error
    except (OSError, UnicodeDecodeError) as error:
        raise DatasetError(f"{name}: cannot read {path}: {error}") from error
    return tasks


def _read_parquet(path: Path, name: str) -> list[Any]:
    try:
        import pyarrow.parquet as parquet
    except ImportError as error:
        raise DatasetError(f"{name}: reading {path} needs pyarrow (pip install pyarrow)") from error
    try:
        rows = parquet.read_table(path).to_pylist()
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid is a ValueError
        raise DatasetError(f"{name}: cannot read {path} as parquet: {error}") from error
    return list(rows)


def _check_json(task: Any, index: int, name: str) -> None:
    try:  # allow_nan=False: NaN and infinities are not JSON (other readers of the input reject them)
        json.dumps(task, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise DatasetError(
            f"{name}[{index}] is not JSON ({error}); tasks travel as JSON: use dicts, lists, strings, numbers"
        ) from error


def epoch_orders(size: int, *, epochs: int = 1, shuffle: bool = False, seed: int | None = 0) -> list[list[int]]:
    """The order of the dataset's indices in each epoch: ``epochs`` lists of ``range(size)``.

    ``shuffle``: each epoch in a new random order, from one generator seeded with ``seed``, so the
    same seed gives the same orders on every run (``seed=None``: a different order every run).
    """
    if epochs < 1:
        raise DatasetError(f"epochs must be at least 1, got {epochs}")
    if size < 0:
        raise DatasetError(f"a dataset size is not negative, got {size}")
    generator = random.Random(seed)
    orders = []
    for _ in range(epochs):
        order = list(range(size))
        if shuffle:
            generator.shuffle(order)
        orders.append(order)
    return orders

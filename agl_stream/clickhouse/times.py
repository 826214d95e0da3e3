"""The tables' times in SQL: ``DateTime64(6, 'UTC')`` columns, float seconds to the models.

The state and training tables keep times as DateTime64 (infra/clickhouse/011_datetime_times.sql),
so SQL reads them as times; the models and the seed's API hold float seconds since the epoch.
Readers that hand rows to a model, or to the dashboard's browser code, select a time through
:func:`seconds`; everything else (filters, ORDER BY, arithmetic with seconds) works on the
column as it is, since the engine compares a DateTime64 with a number of seconds.

Pure text builders: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

TYPE = "DateTime64(6, 'UTC')"
"""The type of every time column of the state and training tables."""

TIME_COLUMNS = frozenset(
    {
        # rollouts, attempts, resources, workers
        "start_time",
        "end_time",
        "cause_time",
        "finished_time",
        "last_heartbeat_time",
        "create_time",
        "update_time",
        "last_dequeue_time",
        "last_busy_time",
        "last_idle_time",
        # triplets, triplet_records, batches, trainer_steps, dead_letters
        "finish_time",
        "created_time",
        "step_time",
        "time",
    }
)
"""Column names that are DateTime64 in every table that has them."""


def seconds(expression: str) -> str:
    """SQL for a DateTime64 (or Nullable) as float seconds since the epoch, to the microsecond
    (NULL stays NULL)."""
    return f"toUnixTimestamp64Micro({expression}) / 1e6"


def select(columns: Iterable[str], prefix: str = "") -> str:
    """A select list of ``columns`` (of table alias ``prefix``, if any) under their own names,
    the time columns as float seconds."""
    terms = []
    for column in columns:
        qualified = f"{prefix}.{column}" if prefix else column
        if column in TIME_COLUMNS:
            terms.append(f"{seconds(qualified)} AS {column}")
        else:
            terms.append(f"{qualified} AS {column}" if prefix else column)
    return ", ".join(terms)


def micros(value: float) -> int:
    """Float seconds as the microsecond ticks of a DateTime64(6) (for rows inserted from Python),
    to the nearest microsecond, as the ingest SQL converts them and the models keep them
    (:data:`agl_stream.models.base.StoredSeconds`)."""
    return round(value * 1_000_000)

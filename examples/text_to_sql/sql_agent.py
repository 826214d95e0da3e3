"""A text-to-SQL agent over a small SQLite database, rewarded by execution match.

Spider's way of scoring: the predicted query is right when it returns the same result as the
gold query on the database (:func:`execution_match`), whatever its text. The agent shows the
model the schema and the question, runs the query the model writes (read-only, time- and
row-bounded), and when the query fails or returns nothing, shows the model what happened and
lets it rewrite the query (``MAX_REWRITES`` times). A query that is not SQL, fails or
tries to write is reward 0, never a crashed rollout. Each execution is a span (``sql.execute``:
the query, the row count or the error).

The database is built from ``library.sql`` once per process into a temporary folder (nothing is
written into the example's folder) and only ever opened with SQLite's ``mode=ro``. Tasks are
``{"id", "db", "question", "gold_sql"}`` (``data/*.jsonl``).
"""

from __future__ import annotations

import json
import re
import sqlite3
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace

import agl_stream as agl
from agl_stream.models import LLM

HERE = Path(__file__).resolve().parent
TRAIN_FILE = HERE / "data" / "train.jsonl"
VAL_FILE = HERE / "data" / "val.jsonl"
SCRIPTS = {"library": HERE / "library.sql"}
"""Each task's ``db`` names one of these scripts (one database, as Spider tasks name theirs)."""

MAX_REWRITES = 1
"""Further model calls after a query that failed or returned no rows (Spider agents' check-and-rewrite)."""

MAX_TOKENS = 256
QUERY_TIMEOUT_S = 2.0
MAX_ROWS = 1000
"""Rows read of a result: more is not a plausible answer here, and comparing is then cut short."""

SYSTEM_PROMPT = "Write one SQLite query that answers the question. Reply with the query in a ```sql block.\n\n{schema}"

Row = tuple[Any, ...]


class QueryError(Exception):
    """The query cannot run on the database (SQLite's message, or the limit it hit)."""


# -- the database --------------------------------------------------------------------------------


def schema_text(script: str) -> str:
    """The ``CREATE TABLE`` statements of a script, which is what the model is shown."""
    return "\n\n".join(m.group(0).strip() for m in re.finditer(r"CREATE TABLE.*?\);", script, re.DOTALL | re.I))


def build_database(script: Path, target: Path) -> Path:
    """Create the SQLite file ``target`` from ``script`` (written beside it, then renamed, so a
    reader never sees half a database)."""
    partial = target.with_suffix(".partial")
    partial.unlink(missing_ok=True)
    connection = sqlite3.connect(partial)
    try:
        connection.executescript(script.read_text())
        connection.commit()
    finally:
        connection.close()
    partial.replace(target)
    return target


_databases: dict[str, Path] = {}
_databases_lock = threading.Lock()
_folder: tempfile.TemporaryDirectory[str] | None = None


def database(name: str) -> Path:
    """The SQLite file of database ``name``, built at first use in this process (and removed
    with the process's temporary folder when it exits)."""
    global _folder
    with _databases_lock:  # runners may run attempts in threads
        if name not in _databases:
            if name not in SCRIPTS:
                raise KeyError(f"unknown database {name!r}; known: {sorted(SCRIPTS)}")
            if _folder is None:
                _folder = tempfile.TemporaryDirectory(prefix="agl-text-to-sql-")
            _databases[name] = build_database(SCRIPTS[name], Path(_folder.name) / f"{name}.sqlite")
        return _databases[name]


def run_query(db_path: Path, sql: str, *, timeout_s: float = QUERY_TIMEOUT_S, max_rows: int = MAX_ROWS) -> list[Row]:
    """The rows of one SQL statement, on a read-only connection; :class:`QueryError` otherwise.

    Read-only three times over: SQLite opens the file with ``mode=ro``, ``query_only`` refuses
    writes, and an authorizer refuses every action but reading (no ATTACH, PRAGMA, writes). A
    statement running past ``timeout_s`` is interrupted (a progress handler), and at most
    ``max_rows`` rows are read. Only one statement runs (SQLite refuses a second).
    """
    try:
        connection = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error as error:
        raise QueryError(f"cannot open the database: {error}") from None
    deadline = time.monotonic() + timeout_s
    try:
        connection.execute("PRAGMA query_only = ON")
        # mode=ro and query_only stop writes to this database, not ATTACH (which creates a file
        # of its own) or PRAGMAs: the authorizer lets a statement read, and nothing else.
        connection.set_authorizer(_read_only)
        connection.set_progress_handler(lambda: 1 if time.monotonic() > deadline else 0, 10_000)
        cursor = connection.execute(sql)
        return [tuple(row) for row in cursor.fetchmany(max_rows)]
    except sqlite3.Error as error:
        if time.monotonic() > deadline:
            raise QueryError(f"the query ran longer than {timeout_s:g}s") from None
        raise QueryError(str(error) or type(error).__name__) from None
    except (ValueError, OverflowError) as error:  # NUL characters, integers SQLite cannot hold
        raise QueryError(str(error)) from None
    finally:
        connection.close()


_READING = frozenset({sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE})


def _read_only(action: int, *_names: str | None) -> int:
    return sqlite3.SQLITE_OK if action in _READING else sqlite3.SQLITE_DENY


# -- comparing results ------------------------------------------------------------------------------


def _normalized(value: Any) -> Any:
    # 2 and 2.0 compare (and hash) equal already; floats are rounded so that AVG's last digits
    # and a SUM computed in another order do not decide the match.
    if isinstance(value, float):
        return round(value, 6)
    if isinstance(value, bytes):
        return value.hex()
    return value


def results_match(predicted: Sequence[Row], gold: Sequence[Row], *, ordered: bool) -> bool:
    """Whether two results are the same: as lists of rows when the gold query orders them,
    else as multisets of rows (row order is then the engine's choice, not an answer)."""
    left = [tuple(_normalized(v) for v in row) for row in predicted]
    right = [tuple(_normalized(v) for v in row) for row in gold]
    if ordered:
        return left == right
    return Counter(left) == Counter(right)


def is_ordered(sql: str) -> bool:
    """Whether the outermost query orders its rows (an ORDER BY outside any parentheses)."""
    depth = 0
    for token in re.findall(r"\(|\)|'(?:[^']|'')*'|\bORDER\s+BY\b", sql, re.IGNORECASE):
        if token == "(":
            depth += 1
        elif token == ")":
            depth -= 1
        elif not token.startswith("'") and depth == 0:
            return True
    return False


def execution_match(db_path: Path, predicted_sql: str | None, gold_sql: str) -> bool:
    """Whether the predicted query returns what the gold query returns; a query that does not
    run is no match. (A gold query that fails is the dataset's bug: :class:`QueryError`.)"""
    gold = run_query(db_path, gold_sql)
    if not predicted_sql:
        return False
    try:
        predicted = run_query(db_path, predicted_sql)
    except QueryError:
        return False
    return results_match(predicted, gold, ordered=is_ordered(gold_sql))


# -- reading the model's reply ------------------------------------------------------------------------

_FENCED = re.compile(r"```(?:sql|sqlite)?\s*\n?(.*?)```", re.DOTALL | re.IGNORECASE)
_BARE = re.compile(r"\b(SELECT|WITH)\b.*", re.DOTALL | re.IGNORECASE)


def extract_sql(reply: str | None) -> str | None:
    """The query in a reply: the last fenced block, else the text from the first SELECT/WITH;
    trailing semicolons and whitespace removed. None when there is none."""
    if not reply:
        return None
    blocks = [block.strip() for block in _FENCED.findall(reply) if block.strip()]
    if blocks:
        sql = blocks[-1]
    else:
        bare = _BARE.search(reply)
        if bare is None:
            return None
        sql = bare.group(0).strip()
    sql = sql.rstrip().rstrip(";").strip()
    return sql or None


def load_tasks(path: Path) -> list[dict[str, Any]]:
    """The tasks of a JSON-lines file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _preview(rows: list[Row], limit: int = 5) -> str:
    shown = "\n".join(", ".join(repr(v) for v in row) for row in rows[:limit])
    more = f"\n... ({len(rows)} rows)" if len(rows) > limit else ""
    return shown + more


# -- the agent -----------------------------------------------------------------------------------------


def _sampling(llm: LLM) -> dict[str, Any]:
    allowed = ("temperature", "top_p", "max_tokens", "seed")
    sampling = {k: v for k, v in llm.sampling_parameters.items() if k in allowed}
    sampling.setdefault("max_tokens", MAX_TOKENS)
    return sampling


@agl.rollout
async def sql_agent(task: dict[str, Any], llm: LLM) -> float:
    """Write a query for the question, check it by running it, rewrite it once if it failed;
    the reward is the final query's execution match with the gold query (0 or 1)."""
    from openai import AsyncOpenAI  # imported in the runner only

    db_path = database(task.get("db", "library"))
    tracer = trace.get_tracer("examples.text_to_sql")
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=1)
    script = SCRIPTS[task.get("db", "library")].read_text()
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT.format(schema=schema_text(script))},
        {"role": "user", "content": task["question"]},
    ]
    sql: str | None = None
    try:
        for call in range(1 + MAX_REWRITES):
            response = await client.chat.completions.create(
                model=llm.model,
                messages=messages,  # type: ignore[arg-type]
                **_sampling(llm),
            )
            reply = response.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": reply})
            sql = extract_sql(reply)
            with tracer.start_as_current_span("sql.execute") as span:
                span.set_attribute("sql.attempt", call + 1)
                span.set_attribute("sql.query", sql or "")
                if sql is None:
                    feedback = "There is no SQL query in your reply. Reply with one query in a ```sql block."
                    span.set_attribute("sql.error", "no query in the reply")
                else:
                    try:
                        rows = run_query(db_path, sql)
                    except QueryError as error:
                        feedback = f"The query failed: {error}. Write a corrected query."
                        span.set_attribute("sql.error", str(error))
                    else:
                        span.set_attribute("sql.rows", len(rows))
                        if rows:
                            break  # it runs and answers something: the model's final query
                        feedback = "The query returned no rows. Check it and write the final query."
            messages.append({"role": "user", "content": feedback})
    finally:
        await client.close()
    return 1.0 if execution_match(db_path, sql, task["gold_sql"]) else 0.0

"""``GET/POST /v1/sql``: read-only SQL analytics on the gateway (docs/sql.md).

- ``GET /v1/sql?query=...&format=json|jsonl|csv|table&timeout=s``
- ``POST /v1/sql`` with ``{"query", "format", "timeout"}`` as JSON (JSON only, at most
  ``MAX_SQL_BODY_BYTES``: a web page can send text/plain anywhere without asking, JSON it cannot).

Formats: ``json`` ``{"columns", "rows", "row_count", "elapsed_ms"}``, ``jsonl`` one object per row,
``csv`` with a header line, ``table`` aligned text. Errors are JSON ``{"error", "message", ...}``:
400 ``query_error`` (ClickHouse could not run it), 403 ``read_only`` (a write, DDL, SET, or not a
single SELECT), 403 ``forbidden_function`` (a function or table function off the allow-list),
403 ``forbidden_table`` (a table outside the agl database, e.g. ``system.*``), 408 ``timeout``
(over the time limit), 413 ``too_large`` (over the memory or result limits), 503 while the
gateway stops.

``SHOW TABLES`` and ``DESCRIBE <table>`` within the agl database (as ``formatQuery`` writes
them) are answered by fixed queries on the engine's catalog bound to that database
(``schema_statement``); a newcomer finds the schema without ``system.*`` being opened.

Every check is ClickHouse's own, none reads the SQL text here:

1. ``formatQuery({q:String})`` (the SQL is a bound parameter): the engine parses it as exactly one
   statement and gives back its canonical text (balanced quotes, no comments).
2. ``EXPLAIN AST <canonical>`` (a parse: nothing is evaluated yet): a statement that is not a
   SELECT is refused as read_only; every function must be on the allow-list built from the
   engine's catalog (``FunctionPolicy``: no files, network, host or server state, settings,
   dictionaries, sleeping) and every table named with a database must be in agl.
3. ``EXPLAIN QUERY TREE SELECT * FROM (<canonical>)``, under the memory and time limits (the
   analyzer evaluates constant expressions): the engine accepts it only if the statement
   is one SELECT usable as a subquery (so no INSERT/DDL/SHOW, and no ``INTO OUTFILE`` or
   ``FORMAT``: chDB writes ``INTO OUTFILE`` files even with ``readonly=1``), and its analyzer
   resolves every table, view, CTE and subquery to ``table_name: db.table`` /
   ``table_function_name: f`` nodes. A query that reads anything but the agl database (and
   ``system.one``, what ``SELECT 1`` reads) or a table function outside a small harmless set is
   refused. This is how the embedded engine keeps ``system.*`` out: chDB has no access control to
   configure (no CREATE USER, ``select_from_system_db_requires_grant`` is a server setting it
   does not load). On a ClickHouse server, use a user granted only ``SELECT ON agl.*`` as well
   (docs/sql.md, "Access").
4. The canonical statement runs on a client of its own with ``readonly=1`` (``readonly=2`` on a
   server) and the limits ``max_execution_time`` (the request's timeout, capped by
   ``sql_time_limit_s``), ``max_memory_usage``, ``max_result_rows``/``max_result_bytes``
   (``result_overflow_mode=throw``). The checks run on a second readonly client without result
   limits, so a long query tree never trips them. Clients cost ~8 ms to open on chDB.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import math
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from datetime import time as dtime
from typing import Annotated, Any, Literal, TypeVar

from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError
from rich import box
from rich.console import Console
from rich.table import Table

from agl_stream.clickhouse.access import MAX_RANGE_ELEMENTS
from agl_stream.clickhouse.client import get_client
from agl_stream.config import Settings
from agl_stream.errors import QueryError
from agl_stream.http_serving import BodyTooLargeError, Refusal, Serving, answering, error_json, read_body

SqlFormat = Literal["json", "jsonl", "csv", "table"]

ALLOWED_TABLE_FUNCTIONS = frozenset(
    {"numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateseries", "values", "null"}
)
"""Table functions that read nothing but their arguments. Others (merge, view, remote, cluster,
dictionary, s3, ...) could read system tables or other databases."""

ALWAYS_READABLE = frozenset({"system.one"})

MAX_SQL_BODY_BYTES = 1 << 20
"""A question, not data: a larger POST /v1/sql body is refused (413)."""
"""What a query without FROM reads."""

ALLOWED_CATEGORIES = frozenset(
    {
        "Aggregate Functions", "Arithmetic", "Arrays", "Bit", "Bitmap", "Comparison", "Conditional",
        "Dates and Times", "Distance", "Encoding", "Financial", "Geo", "Geo Polygon", "Hash",
        "IP Address", "JSON", "Logical", "Map", "Mathematical", "Null", "NumericIndexedVector", "QBit",
        "Random Number", "Rounding", "String", "String Replacement", "String Search", "String Splitting",
        "Time Series", "Time Window", "Tuple", "Type Conversion", "URL", "UUID",
    }
)  # fmt: skip
"""Categories of the engine's function catalog (``system.functions``) that compute on their
arguments only. Left out: "Other" (files, settings, host and server state, sleeping; the safe
ones are listed in SAFE_OTHER_FUNCTIONS), dictionaries (which read files and other databases),
introspection, AI and ML models, encryption, internal functions, and anything uncategorised."""

SAFE_OTHER_FUNCTIONS = frozenset(
    {
        "bar", "byteSize", "countDigits", "defaultValueOfArgumentType", "defaultValueOfTypeName",
        "finalizeAggregation", "formatReadableDecimalSize", "formatReadableQuantity", "formatReadableSize",
        "formatReadableTimeDelta", "getSizeOfEnumType", "getSubcolumn", "identity", "ignore", "indexHint",
        "initializeAggregation", "isConstant", "isDecimalOverflow", "materialize", "neighbor",
        "parseISO8601Duration", "parseReadableSize", "parseReadableSizeOrNull", "parseReadableSizeOrZero",
        "parseTimeDelta", "rowNumberInAllBlocks", "rowNumberInBlock", "runningAccumulate", "runningDifference",
        "runningDifferenceStartingWithFirstValue", "throwIf", "toColumnTypeName", "toTypeName", "transform",
        "variantElement", "variantType", "visibleWidth",
    }
)  # fmt: skip
"""Functions of the "Other" category that read nothing but their arguments."""

SYNTAX_FUNCTIONS = frozenset({"lambda", "exists", "untuple", "grouping", "_CAST", "caseWithExpression"})
"""What the parser writes as functions without a catalog entry (``x -> ...``, ``EXISTS``) or as
internal ones (``x::T`` is ``_CAST``, ``CASE x WHEN ...`` is ``caseWithExpression``)."""

AGGREGATE_COMBINATORS = (
    "If", "Array", "Map", "SimpleState", "MergeState", "State", "Merge", "ForEach", "Distinct",
    "OrDefault", "OrNull", "Resample", "ArgMin", "ArgMax",
)  # fmt: skip
"""Suffixes that make an aggregate function out of another (``countIf``, ``sumArrayIf``, ...)."""

# ClickHouse error codes -> (HTTP status, error kind).
_STATUS_BY_CODE: dict[int, tuple[int, str]] = {
    159: (408, "timeout"),  # TIMEOUT_EXCEEDED
    241: (413, "too_large"),  # MEMORY_LIMIT_EXCEEDED
    396: (413, "too_large"),  # TOO_MANY_ROWS_OR_BYTES
    164: (403, "read_only"),  # READONLY
    497: (403, "forbidden_table"),  # ACCESS_DENIED (a server user without the grant)
}

_TABLE = re.compile(r"\btable_name: ([^,\s]+)")
_TABLE_FUNCTION = re.compile(r"\btable_function_name: ([^,\s]+)")
_AST_FUNCTION = re.compile(r"^\s*Function (\S+)")
_AST_TABLE = re.compile(r"^\s*TableIdentifier (\S+)")
_AST_IDENTIFIER = re.compile(r"^\s*Identifier (\S+)")


class SqlRefusedError(QueryError):
    """The query is refused before it runs: not one SELECT, or it reads outside the agl database."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class SqlResult:
    columns: list[str]
    types: list[str]
    rows: list[list[Any]]
    elapsed_ms: float


@dataclass(frozen=True)
class SqlLimits:
    time_limit_s: float
    max_memory_bytes: int
    max_result_rows: int
    max_result_bytes: int

    @classmethod
    def of(cls, settings: Settings) -> SqlLimits:
        return cls(
            settings.sql_time_limit_s,
            settings.sql_max_memory_bytes,
            settings.sql_max_result_rows,
            settings.sql_max_result_bytes,
        )

    def time_limit(self, timeout: float | None) -> float:
        """Seconds a query may take from check to answer; ``timeout`` can only shorten it."""
        return self.time_limit_s if timeout is None else min(timeout, self.time_limit_s)

    def checking(self, seconds: float) -> dict[str, Any]:
        """ClickHouse settings for the checks (building a query tree evaluates constants)."""
        return {
            "max_execution_time": round(seconds, 3),
            "max_memory_usage": self.max_memory_bytes,
            "function_range_max_elements_in_block": MAX_RANGE_ELEMENTS,
        }

    def execution(self, seconds: float) -> dict[str, Any]:
        """ClickHouse settings for the query itself, with ``seconds`` left of its time limit."""
        return {
            **self.checking(seconds),
            "max_result_rows": self.max_result_rows,
            "max_result_bytes": self.max_result_bytes,
            "result_overflow_mode": "throw",
        }


T = TypeVar("T")

ABANDON_GRACE_S = 1.0
"""How long past its time limit a query's caller waits before it gets its 408 regardless."""


# -- functional core: what the engine's analysis says a query reads ---------------------------


def objects_read(query_tree: Sequence[str]) -> tuple[set[str], set[str]]:
    """Tables (``db.name``) and table functions in ``EXPLAIN QUERY TREE`` output lines."""
    tables: set[str] = set()
    functions: set[str] = set()
    for line in query_tree:
        tables.update(_TABLE.findall(line))
        functions.update(f.lower() for f in _TABLE_FUNCTION.findall(line))
    return tables, functions


def refusal(tables: set[str], functions: set[str], database: str) -> str | None:
    """Why a query reading ``tables`` and ``functions`` is refused, or None when it may run."""
    outside = _outside(tables, database)
    unsafe = sorted(functions - ALLOWED_TABLE_FUNCTIONS)
    reasons = []
    if outside:
        reasons.append(_reads_outside(outside, database))
    if unsafe:
        reasons.append(f"it uses the table function(s) {', '.join(unsafe)}")
    return _refused(reasons, database) if reasons else None


def _outside(tables: Iterable[str], database: str) -> list[str]:
    """The tables named with a database other than ``database`` (what SELECT 1 reads aside)."""
    return sorted(t for t in tables if not t.startswith(f"{database}.") and t not in ALWAYS_READABLE)


def _reads_outside(outside: list[str], database: str) -> str:
    return f"it reads {', '.join(outside)}, outside the database {database}"


def _refused(reasons: list[str], database: str) -> str:
    return "refused: " + " and ".join(reasons) + f"; analytics may read the tables of {database} only"


@dataclass(frozen=True)
class FunctionPolicy:
    """Which functions a query may call: an allow-list built from the engine's own catalog."""

    exact: frozenset[str]
    folded: frozenset[str]  # lower-cased names of case-insensitive functions
    aggregates: frozenset[str]  # allowed aggregate functions (exact and lower-cased)

    @classmethod
    def from_catalog(cls, rows: Iterable[Sequence[Any]]) -> FunctionPolicy:
        """From ``system.functions`` rows ``(name, categories, alias_to, case_insensitive, is_aggregate)``.
        An alias is allowed when what it names is."""
        catalog = [(str(n), str(c), str(a), bool(int(i)), bool(int(g))) for n, c, a, i, g in rows]
        allowed = {
            name
            for name, categories, alias_to, _, _ in catalog
            if not alias_to
            and (name in SAFE_OTHER_FUNCTIONS or {c.strip() for c in categories.split(",")} & ALLOWED_CATEGORIES)
        }
        aggregate_names = {name for name, _, _, _, is_aggregate in catalog if is_aggregate}
        allowed |= {name for name, _, alias_to, _, _ in catalog if alias_to and alias_to in allowed}
        folded = {name.lower() for name, _, _, insensitive, _ in catalog if insensitive and name in allowed}
        aggregates = {name for name in allowed if name in aggregate_names}
        return cls(frozenset(allowed), frozenset(folded), frozenset(aggregates | {a.lower() for a in aggregates}))

    def allows(self, name: str) -> bool:
        if name in self.exact or name.lower() in self.folded or name in SYNTAX_FUNCTIONS:
            return True
        return self._aggregate(name)

    def _aggregate(self, name: str) -> bool:
        if name in self.aggregates or name.lower() in self.aggregates:
            return True
        return any(
            name.endswith(suffix) and len(name) > len(suffix) and self._aggregate(name[: -len(suffix)])
            for suffix in AGGREGATE_COMBINATORS
        )


def ast_refusal(ast: Sequence[str], policy: FunctionPolicy, database: str) -> tuple[str, str] | None:
    """Why a query is refused from its syntax tree (``EXPLAIN AST``: nothing evaluated yet), as
    ``(kind, message)``, or None.

    Every function called must be allowed (table functions: ALLOWED_TABLE_FUNCTIONS), and every
    table named with a database must be in ``database``. This runs before the engine analyses
    the query, because analysis already evaluates constant expressions and scalar subqueries:
    ``file('/etc/hostname')`` is read while a query tree is built.
    """
    if not ast or not ast[0].startswith("Select"):
        return "read_only", READ_ONLY_REFUSAL
    functions: set[str] = set()
    named: set[str] = set()
    for line in ast:
        if match := _AST_FUNCTION.match(line):
            functions.add(match.group(1))
        elif match := _AST_TABLE.match(line):
            named.add(match.group(1))
        elif (match := _AST_IDENTIFIER.match(line)) and match.group(1).lower().startswith(_SYSTEM_PREFIXES):
            named.add(match.group(1))  # `x IN system.tables` reads that table
    refused = sorted(f for f in functions if not policy.allows(f) and f.lower() not in ALLOWED_TABLE_FUNCTIONS)
    outside = _outside((t for t in named if "." in t), database)  # unqualified names resolve in database
    reasons = []
    if refused:
        reasons.append(f"it calls {', '.join(refused)}, not among the functions analytics may use")
    if outside:
        reasons.append(_reads_outside(outside, database))
    if not reasons:
        return None
    kind = "forbidden_table" if outside else "forbidden_function"
    message = _refused(reasons, database)
    if refused:
        message += ' and call functions of their values (docs/sql.md, "Access")'
    return kind, message


_SHOW_TABLES = re.compile(r"^SHOW TABLES(?: FROM `?(\w+)`?)?$")
_DESCRIBE = re.compile(r"^DESCRIBE TABLE (?:`?(\w+)`?\.)?`?(\w+)`?$")


def schema_statement(canonical: str, database: str) -> tuple[str, dict[str, Any]] | None:
    """``SHOW TABLES`` and ``DESCRIBE [TABLE] t`` within ``database``, as fixed SELECTs on the
    engine's catalog bound to that database (what a newcomer needs to find the schema); None for
    any other statement. ``canonical`` is ``formatQuery``'s text. Another database, or any other
    form (``SHOW TABLES LIKE``, ``DESCRIBE (SELECT ...)``, ``SHOW CREATE``), is not rewritten:
    a named other database is refused here, the rest goes through the ordinary checks."""
    if match := _SHOW_TABLES.match(canonical):
        _same_database(match.group(1), database)
        return (
            "SELECT name FROM system.tables WHERE database = {database:String} "
            "AND NOT startsWith(name, '.inner') ORDER BY name",
            {"database": database},
        )
    if match := _DESCRIBE.match(canonical):
        _same_database(match.group(1), database)
        return (
            "SELECT name, type, default_kind AS default_type, default_expression, comment FROM system.columns "
            "WHERE database = {database:String} AND table = {table:String} ORDER BY position",
            {"database": database, "table": match.group(2)},
        )
    return None


def _same_database(named: str | None, database: str) -> None:
    if named is not None and named != database:
        raise SqlRefusedError(_refused([_reads_outside([named], database)], database), kind="forbidden_table")


def load_function_policy(client: Client) -> FunctionPolicy:
    """The allow-list for the engine ``client`` talks to, from its function catalog."""
    result = client.query("SELECT name, categories, alias_to, case_insensitive, is_aggregate FROM system.functions")
    return FunctionPolicy.from_catalog(result.result_rows)


_SYSTEM_PREFIXES = ("system.", "information_schema.")
READ_ONLY_REFUSAL = (
    "refused: the SQL API is readonly and runs exactly one SELECT (or WITH ... SELECT) without INTO OUTFILE or FORMAT"
)


def jsonable(value: Any) -> Any:
    """A query result value as JSON: non-finite floats become "NaN"/"Infinity"/"-Infinity",
    dates ISO 8601 text, tuples lists, map keys strings, other types (Decimal, UUID, IPs) text."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (datetime, date, dtime)):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    return str(value)


def wrapped(canonical: str) -> str:
    """The canonical statement as a subquery: only one SELECT without INTO OUTFILE/FORMAT parses."""
    return f"SELECT * FROM (\n{canonical}\n)"


def render(result: SqlResult, fmt: SqlFormat) -> tuple[bytes, str]:
    """The response body and media type of ``result`` in ``fmt``."""
    if fmt == "json":
        body = {
            "columns": result.columns,
            "types": result.types,
            "rows": [[jsonable(v) for v in row] for row in result.rows],
            "row_count": len(result.rows),
            "elapsed_ms": round(result.elapsed_ms, 3),
        }
        return _json(body), "application/json"
    if fmt == "jsonl":
        lines = (_json(dict(zip(result.columns, [jsonable(v) for v in row], strict=True))) for row in result.rows)
        return b"".join(line + b"\n" for line in lines), "application/x-ndjson"
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(result.columns)
        writer.writerows([[_csv_value(v) for v in row] for row in result.rows])
        return out.getvalue().encode(), "text/csv; charset=utf-8"
    table = Table(*result.columns, box=box.SIMPLE_HEAD, show_edge=False)
    for row in result.rows:
        table.add_row(*("NULL" if v is None else str(jsonable(v)) for v in row))
    console = Console(file=io.StringIO(), width=max(80, 24 * len(result.columns)), color_system=None)
    console.print(table)
    console.print(f"{len(result.rows)} row(s) in {result.elapsed_ms:.1f} ms")
    return console.file.getvalue().encode(), "text/plain; charset=utf-8"  # type: ignore[attr-defined]


def _json(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(errors="replace")


def _csv_value(value: Any) -> Any:
    plain = jsonable(value)
    return json.dumps(plain, ensure_ascii=False) if isinstance(plain, (list, dict)) else plain


# -- imperative shell ----------------------------------------------------------------------------


async def within(work: asyncio.Future[T], seconds: float) -> T:
    """``work``'s result, or a timeout QueryError once ``seconds`` (and a grace second) have
    passed, even while the engine is still inside one expression: it checks its time limit
    only between blocks. The work itself runs on; whoever started it releases what it holds
    when it ends (a done callback), so abandoned queries never pile up."""
    work.add_done_callback(_retrieve)
    try:
        return await asyncio.wait_for(asyncio.shield(work), seconds + ABANDON_GRACE_S)
    except asyncio.TimeoutError:
        raise QueryError(
            f"the query ran past its time limit of {seconds:g} s and was abandoned; "
            "read fewer rows (WHERE, LIMIT) or ask for less per row",
            code=159,
            name="TIMEOUT_EXCEEDED",
        ) from None


def _retrieve(work: asyncio.Future[Any]) -> None:
    if not work.cancelled():
        work.exception()  # an abandoned query's error is nobody's news: no "never retrieved" noise


class SqlRunner:
    """Runs analytics queries read-only with limits, each on clients of its own, in threads."""

    def __init__(self, settings: Settings, limits: SqlLimits | None = None, *, concurrency: int | None = None) -> None:
        self.settings = settings
        self.limits = limits or SqlLimits.of(settings)
        self.database = settings.clickhouse_database
        self._slots = asyncio.Semaphore(concurrency or settings.sql_concurrency)
        self._policy: FunctionPolicy | None = None

    async def run(self, sql: str, timeout: float | None = None) -> SqlResult:
        """The result, within the time limit: past it (and a grace second) the caller gets a
        timeout even when the engine is still inside one expression, which it cannot interrupt
        (it checks its limit between blocks). Such a query keeps its concurrency slot until it
        ends, so abandoned queries never pile up beyond ``sql_concurrency``."""
        seconds = self.limits.time_limit(timeout)
        await self._slots.acquire()
        try:
            work = asyncio.get_running_loop().run_in_executor(None, self.run_sync, sql, seconds)
        except BaseException:
            self._slots.release()
            raise
        work.add_done_callback(lambda _: self._slots.release())
        return await within(work, seconds)

    def run_sync(self, sql: str, seconds: float | None = None) -> SqlResult:
        """Check, then run, all within ``seconds``; QueryError (SqlRefusedError for refusals)."""
        started = time.perf_counter()
        budget = self.limits.time_limit(seconds)
        check = self._client(self.limits.checking(budget))
        try:
            canonical, parameters = self._checked(check, sql)
        finally:
            check.close()
        left = budget - (time.perf_counter() - started)
        if left <= 0.001:
            raise QueryError(
                f"the query's checks used its whole time limit of {budget:g} s", code=159, name="TIMEOUT_EXCEEDED"
            )
        runner = self._client(self.limits.execution(left))
        try:
            result = runner.query(canonical, parameters=parameters or None)
        except DatabaseError as exc:
            raise QueryError(str(exc), code=_code(exc), name=getattr(exc, "name", None)) from exc
        finally:
            runner.close()
        return SqlResult(
            list(result.column_names),
            [t.name for t in result.column_types],
            [list(row) for row in result.result_rows],
            (time.perf_counter() - started) * 1000,
        )

    def _checked(self, client: Client, sql: str) -> tuple[str, dict[str, Any]]:
        """The statement to run and its parameters: the canonical SQL, or for ``SHOW TABLES`` /
        ``DESCRIBE`` within the agl database the fixed catalog query that answers it."""
        try:
            canonical = str(client.query("SELECT formatQuery({q:String})", parameters={"q": sql}).result_rows[0][0])
            ast = [str(row[0]) for row in client.query(f"EXPLAIN AST {canonical}").result_rows]
        except DatabaseError as exc:
            raise QueryError(str(exc), code=_code(exc), name=getattr(exc, "name", None)) from exc
        schema = schema_statement(canonical, self.database)
        if schema is not None:
            return schema  # fixed SQL on the catalog, bound to the agl database: nothing of the caller's runs
        if self._policy is None:
            self._policy = load_function_policy(client)
        refused = ast_refusal(ast, self._policy, self.database)
        if refused is not None:
            raise SqlRefusedError(refused[1], kind=refused[0])
        try:
            tree = client.query(f"EXPLAIN QUERY TREE {wrapped(canonical)}").result_rows
        except DatabaseError as exc:
            code = _code(exc)
            if code == 62:  # SYNTAX_ERROR: the one statement is not a SELECT that can be a subquery
                raise SqlRefusedError(
                    f"{READ_ONLY_REFUSAL}; ClickHouse does not read this statement as one: {_first_line(exc)}",
                    kind="read_only",
                ) from exc
            raise QueryError(str(exc), code=code, name=getattr(exc, "name", None)) from exc
        reason = refusal(*objects_read([str(row[0]) for row in tree]), self.database)
        if reason:
            raise SqlRefusedError(reason, kind="forbidden_table")
        return canonical, {}

    def _client(self, limits: dict[str, Any]) -> Client:
        if self.settings.uses_embedded_clickhouse:
            # Not chDB's mode=ro: that opens the whole engine read-only, and the sinks share it.
            client = get_client(self.settings, **limits)
            client.set_client_setting("readonly", "1")
            return client
        return get_client(self.settings, readonly=True, **limits)


def _code(exc: DatabaseError) -> int | None:
    code = getattr(exc, "code", None)
    if code is None:
        match = re.search(r"Code: (\d+)", str(exc))
        code = int(match.group(1)) if match else None
    return int(code) if code is not None else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _sql_errors(exc: Exception) -> Response | None:
    """The HTTP answer for a refused or failed query, or a request that names none."""
    if isinstance(exc, SqlRefusedError):
        return error_json(403, exc.kind, str(exc))
    if isinstance(exc, QueryError):
        status, kind = _STATUS_BY_CODE.get(exc.code or 0, (400, "query_error"))
        return error_json(status, kind, _first_line(exc), code=exc.code, name=exc.name)
    if isinstance(exc, ValidationError):
        return error_json(400, "bad_request", "; ".join(str(e["msg"]) for e in exc.errors()))
    return None


class SqlRequest(BaseModel):
    query: str = Field(min_length=1)
    format: SqlFormat = "json"
    timeout: float | None = Field(None, gt=0, le=3600, description="Seconds; capped by sql_time_limit_s.")


def _query_string(request: Request) -> SqlRequest:
    return SqlRequest.model_validate(dict(request.query_params))


async def _body(request: Request) -> SqlRequest:
    try:
        return SqlRequest.model_validate_json(await read_body(request, MAX_SQL_BODY_BYTES))
    except BodyTooLargeError as exc:
        raise Refusal(413, "too_large", str(exc)) from exc


async def _answer(request: SqlRequest, runner: SqlRunner) -> Response:
    result = await runner.run(request.query, request.timeout)
    body, media_type = render(result, request.format)
    return Response(body, media_type=media_type, headers={"x-agl-rows": str(len(result.rows))})


def _runner(request: Request) -> SqlRunner:
    runner: SqlRunner = request.app.state.sql
    return runner


Runner = Annotated[SqlRunner, Depends(_runner)]
router = APIRouter(route_class=answering(_sql_errors))
"""``/v1/sql`` on an app whose ``state.sql`` is its SqlRunner. A request is parsed before a
stopping gateway refuses it (503)."""


@router.get("/v1/sql")
async def sql_get(request: Annotated[SqlRequest, Depends(_query_string)], _: Serving, runner: Runner) -> Response:
    return await _answer(request, runner)


@router.post("/v1/sql")
async def sql_post(request: Annotated[SqlRequest, Depends(_body)], _: Serving, runner: Runner) -> Response:
    return await _answer(request, runner)

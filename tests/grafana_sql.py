"""Grafana SQL as the ClickHouse data source plugin would send it: its macros and the dashboard's
variables replaced by concrete values, so a test can run a dashboard's queries on the real engine.

The macros are the plugin's (``$__timeFilter(col)``, ``$__fromTime``, ``$__timeInterval(col)``,
...), expanded to the same SQL it generates; variables are Grafana's ``$name``, ``${name}`` and
``${name:sqlstring}`` (a quoted SQL string). Anything left starting with ``$`` is an error: a
macro the plugin does not have, or a variable the dashboard does not define.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class TimeRange:
    start: datetime
    end: datetime
    interval_s: int = 60


def _seconds(t: datetime) -> str:
    return f"toDateTime({int(t.timestamp())})"


def _millis(t: datetime) -> str:
    return f"fromUnixTimestamp64Milli({int(t.timestamp() * 1000)})"


def _date(t: datetime) -> str:
    return f"toDate('{t.strftime('%Y-%m-%d')}')"


def _between(column: str, low: str, high: str) -> str:
    return f"{column} >= {low} AND {column} <= {high}"


def _macro(name: str, args: list[str], when: TimeRange) -> str:
    start, end, interval = when.start, when.end, max(when.interval_s, 1)
    with_arguments = {
        "timeFilter": (1, lambda a: _between(a[0], _seconds(start), _seconds(end))),
        "timeFilter_ms": (1, lambda a: _between(a[0], _millis(start), _millis(end))),
        "dateFilter": (1, lambda a: _between(a[0], _date(start), _date(end))),
        "dateTimeFilter": (
            2,
            lambda a: (
                f"({_between(a[0], _date(start), _date(end))}) AND ({_between(a[1], _seconds(start), _seconds(end))})"
            ),
        ),
        "timeInterval": (1, lambda a: f"toStartOfInterval(toDateTime({a[0]}), INTERVAL {interval} second)"),
        "timeInterval_ms": (
            1,
            lambda a: f"toStartOfInterval(toDateTime64({a[0]}, 3), INTERVAL {interval * 1000} millisecond)",
        ),
    }
    plain = {
        "fromTime": _seconds(start),
        "toTime": _seconds(end),
        "fromTime_ms": _millis(start),
        "toTime_ms": _millis(end),
        "interval_s": str(interval),
    }
    if name in with_arguments:
        arity, expand = with_arguments[name]
        if len(args) != arity:
            raise ValueError(f"$__{name} takes {arity} argument(s), got {args}")
        return expand(args)
    if name in plain and not args:
        return plain[name]
    raise ValueError(f"$__{name}: not a macro of the ClickHouse data source")


def _split_arguments(text: str, open_at: int) -> tuple[list[str], int]:
    """The comma-separated arguments of the call whose '(' is at ``open_at``, and the index after ')'."""
    depth, args, current = 0, list[str](), list[str]()
    for i in range(open_at, len(text)):
        char = text[i]
        if char == "(":
            depth += 1
            if depth == 1:
                continue
        elif char == ")":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return [a for a in args if a], i + 1
        elif char == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    raise ValueError(f"unbalanced parentheses after position {open_at}")


def sql_string(value: str) -> str:
    """Grafana's ``sqlstring`` format: a single-quoted SQL string, quotes doubled."""
    return "'" + value.replace("'", "''") + "'"


def render(sql: str, when: TimeRange, variables: Mapping[str, str]) -> str:
    """``sql`` with the plugin's macros expanded for ``when`` and the dashboard's variables set."""

    def variable(match: re.Match[str]) -> str:
        name, fmt = match.group("braced") or match.group("bare"), match.group("format")
        if name not in variables:
            raise ValueError(f"${name}: no such dashboard variable (have {sorted(variables)})")
        if fmt not in (None, "sqlstring", "raw"):
            raise ValueError(f"${{{name}:{fmt}}}: a format this helper does not render")
        return sql_string(variables[name]) if fmt == "sqlstring" else variables[name]

    sql = re.sub(r"\$\{(?P<braced>\w+)(?::(?P<format>\w+))?\}|\$(?P<bare>(?!__)\w+)", variable, sql)
    out, i = [], 0
    for match in re.finditer(r"\$__(\w+)", sql):
        if match.start() < i:
            continue  # inside a macro's arguments, already expanded
        out.append(sql[i : match.start()])
        end = match.end()
        args: list[str] = []
        if end < len(sql) and sql[end] == "(":
            args, end = _split_arguments(sql, end)
        out.append(_macro(match.group(1), args, when))
        i = end
    out.append(sql[i:])
    rendered = "".join(out)
    if "$" in rendered:
        raise ValueError(f"left unrendered: {rendered!r}")
    return rendered

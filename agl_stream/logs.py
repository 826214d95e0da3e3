"""Structured logging (structlog) for every agl-stream process."""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

import structlog


def configure_logging(level: str = "INFO", fmt: str = "console") -> None:
    """Route structlog and stdlib logging to stderr, as key=value for people or JSON lines."""
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Ours at the level asked for; third-party libraries (aiokafka logs every coordinator hiccup
    # at INFO, httpx every request) at WARNING, unless DEBUG asks for everything.
    asked = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    root.setLevel(asked if asked == logging.DEBUG else max(logging.WARNING, asked))
    logging.getLogger("agl").setLevel(asked)


_OWN_API = re.compile(r"/v1/(query|sql|traces|tasks|offsets|health)\b")


class _LlmRequestsOnly(logging.Filter):
    """httpx's request lines, without those of agl-stream's own API (the store's reads)."""

    def filter(self, record: logging.LogRecord) -> bool:
        # The whole message, not its arguments: other filters (LiteLLM's) may have merged them.
        return _OWN_API.search(record.getMessage()) is None


def log_llm_requests() -> None:
    """One INFO line per HTTP request the process's agents make (httpx's own line: method, URL,
    status), so a runner's log shows its agent's LLM calls; agl-stream's own calls stay out."""
    httpx_log = logging.getLogger("httpx")
    httpx_log.setLevel(logging.INFO)
    for old in [f for f in httpx_log.filters if type(f).__name__ == _LlmRequestsOnly.__name__]:
        httpx_log.removeFilter(old)  # one filter, whatever set one before (a reloaded module too)
    httpx_log.addFilter(_LlmRequestsOnly())


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def describe(error: BaseException) -> str:
    """``TypeName: message`` for a log line's ``error=``: ``str(error)`` alone is empty for many
    exceptions (a ``TimeoutError`` from ``asyncio.wait_for``), which leaves a log line no clue."""
    name = type(error).__name__
    text = str(error)
    return f"{name}: {text}" if text and text != name else name

"""Logs a person can read: ours at the level asked, third-party libraries at WARNING, and a
runner's LLM requests one line each."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from agl_stream.logs import configure_logging, log_llm_requests


@pytest.fixture
def restored_logging() -> Iterator[list[logging.LogRecord]]:
    root = logging.getLogger()
    names = ("agl", "httpx", "aiokafka")
    saved = (root.level, root.handlers[:], {n: logging.getLogger(n).level for n in names})
    filters = logging.getLogger("httpx").filters[:]
    seen: list[logging.LogRecord] = []
    yield seen
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    for name, level in saved[2].items():
        logging.getLogger(name).setLevel(level)
    logging.getLogger("httpx").filters[:] = filters


def _capture(seen: list[logging.LogRecord]) -> None:
    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record)

    logging.getLogger().addHandler(Keep())


def test_ours_at_the_level_asked_third_party_at_warning_unless_debug(restored_logging: list[logging.LogRecord]) -> None:
    configure_logging("INFO")
    assert logging.getLogger("agl.runner").isEnabledFor(logging.INFO)
    assert not logging.getLogger("aiokafka.consumer").isEnabledFor(logging.INFO)
    assert logging.getLogger("aiokafka.consumer").isEnabledFor(logging.WARNING)
    configure_logging("DEBUG")
    assert logging.getLogger("aiokafka.consumer").isEnabledFor(logging.DEBUG)


def test_a_runner_logs_each_llm_request_but_not_its_own_api_calls(restored_logging: list[logging.LogRecord]) -> None:
    configure_logging("INFO")
    _capture(restored_logging)

    class Redacting(logging.Filter):  # as LiteLLM's on the httpx logger: it merges the arguments
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg, record.args = record.getMessage(), ()
            return True

    logging.getLogger("httpx").addFilter(Redacting())
    log_llm_requests()
    log_llm_requests()  # idempotent: one filter, one line per request
    httpx_log = logging.getLogger("httpx")
    line = 'HTTP Request: %s %s "%s %d %s"'
    httpx_log.info(
        line, "POST", "http://127.0.0.1:8000/rollout/ro-1/attempt/at-1/v1/chat/completions", "HTTP/1.1", 200, "OK"
    )
    httpx_log.info(line, "POST", "http://127.0.0.1:8642/v1/query", "HTTP/1.1", 200, "OK")
    requests = [r.getMessage() for r in restored_logging if r.name == "httpx"]
    assert len(requests) == 1 and "/v1/chat/completions" in requests[0] and "200 OK" in requests[0]

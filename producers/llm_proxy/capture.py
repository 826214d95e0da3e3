"""What a backend really sent: an httpx transport that copies the response bytes of the proxy's own
calls (LiteLLM drops token ids from streams; spans are built from these bytes)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from agl_stream.domain.llm_calls import (
    policy_version_of_header,
)
from agl_stream.http_serving import MalformedBodyError, parse_json
from agl_stream.wire.semconv import POLICY_VERSION_HEADER

CALL_HEADER = "x-agl-proxy-call"
"""Header that ties a backend request to the proxy call that made it (see CaptureTransport)."""

# -- raw responses ----------------------------------------------------------------------------


@dataclass
class Capture:
    """What the backend answered to one proxy call (the last try, when LiteLLM retried)."""

    status: int | None = None
    url: str | None = None
    body: bytearray = field(default_factory=bytearray)
    policy_version: int | None = None  # as the backend reported it (POLICY_VERSION_HEADER)

    def json(self) -> Any:
        try:
            return parse_json(bytes(self.body))
        except MalformedBodyError:
            return None


class _TeeStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, sink: bytearray) -> None:
        self._inner = inner
        self._sink = sink

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            self._sink.extend(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


class CaptureTransport(httpx.AsyncBaseTransport):
    """An httpx transport that copies the response bytes of requests with :data:`CALL_HEADER`.

    The header, not a contextvar, links a request to its call: LiteLLM's router may run the
    request in tasks of its own. Captured requests ask for an uncompressed answer, so the copy
    is the JSON or event stream itself.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.captures: dict[str, Capture] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        capture = self.captures.get(request.headers.get(CALL_HEADER, ""))
        if capture is None:
            return await self.inner.handle_async_request(request)
        request.headers["Accept-Encoding"] = "identity"
        capture.status, capture.url, capture.policy_version = None, str(request.url), None
        capture.body.clear()
        response = await self.inner.handle_async_request(request)
        capture.status = response.status_code
        capture.policy_version = policy_version_of_header(response.headers.get(POLICY_VERSION_HEADER))
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _TeeStream(response.stream, capture.body)
        return response

    async def aclose(self) -> None:
        await self.inner.aclose()

    @contextlib.contextmanager
    def capturing(self) -> Iterator[tuple[str, Capture]]:
        call_id, capture = uuid.uuid4().hex, Capture()
        self.captures[call_id] = capture
        try:
            yield call_id, capture
        finally:
            del self.captures[call_id]

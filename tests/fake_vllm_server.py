"""A stand-in for vLLM's OpenAI server with its command-line flags (``--model``,
``--served-model-name``, ``--host``, ``--port``), for testing the vLLM manager without vLLM.

A real HTTP server (the standard library's, so it starts in milliseconds): ``GET /health`` is 200,
``GET /v1/models`` names the served model with ``root`` = the ``--model`` folder (as vLLM's does).
A model folder holding a file ``refuse-to-start`` makes it exit with status 3 instead, like a
server that cannot load a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _rest = parser.parse_known_args()  # vLLM's other flags are accepted and ignored
    if (Path(args.model) / "refuse-to-start").exists():
        print(f"cannot load {args.model}", file=sys.stderr)
        return 3

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/health":
                body = b""
            elif self.path == "/v1/models":
                card = {"id": args.served_model_name, "object": "model", "root": args.model}
                body = json.dumps({"object": "list", "data": [card]}).encode()
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *values: object) -> None:
            pass

    ThreadingHTTPServer.allow_reuse_address = True
    with ThreadingHTTPServer((args.host, args.port), Handler) as server:
        server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

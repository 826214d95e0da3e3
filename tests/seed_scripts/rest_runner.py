"""An unmodified runner of the seed (Agent Lightning 0.3.0's ``LitAgentRunner`` with its
``OtelTracer``) working the queue of an agl-stream gateway through ``/v1/agl``.

Run by the seed's python (``tests/integration/test_seed_rest_api.py`` does it), never imported
by agl-stream's: ``python rest_runner.py <gateway url>``. It claims rollouts until SIGTERM. The
agent emits one message span (through the tracer's OTLP exporter, to the gateway's
``/v1/traces``) and returns ``input["n"] / 10`` as its reward (which the runner adds as a
reward span through ``/v1/agl/spans``). It prints ``ready`` once the runner is set up.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

from agentlightning.emitter import emit_message
from agentlightning.execution.events import ThreadingEvent
from agentlightning.litagent import LitAgent
from agentlightning.runner import LitAgentRunner
from agentlightning.store.client_server import LightningStoreClient
from agentlightning.tracer.otel import OtelTracer


class Scorer(LitAgent[dict[str, Any]]):
    """Scores a task by its number; says so in a message span first."""

    def rollout(self, task: dict[str, Any], resources: Any, rollout: Any) -> float:
        emit_message(f"scoring {task['n']} with {sorted(resources)}")
        return float(task["n"]) / 10


async def main(url: str) -> None:
    stop = ThreadingEvent()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    runner: LitAgentRunner[dict[str, Any]] = LitAgentRunner(
        OtelTracer(), poll_interval=0.1, interval_jitter=0.05, heartbeat_interval=1.0, heartbeat_launch_mode="asyncio"
    )
    runner.init(Scorer())
    store = LightningStoreClient(url)
    runner.init_worker(0, store)
    print("ready", flush=True)
    try:
        await runner.iter(event=stop)
    finally:
        runner.teardown_worker(0)
        runner.teardown()
        await store.close()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    asyncio.run(main(sys.argv[1]))

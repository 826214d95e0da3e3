"""Agent Lightning 1.0.2's own trainer side and controller, unmodified, against an agl-stream
listener: the rollout manager registers the model and enqueues rollouts, 1.0's LocalReconciler
runs each in a process of its own (``agent.py``), and the manager waits for them and reads their
triplets and rewards, as 1.0's VERL trainer does. Prints one JSON object: the completed rollouts
and a page of the terminal cursor.

Usage: python driver.py URL KEY MODEL BACKEND_URL TASKS_JSON
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

from agentlightning.client import AgentLightningAsyncClient
from agentlightning.controller.local_reconciler import LocalReconciler
from agentlightning.verl.agl_rollout_manager import AglRolloutManager
from omegaconf import OmegaConf


def main() -> None:
    url, key, model, backend, tasks_json = sys.argv[1:6]
    tasks = json.loads(tasks_json)
    manager = AglRolloutManager(
        agl_base_url=url,
        agl_key=key,
        model=model,
        step=0,
        local_agent_class="agent:Agent",
        local_env_map={"QUESTION": "input.question", "EXPECTED": "input.expected", "FAIL": "input.fail"},
        rollout_timeout_seconds=300,
        poll_interval_seconds=0.5,
    )
    manager.delete_model()
    manager.register_model([backend])
    stop = threading.Event()

    async def control() -> None:
        config = OmegaConf.create(
            {
                "runner_type": "local",
                "agl_server": {"url": url, "key": key},
                "local_runner": {"maximum_size": 4, "poll_interval": 0.5},
            }
        )
        async with AgentLightningAsyncClient(base_url=url, key=key) as api:
            reconciler = LocalReconciler(api=api, config=config)
            task = asyncio.create_task(reconciler.run())
            await asyncio.to_thread(stop.wait)
            reconciler.stop()
            await task

    controller = threading.Thread(target=lambda: asyncio.run(control()))
    controller.start()
    try:
        columns = {name: [task[name] for task in tasks] for name in ("question", "expected", "fail")}
        completed = manager.enqueue_and_wait_until_completed(columns, is_train=True)
    finally:
        stop.set()
        controller.join()
    terminal = manager.client.get("/api/rollouts/terminal", params={"after": 0}).json()
    print(json.dumps({"completed": [c.model_dump(mode="json") for c in completed], "terminal": terminal}))


if __name__ == "__main__":
    main()

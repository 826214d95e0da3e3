"""The seed's own ``Trainer.dev`` (Agent Lightning 0.3.0, unmodified) against an agl-stream
gateway: its default algorithm (``Baseline``) with ``initial_resources``, one runner thread,
the store the seed's ``LightningStoreClient`` at ``/v1/agl``.

Run by the seed's python (``tests/integration/test_seed_rest_api.py`` does it), never imported
by agl-stream's: ``python trainer_dev.py <gateway url> <tag>``. ``Baseline`` first publishes
the initial resources under the id ``default`` (``update_resources``, which creates the id),
enqueues every task with them, polls each rollout until it finishes and reads its attempts
and spans. The agent formats the prompt template it was given and returns the task's number
over ten as its reward. Prints one JSON line: what the agent saw, per task.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from agentlightning import Baseline, LitAgent, PromptTemplate, Trainer
from agentlightning.execution.shared_memory import SharedMemoryExecutionStrategy
from agentlightning.store.client_server import LightningStoreClient

SEEN: dict[str, str] = {}


class Formatter(LitAgent[dict[str, Any]]):
    """Formats the prompt it was given with the task; scores the task by its number."""

    def rollout(self, task: dict[str, Any], resources: Any, rollout: Any) -> float:
        SEEN[str(task["n"])] = resources["prompt"].format(n=task["n"])
        return float(task["n"]) / 10


def main(url: str, tag: str) -> None:
    trainer = Trainer(
        store=LightningStoreClient(url),
        initial_resources={"prompt": PromptTemplate(template=f"{tag}: say {{n}}", engine="f-string")},
        algorithm=Baseline(polling_interval=0.2, span_verbosity="none"),
        strategy=SharedMemoryExecutionStrategy(n_runners=1, main_thread="algorithm", managed_store=False),
    )
    train = [{"n": 1, "tag": tag}, {"n": 2, "tag": tag}]
    val = [{"n": 3, "tag": tag}]
    trainer.dev(Formatter(), train_dataset=train, val_dataset=val)
    print(json.dumps({"seen": SEEN}), flush=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    main(sys.argv[1], sys.argv[2])

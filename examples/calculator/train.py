"""Run or train the calculator agent with ``agl.Trainer(...).fit``.

Baseline (train nothing, measure the model; any OpenAI-compatible endpoint that does tool calls):

    python examples/calculator/train.py --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-1.5B-Instruct

VERL/GRPO (the run serves and trains its own policy: the built-in tiny CPU policy, or a local
Hugging Face model folder with ``--model-path``):

    python examples/calculator/train.py --algorithm verl --model-path ./Qwen2.5-0.5B-Instruct

The endpoint, model and key also come from ``OPENAI_BASE_URL``, ``AGL_EXAMPLE_MODEL`` and
``OPENAI_API_KEY``. The stack is the one ``agl-stream up`` runs, or a local one the run starts.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from calc_agent import (  # the script's folder is on sys.path
    TRAIN_FILE,
    VAL_FILE,
    agents_sdk_calculator_agent,
    calculator_agent,
    langgraph_calculator_agent,
)

import agl_stream as agl

VERL_CONFIG: dict[str, Any] = {
    "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
    "data": {"train_batch_size": 4, "max_prompt_length": 1024, "max_response_length": 256},
    "actor_rollout_ref": {
        "rollout": {"n": 4},  # four answers per problem: GRPO compares them with each other
        "actor": {"optim": {"lr": 1e-6}, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": False},
    },
    "trainer": {"total_epochs": 2, "test_freq": 4, "val_before_train": True},
}
"""GRPO settings for a small instruction model; the seed's VERL keys (see README.md)."""


AGENTS = {
    "openai": calculator_agent,
    "langgraph": langgraph_calculator_agent,
    "agents-sdk": agents_sdk_calculator_agent,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=("baseline", "verl"), default="baseline")
    parser.add_argument(
        "--framework",
        choices=tuple(AGENTS),
        default="openai",
        help="the agent's code: the openai client, LangGraph or the OpenAI Agents SDK (the same task and tool)",
    )
    parser.add_argument("--endpoint", default=os.environ.get("OPENAI_BASE_URL"), help="OpenAI-compatible base URL")
    parser.add_argument("--model", default=os.environ.get("AGL_EXAMPLE_MODEL"), help="model name at the endpoint")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--model-path", help="VERL: a local Hugging Face model folder (default: the tiny policy)")
    parser.add_argument("--n-runners", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1, help="Baseline: passes over the data")
    parser.add_argument("--train-file", default=str(TRAIN_FILE))
    parser.add_argument("--val-file", default=str(VAL_FILE))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.algorithm == "baseline":
        if not args.endpoint or not args.model:
            raise SystemExit("Baseline needs --endpoint and --model (or OPENAI_BASE_URL and AGL_EXAMPLE_MODEL)")
        llm = agl.LLM(
            endpoint=args.endpoint,
            model=args.model,
            api_key=args.api_key,
            sampling_parameters={"temperature": args.temperature},
        )
        trainer = agl.Trainer(
            algorithm=agl.Baseline(n_epochs=args.epochs),
            n_runners=args.n_runners,
            initial_resources={"main_llm": llm},
        )
        result = trainer.fit(AGENTS[args.framework], args.train_file, args.val_file)
        print(f"train reward {result.mean_reward('train')}, val reward {result.mean_reward('val')}")
        return
    config = dict(VERL_CONFIG)
    if args.model_path:
        config["actor_rollout_ref.model.path"] = args.model_path
    algorithm = agl.VERL(config)
    trainer = agl.Trainer(algorithm=algorithm, n_runners=args.n_runners)
    result = trainer.fit(AGENTS[args.framework], args.train_file, args.val_file)
    print(f"policy version {result.policy_version}")
    for validation in algorithm.validations:
        print(f"validation at policy version {validation.policy_version}: mean reward {validation.mean_reward}")


if __name__ == "__main__":
    main()

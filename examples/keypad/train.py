"""Run or train the keypad agent with ``agl.Trainer(...).fit``.

VERL/GRPO with trajectory aggregation (the default here: the run serves and trains its own
policy, the built-in tiny CPU policy, or a local Hugging Face model folder with ``--model-path``):

    python examples/keypad/train.py
    python examples/keypad/train.py --aggregation transition   # one sample per model call

Baseline (train nothing, measure the model; any OpenAI-compatible endpoint):

    python examples/keypad/train.py --algorithm baseline --endpoint http://127.0.0.1:8000/v1 --model agl-tiny

The endpoint, model and key also come from ``OPENAI_BASE_URL``, ``AGL_EXAMPLE_MODEL`` and
``OPENAI_API_KEY``. The stack is the one ``agl-stream up`` runs, or a local one the run starts.
``benchmarks/aggregation.py`` trains this agent in both aggregation modes side by side.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from keypad_agent import MAX_TOKENS, TRAIN_FILE, VAL_FILE, keypad_agent  # the script's folder is on sys.path

import agl_stream as agl


def verl_config(aggregation: str, model_path: str | None) -> dict[str, Any]:
    """GRPO settings for the tiny policy (the seed's VERL keys): eight answers per task, the
    trace aggregation level given."""
    config: dict[str, Any] = {
        "algorithm": {"adv_estimator": "grpo", "use_kl_in_reward": False},
        "data": {"train_batch_size": 4, "max_prompt_length": 512, "max_response_length": 4 * 128},
        "actor_rollout_ref": {
            "rollout": {"n": 8},  # eight rollouts per task: GRPO compares them with each other
            "actor": {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "use_kl_loss": False},
        },
        "trainer": {"total_epochs": 4, "test_freq": 2, "val_before_train": True},
        "agentlightning": {"trace_aggregator": {"level": aggregation}},
    }
    if model_path:
        config["actor_rollout_ref.model.path"] = model_path
    return config


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", choices=("baseline", "verl"), default="verl")
    parser.add_argument("--aggregation", choices=("trajectory", "transition"), default="trajectory")
    parser.add_argument("--endpoint", default=os.environ.get("OPENAI_BASE_URL"), help="OpenAI-compatible base URL")
    parser.add_argument("--model", default=os.environ.get("AGL_EXAMPLE_MODEL"), help="model name at the endpoint")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--model-path", help="VERL: a local Hugging Face model folder (default: the tiny policy)")
    parser.add_argument("--n-runners", type=int, default=2)
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
            sampling_parameters={"temperature": 1.0, "max_tokens": MAX_TOKENS},
        )
        trainer = agl.Trainer(
            algorithm=agl.Baseline(n_epochs=1), n_runners=args.n_runners, initial_resources={"main_llm": llm}
        )
        result = trainer.fit(keypad_agent, args.train_file, args.val_file)
        print(f"train reward {result.mean_reward('train')}, val reward {result.mean_reward('val')}")
        return
    algorithm = agl.VERL(verl_config(args.aggregation, args.model_path))
    trainer = agl.Trainer(algorithm=algorithm, n_runners=args.n_runners)
    result = trainer.fit(keypad_agent, args.train_file, args.val_file)
    print(f"policy version {result.policy_version}")
    for validation in algorithm.validations:
        print(f"validation at policy version {validation.policy_version}: mean reward {validation.mean_reward}")


if __name__ == "__main__":
    main()

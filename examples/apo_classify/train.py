"""Improve the sentiment classifier's prompt with APO: ``agl.Trainer(algorithm=agl.APO(...)).fit``.

Any OpenAI-compatible endpoint serves the agent's model, and the critique and edit models
(the same endpoint and model unless told otherwise):

    python examples/apo_classify/train.py --endpoint http://127.0.0.1:8000/v1 --model Qwen/Qwen2.5-7B-Instruct
    python examples/apo_classify/train.py --model gpt-4.1-nano --critique-model gpt-4.1-mini --rounds 3

The endpoint, model and key also come from ``OPENAI_BASE_URL``, ``AGL_EXAMPLE_MODEL`` and
``OPENAI_API_KEY``. The stack is the one ``agl-stream up`` runs, or a local one the run starts.
It prints the seed prompt's score, each round's leader and the best prompt, which it leaves
published as the latest resources.
"""

from __future__ import annotations

import argparse
import os

from classify_agent import (  # the script's folder is on sys.path
    PROMPT_RESOURCE,
    TRAIN_FILE,
    VAL_FILE,
    classify_agent,
    initial_resources,
    load_tasks,
)

import agl_stream as agl


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default=os.environ.get("OPENAI_BASE_URL"), help="OpenAI-compatible base URL")
    parser.add_argument("--model", default=os.environ.get("AGL_EXAMPLE_MODEL"), help="the agent's model")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    parser.add_argument("--critique-model", help="the critique (textual gradient) model (default: --model)")
    parser.add_argument("--critique-endpoint", help="its base URL (default: --endpoint)")
    parser.add_argument("--edit-model", help="the model that rewrites the prompt (default: the critique model)")
    parser.add_argument("--edit-endpoint", help="its base URL (default: the critique endpoint)")
    parser.add_argument("--rounds", type=int, default=2, help="beam search rounds")
    parser.add_argument("--beam-width", type=int, default=2)
    parser.add_argument("--branch-factor", type=int, default=2, help="edits per parent prompt per round")
    parser.add_argument("--gradient-batch-size", type=int, default=4, help="training tasks each critique reads")
    parser.add_argument("--temperature", type=float, default=0.7, help="the critique and edit models' temperature")
    parser.add_argument("--n-runners", type=int, default=2)
    parser.add_argument("--train-file", default=str(TRAIN_FILE))
    parser.add_argument("--val-file", default=str(VAL_FILE))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if not args.endpoint or not args.model:
        raise SystemExit("give --endpoint and --model (or OPENAI_BASE_URL and AGL_EXAMPLE_MODEL)")
    critique_model = args.critique_model or args.model
    algorithm = agl.APO(
        gradient_model=critique_model,
        apply_edit_model=args.edit_model or critique_model,
        gradient_base_url=args.critique_endpoint or args.endpoint,
        gradient_api_key=args.api_key,
        apply_edit_base_url=args.edit_endpoint,
        diversity_temperature=args.temperature,
        gradient_batch_size=args.gradient_batch_size,
        val_batch_size=16,  # the whole validation set (12 tasks): every round compares on it
        beam_width=args.beam_width,
        branch_factor=args.branch_factor,
        beam_rounds=args.rounds,
    )
    trainer = agl.Trainer(
        algorithm=algorithm,
        n_runners=args.n_runners,
        initial_resources=initial_resources(args.endpoint, args.model, api_key=args.api_key),
    )
    trainer.fit(classify_agent, load_tasks(args.train_file), load_tasks(args.val_file))
    print(f"seed prompt score {algorithm.seed_score}, best prompt score {algorithm.best_score}")
    print(f"best {PROMPT_RESOURCE} (resources {algorithm.best_resources_id}):\n{algorithm.get_best_prompt().template}")
    for entry in algorithm.history:
        print(f"round {entry.round}: {entry.score:.3f} on {entry.tasks} tasks  {entry.prompt[:60]!r}")


if __name__ == "__main__":
    main()

"""Export rows per second: rollouts' spans -> TRL rows (``agl-stream export``'s pure half), then written.

Makes ``--rollouts`` attempts in the LLM proxy's exact span shape (tests/export_spans.py: a
calculator agent's two calls, a tool call then the answer after the tool's result, with a
system prompt, the tool's schema, token ids and a reward span), ``--group`` rollouts per task
with different rewards, and times, in this process with no Kafka or ClickHouse:

* ``convert``: :func:`agl_stream.domain.export.export_rows` for SFT and for DPO (the trace
  adapter, the messages back in OpenAI's shape, the conversations, the pairing);
* ``write``: the SFT rows written as JSON lines and through ``datasets`` (save_to_disk, Parquet).

Reading the spans from ClickHouse is the gateway's query path, measured by its own benchmarks.
Figures are rows per second of wall time, the best of ``--repeats`` (other work on the machine
only slows a run down).

Run: ``python benchmarks/export.py [--rollouts 5000 --group 4 --repeats 3]``;
JSON to benchmarks/results/export.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agl_stream.domain.export import ExportTrace, export_rows
from tests.export_spans import attempt_spans, tool_episode


def make_traces(rollouts: int, group: int) -> list[ExportTrace]:
    traces = []
    for i in range(rollouts):
        task = i // group
        a, b = task % 97, task % 89
        calls = tool_episode(f"what is {a} plus {b}?", f"{a}+{b}", str(a + b), f"It is {a + b + i % group}.")
        rollout_id = f"ro-{i:08d}"
        reward = 1.0 if i % group == 0 else 1.0 / (1 + i % group)
        traces.append(ExportTrace(rollout_id, "at-1", f"g-{task}", attempt_spans(rollout_id, calls, reward, "at-1")))
    return traces


def best_of(repeats: int, work: Callable[[], int]) -> tuple[float, int]:
    """(best seconds, rows) over ``repeats`` runs of ``work``."""
    best, rows = float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        rows = work()
        best = min(best, time.perf_counter() - started)
    return best, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=5000)
    parser.add_argument("--group", type=int, default=4, help="rollouts per task (DPO pairs one per task)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    traces = make_traces(args.rollouts, args.group)
    spans = sum(len(t.spans) for t in traces)
    results: dict[str, Any] = {"rollouts": args.rollouts, "spans": spans, "group": args.group}
    for kind in ("sft", "dpo"):
        seconds, made = best_of(args.repeats, lambda kind=kind: len(export_rows(traces, kind)[0]))  # type: ignore[misc]
        results[f"convert_{kind}"] = {
            "rows": made,
            "seconds": round(seconds, 4),
            "rows_per_s": round(made / seconds),
            "rollouts_per_s": round(args.rollouts / seconds),
        }

    import datasets  # type: ignore[import-untyped]

    rows, _ = export_rows(traces, "sft")
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)

        def jsonl() -> int:
            with (out / "chats.jsonl").open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            return len(rows)

        def hf() -> int:
            datasets.Dataset.from_list(rows).save_to_disk(str(out / "hf"))
            return len(rows)

        def parquet() -> int:
            datasets.Dataset.from_list(rows).to_parquet(str(out / "sft.parquet"))
            return len(rows)

        datasets.disable_progress_bars()
        for name, work in (("write_jsonl", jsonl), ("write_hf", hf), ("write_parquet", parquet)):
            seconds, written = best_of(args.repeats, work)
            results[name] = {"rows": written, "seconds": round(seconds, 4), "rows_per_s": round(written / seconds)}

    print(json.dumps(results, indent=2))
    target = Path(__file__).parent / "results" / "export.json"
    target.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

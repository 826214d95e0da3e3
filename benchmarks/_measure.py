"""Helpers the benchmark scripts share (imported as a sibling module when a script runs)."""

from __future__ import annotations

import os
from pathlib import Path


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of ``values`` (nearest rank), NaN when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def cpu_seconds(pid: int) -> float:
    """CPU time a process has used so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

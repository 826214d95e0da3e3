"""Keep CPU cores busy: the "busy machine" that make test and make demo must pass beside.

    python scripts/cpu_hog.py --cores 1 --seconds 3600

One process per core spins in a tight loop (pure Python, no I/O) until ``--seconds`` pass or it
is stopped (SIGTERM/SIGINT stop every spinner it started). ``scripts/under_load.sh CMD ...``
runs a command beside it and stops it afterwards, by PID.
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
import time


def spin(until: float) -> None:
    count = 0
    while time.monotonic() < until:
        for _ in range(100_000):
            count += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, default=1, help="spinning processes (default 1)")
    parser.add_argument("--seconds", type=float, default=6 * 3600.0, help="stop by itself after this long")
    options = parser.parse_args()
    until = time.monotonic() + options.seconds
    spinners = [multiprocessing.Process(target=spin, args=(until,), daemon=True) for _ in range(options.cores)]
    for spinner in spinners:
        spinner.start()

    def stop(*_: object) -> None:
        for spinner in spinners:
            spinner.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"cpu_hog: {options.cores} spinning process(es) for up to {options.seconds:.0f} s", flush=True)
    for spinner in spinners:
        spinner.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

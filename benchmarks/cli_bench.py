"""How long `moepipe --help` takes, against a bare Python start-up in the same run.

    python benchmarks/cli_bench.py [--runs 10]

Prints the median wall time of each and their ratio (CLI start-up / Python start-up).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def _median(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    bare = _median([sys.executable, "-c", "pass"], args.runs)
    cli = _median([sys.executable, "-m", "moepipe", "--help"], args.runs)
    print(f"python -c pass   {bare * 1000:7.1f} ms (median of {args.runs})")
    print(f"moepipe --help   {cli * 1000:7.1f} ms")
    print(f"ratio            {cli / bare:7.2f}")


if __name__ == "__main__":
    main()

"""Build-cache benchmark: a full `moepipe build` against a no-op rebuild (nothing changed) of
the same config, in one run, for

* the tiny example, quantized (tiny-mixtral, fp8 + fp8 KV cache, tp=2 / moe_ep=2): source,
  inspect, quantize (modelopt calibration), convert, quality;
* a larger synthetic Mixtral-shaped checkpoint given by path (bf16, --gb GB, several shards,
  tp=2 / moe_ep=2): source (BLAKE3 of every file), inspect, convert.

    python benchmarks/build_bench.py [--gb 1.0] [--workdir /tmp/moepipe-build-bench] [--json F]

Each no-op rebuild is timed through the CLI (what a CI job sees: Python start-up included) and
in-process (`run_build` again in a warm interpreter: the runner's own cost). Target: no-op
rebuild <= 2% of the full build's time. Figures go to the README; no test asserts timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_bench import make_checkpoint  # noqa: E402


def cli_build(folder: Path, env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "moepipe", "-q", "build"], cwd=folder, env=env,
                   check=True)
    return time.perf_counter() - t0


def in_process_build(folder: Path) -> float:
    from moepipe.commands.build import run_build

    t0 = time.perf_counter()
    manifest = run_build(folder / "moepipe.yaml", echo=lambda s: None)
    seconds = time.perf_counter() - t0
    assert {s["status"] for s in manifest["stages"]} == {"reused"}, "not a no-op"
    return seconds


def measure(name: str, folder: Path, env: dict, repeats: int = 5) -> dict:
    full = cli_build(folder, env)
    noop_cli = statistics.median(cli_build(folder, env) for _ in range(repeats))
    os.environ.update(env)
    in_process_build(folder)  # warm the interpreter's imports once
    noop_in = statistics.median(in_process_build(folder) for _ in range(repeats))
    manifest = json.loads((folder / "work" / "build-manifest.json").read_text())
    return {"case": name, "stages": [s["stage"] for s in manifest["stages"]],
            "full_s": round(full, 3), "noop_cli_s": round(noop_cli, 3),
            "noop_in_process_s": round(noop_in, 4),
            "noop_cli_pct": round(100 * noop_cli / full, 2),
            "noop_in_process_pct": round(100 * noop_in / full, 3)}


def write_config(folder: Path, model: dict, **extra) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"model": model, "parallel": {"tp": 2, "moe_ep": 2}, "workdir": "work", **extra}
    (folder / "moepipe.yaml").write_text(yaml.safe_dump(data))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0, help="synthetic model size in GB")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moepipe-build-bench"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True)
    env = {**os.environ, "MOEPIPE_CACHE_DIR": str(args.workdir / "cache"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    results = []

    tiny = args.workdir / "tiny"
    write_config(tiny, {"example": "tiny-mixtral"},
                 quantize={"format": "fp8", "kv_cache": "fp8"})
    results.append(measure("tiny-mixtral fp8 (quantize+convert+quality)", tiny, env))

    big = args.workdir / "synthetic"
    source = args.workdir / "synthetic-model"
    size, _ = make_checkpoint(source, args.gb * 1e9)
    write_config(big, {"path": str(source)})
    results.append(measure(f"synthetic Mixtral {size / 1e9:.2f} GB (hash+convert)", big, env))

    print(f"{'case':48} {'full s':>8} {'no-op CLI s':>12} {'%':>6} {'no-op in-proc s':>16} "
          f"{'%':>7}")
    for r in results:
        print(f"{r['case']:48} {r['full_s']:8.2f} {r['noop_cli_s']:12.3f} "
              f"{r['noop_cli_pct']:6.2f} {r['noop_in_process_s']:16.4f} "
              f"{r['noop_in_process_pct']:7.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

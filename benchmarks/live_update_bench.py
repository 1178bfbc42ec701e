"""A live weight update against a redeploy, under load, on the cpu target (issue 23).

    python benchmarks/live_update_bench.py [--workdir DIR] [--clients 3] [--max-tokens 16]
                                           [--window 4] [--json FILE]

The tiny Mixtral example deployed for real (tritonserver, world size 1); ``--clients`` gRPC
clients send greedy requests to its ``tensorrt_llm`` model without pause (a failed client
opens a new stream 0.1 s later, as a retrying client does). Then, in the same run:

* **live update**: ``moepipe deploy`` of a build whose expert 1 of layer 0 was re-trained:
  the changed tensors are staged beside the serving version, validated (smoke + accuracy
  against transformers) through the live server, and switched to between two steps;
* **redeploy**: what ``moepipe deploy`` did before: the server stopped and started on the
  other build (``moepipe stop`` + ``moepipe deploy``).

For each: requests failed (a retrying client counts each attempt that got an error), the
longest time without an answer from the command to ``--window`` seconds after it returned,
the time from the command until every answer is the new version's, request latency p50/p99
during the change against the ``--window`` seconds before it (the baseline of the same run,
after a warm-up), and for the update the memory the new version adds (tensor storages it does
not share with the old one) and the bytes it read.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))
from helpers import make_config  # noqa: E402
from live_load import Answer, Load, longest_gap  # noqa: E402
from retrained import retrain_experts  # noqa: E402

from moepipe.commands.build import run_build  # noqa: E402
from moepipe.commands.deploy import artifacts, run_deploy, state_dir  # noqa: E402
from moepipe.commands.validate import endpoint_for  # noqa: E402
from moepipe.config import MoepipeConfig, load_config  # noqa: E402
from moepipe.deploy.local import lifecycle  # noqa: E402
from moepipe.examples import write_example  # noqa: E402
from moepipe.runtime.checkpoint import load_checkpoint  # noqa: E402
from moepipe.runtime.generate import generate  # noqa: E402
from moepipe.runtime.model import ReferenceModel  # noqa: E402

PROMPTS = [[1, 5, 9, 2, 7], [30, 31, 2, 8], [11, 3, 250, 4, 4, 9], [7, 7, 100]]
WARMUP_S = 2.0  # before the baseline window: the first requests of a fresh server are slow


def use(workdir: Path, source: Path) -> MoepipeConfig:
    """The workdir's config pointing at ``source`` (the user edits moepipe.yaml)."""
    path = workdir / "moepipe.yaml"
    data = yaml.safe_load(path.read_text())
    data["model"] = {"path": str(source)}
    path.write_text(yaml.safe_dump(data))
    return load_config(path)


def build(cfg: MoepipeConfig, max_tokens: int) -> list[list[int]]:
    """Build ``cfg``; the greedy tokens of PROMPTS on it (the reference runtime)."""
    run_build(cfg.workdir / "moepipe.yaml", echo=lambda s: None)
    model = ReferenceModel(load_checkpoint(artifacts(cfg).checkpoint_dir))
    return [generate(model, [p], max_tokens)[0] for p in PROMPTS]


def p(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 3) if values else float("nan")


def figures(answers: list[Answer], began: float, returned: float, window: float,
            want_new: list[list[int]]) -> dict:
    """What a change under load cost the clients."""
    before = [a.latency for a in answers if a.tokens is not None
              and began - window <= a.started and a.ended < began]
    during = [a.latency for a in answers if a.tokens is not None
              and a.ended >= began and a.started <= returned]
    failed = [a for a in answers if a.tokens is None and a.ended >= began - window]
    old = [a.ended for a in answers if a.ended >= began and a.tokens is not None
           and a.tokens != want_new[a.prompt]]
    new = [a.ended for a in answers if a.ended >= began and a.tokens == want_new[a.prompt]]
    # every answer after this instant is the new version's
    settled = max(old, default=began)
    first_new = min((t for t in new if t >= settled), default=float("nan"))
    return {"failed": len(failed), "answers": len(answers),
            "errors": sorted({a.error[:120] for a in failed})[:3],
            "longest_gap_s": round(longest_gap(answers, began, returned + window), 3),
            "command_s": round(returned - began, 3),
            "new_weights_serving_s": round(first_new - began, 3),
            "p50_before_s": p(before, 50), "p99_before_s": p(before, 99),
            "p50_during_s": p(during, 50), "p99_during_s": p(during, 99),
            "p99_ratio": round(p(during, 99) / p(before, 99), 2) if before and during
            else None}


def under_load(cfg: MoepipeConfig, change, clients: int, max_tokens: int, window: float,
               want_new: list[list[int]]) -> tuple[dict, object]:
    ep = endpoint_for(cfg, None, None)
    load = Load(ep.grpc, PROMPTS, max_tokens, clients=clients).start()
    time.sleep(WARMUP_S + window)  # the first requests warm the model up; then the baseline
    began = time.monotonic()
    result = change()
    returned = time.monotonic()
    time.sleep(window)
    answers = load.stop()
    return figures(answers, began, returned, window, want_new), result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--window", type=float, default=4.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="live-update-bench-"))
    (root / "sources").mkdir(parents=True, exist_ok=True)
    v1 = write_example("tiny-mixtral", root / "sources" / "v1")
    v2 = retrain_experts(v1, root / "sources" / "v2", layer=0, experts=(1,), seed=1)
    workdir = root / "work"
    make_config(workdir, parallel={"tp": 1, "moe_ep": 1}, validate={"max_tokens": 8})
    cfg1 = use(workdir, v1)
    want1 = build(cfg1, args.max_tokens)
    cfg2 = use(workdir, v2)
    want2 = build(cfg2, args.max_tokens)
    assert want1 != want2, "the re-trained expert does not change the answers"
    out: dict = {"clients": args.clients, "max_tokens": args.max_tokens,
                 "window_s": args.window}
    run_deploy(cfg1, echo=lambda s: None)
    try:
        live, result = under_load(cfg1, lambda: run_deploy(cfg2, echo=print), args.clients,
                                  args.max_tokens, args.window, want2)
        assert isinstance(result, dict) and result.get("updated"), result
        live.update({k: result[k] for k in ("changed_tensors", "total_tensors", "read_bytes",
                                            "extra_bytes", "stage_s", "validate_s",
                                            "switch_s", "serving_s")})
        out["live_update"] = live

        def redeploy():
            lifecycle.stop(state_dir(cfg2))
            return run_deploy(cfg1, echo=lambda s: None)

        out["redeploy"], _ = under_load(cfg1, redeploy, args.clients, args.max_tokens,
                                        args.window, want1)
    finally:
        lifecycle.stop(state_dir(cfg1), grace=40)
    lu, rd = out["live_update"], out["redeploy"]
    out["ratios"] = {
        "new_weights_serving": round(lu["new_weights_serving_s"] / rd["new_weights_serving_s"],
                                     3),
        "longest_gap": round(lu["longest_gap_s"] / rd["longest_gap_s"], 3)}
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

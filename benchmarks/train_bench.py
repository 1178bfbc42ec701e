"""Trained-example benchmark: training time on this machine, and what the training bought.

For each trained example (``moepipe.examples.trained_examples()``), in a fresh cache:

* training time: wall clock and CPU time of ``write_example`` (tokenizer + training + save),
  with the machine's load average before and after (other work on a shared machine slows it:
  the CPU seconds divided by the pinned 2 threads are what an idle 2-core machine would take);
* held-out perplexity (chapters the model never saw) next to a unigram baseline (word
  frequencies alone);
* the router's expert load per layer on the held-out text (top-k choices counted per expert:
  std/mean and max/mean; a perfectly even router has 0 and 1);
* the greedy continuation (32 tokens) of the README's prompt.

    python benchmarks/train_bench.py [--examples NAME ...] [--json F] [--cache DIR]

Figures go to the README; no test asserts timings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

PROMPT = "It is a truth universally acknowledged"


def heldout_windows(tokenizer, length: int = 128, count: int = 40) -> list[list[int]]:
    from moepipe.examples.trained import heldout_text

    ids = tokenizer(heldout_text(), add_special_tokens=False).input_ids
    return [ids[i * length:(i + 1) * length] for i in range(min(count, len(ids) // length))]


def evaluate(folder: Path) -> dict:
    """Held-out perplexity, per-layer expert load and the greedy answer of a saved example."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moepipe.examples.routing import RouterTap

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    cfg = model.config
    windows = heldout_windows(tok)
    nll = 0.0
    tokens = 0
    counts = None
    unigram = torch.zeros(cfg.vocab_size)
    # the experts each router really chose (DeepSeek: after group limit and correction bias)
    with torch.no_grad(), RouterTap(model) as tap:
        layer_of = {id(m): int(n.split("layers.")[1].split(".")[0])
                    for n, m in model.named_modules() if m in tap.routers}
        for ids in windows:
            x = torch.tensor([ids])
            tap.clear()
            out = model(input_ids=x)
            nll += float(torch.nn.functional.cross_entropy(out.logits[0, :-1], x[0, 1:],
                                                           reduction="sum"))
            tokens += len(ids) - 1
            per_layer = torch.stack([torch.bincount(indices.flatten(), minlength=logits.shape[-1])
                                     for _, logits, indices in tap.calls]).float()
            counts = per_layer if counts is None else counts + per_layer
            unigram += torch.bincount(x[0], minlength=cfg.vocab_size)
        layers = [layer_of[id(module)] for module, _, _ in tap.calls]
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(prompt, max_new_tokens=32, do_sample=False)
    p = (unigram + 1) / (unigram + 1).sum()  # add-one unigram fitted on the held-out text
    uni = float(-(unigram * p.log()).sum() / unigram.sum())
    # The formula of `moepipe validate`'s balance job (there: counted from the server's
    # expert counters; here: from the router of transformers on the held-out text).
    from moepipe.validate.jobs.balance import imbalance

    load = []
    for n, c in zip(layers, counts.numpy(), strict=True):
        stats = imbalance(c)
        load.append({"layer": n, "std_over_mean": round(stats["std_over_mean"], 3),
                     "max_over_mean": round(stats["max_over_mean"], 3)})
    return {"heldout_tokens": tokens, "heldout_ppl": round(math.exp(nll / tokens), 2),
            "unigram_ppl": round(math.exp(uni), 2), "expert_load": load,
            "answer": tok.decode(gen[0, prompt.shape[1]:])}


def bench(name: str, cache: Path | None) -> dict:
    from moepipe.examples import write_example

    with tempfile.TemporaryDirectory(prefix="moepipe-train-bench-") as tmp:
        # A fresh cache, so the example is trained here (--cache DIR: a fresh folder to keep).
        cache = cache or Path(tmp) / "cache"
        if (cache / "examples").is_dir() and any(
                p.name.startswith(name + "-") for p in (cache / "examples").iterdir()):
            raise SystemExit(f"{cache} already holds {name}: give an empty cache folder")
        os.environ["MOEPIPE_CACHE_DIR"] = str(cache)
        load_before = os.getloadavg()[0]
        w0, c0 = time.perf_counter(), time.process_time()
        folder = write_example(name, Path(tmp) / name,
                               progress=lambda text: print(f"  {name}: {text}",
                                                           file=sys.stderr, flush=True))
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        load_after = os.getloadavg()[0]
        training = json.loads((folder / "moepipe-training.json").read_text())
        result = {"example": name, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                  "threads": training["recipe"]["threads"],
                  "loadavg_1min": [round(load_before, 1), round(load_after, 1)],
                  "cores": os.cpu_count(), "steps": training["steps"],
                  "tokens": training["tokens"], "loss_first": training["loss_first"],
                  "loss_last": training["loss_last"], **evaluate(folder)}
    return result


def main() -> None:
    from moepipe.examples import trained_examples

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--examples", nargs="*", default=trained_examples())
    ap.add_argument("--json", type=Path)
    ap.add_argument("--cache", type=Path, help="keep the trained examples in this cache")
    args = ap.parse_args()
    results = []
    for name in args.examples:
        r = bench(name, args.cache)
        results.append(r)
        load = ", ".join(f"{x['std_over_mean']}/{x['max_over_mean']}" for x in r["expert_load"])
        print(f"{name}: trained in {r['wall_s']} s wall, {r['cpu_s']} s CPU "
              f"({r['threads']} threads, load {r['loadavg_1min'][0]}->{r['loadavg_1min'][1]} "
              f"on {r['cores']} cores); loss {r['loss_first']} -> {r['loss_last']}; held-out "
              f"ppl {r['heldout_ppl']} (unigram {r['unigram_ppl']}); expert load std/mean, "
              f"max/mean per layer: {load}\n  {PROMPT!r} -> {r['answer']!r}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""Expert placement from measured load, for TensorRT-LLM's static MoE load balancer
(:mod:`moepipe.trtllm.load_balancer` states its format and rules); tokens of an expert with
several slots are assumed shared evenly among them.

:func:`place` minimises the load of the hottest rank: the hottest experts get the redundant
slots (each extra copy goes to the expert with the highest load per copy, as DeepSeek's EPLB
does), then copies are packed heaviest first onto the least-loaded rank that has a free slot
and no copy of the same expert yet.
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from moepipe.arch.bounds import MAX_EXPERTS, MAX_LAYERS
from moepipe.deploy.metric_names import MAX_COUNT, METRICS_LIMIT, expert_token_counts
from moepipe.errors import ConfigError
from moepipe.trtllm.load_balancer import check_load_balancer
from moepipe.utils.bounded import decode_utf8, loads_json, read_file, refuse_pickle
from moepipe.utils.fs import write_text_atomic

# A counts file: as large as a metrics page may be.
COUNTS_LIMIT = METRICS_LIMIT


# The work a placement may take, whatever the counts say (a few seconds of Python each): pair
# comparisons of the swap search, shared by all layers (DeepSeek-V3's 58 layers place as well
# with 1/58 of it each as with all of it), and layers x slots x ranks of the greedy packing.
IMPROVE_BUDGET = 16_000_000
MIN_LAYER_BUDGET = 20_000
PLACE_WORK = 1 << 26


@dataclass(frozen=True)
class LayerPlacement:
    slots: list[int]  # expert per global slot
    rank_load: list[float]  # predicted tokens per rank

    @property
    def max_over_mean(self) -> float:
        mean = sum(self.rank_load) / len(self.rank_load)
        return max(self.rank_load) / mean if mean else 1.0


def rank_loads(slots: list[int], counts: list[float], ep: int) -> list[float]:
    """Tokens each EP rank receives when ``slots`` holds the experts (an expert's tokens are
    split evenly over its copies)."""
    copies = [0] * len(counts)
    for e in slots:
        copies[e] += 1
    per = len(slots) // ep
    return [sum(counts[e] / copies[e] for e in slots[r * per:(r + 1) * per])
            for r in range(ep)]


def default_slots(num_experts: int, ep: int) -> list[int]:
    """TensorRT-LLM's placement without a balancer: contiguous expert ranges per rank."""
    return list(range(num_experts))


def _check(counts: list[float], ep: int, num_slots: int) -> None:
    e = len(counts)
    if ep < 1 or e % ep:
        raise ConfigError(f"{e} experts cannot be split over moe_ep={ep} ranks",
                          "moe_ep must divide the number of experts")
    if num_slots < e or num_slots % ep:
        raise ConfigError(f"num_slots={num_slots} must be at least the {e} experts and a "
                          f"multiple of moe_ep={ep}",
                          f"for example {e} (no redundant experts) or {e + ep}")
    if num_slots - e > e * (ep - 1):
        raise ConfigError(f"num_slots={num_slots}: more redundant copies than ranks to put "
                          "them on", f"use at most {e * ep} slots")
    if any(c < 0 for c in counts):
        raise ConfigError("expert token counts must not be negative")
    if ep * num_slots > PLACE_WORK:  # the greedy packing looks at every rank for every slot
        raise ConfigError(f"{num_slots} slots on moe_ep={ep} ranks is a larger placement than "
                          f"moepipe computes (slots x ranks at most {PLACE_WORK})",
                          "use fewer slots or EP ranks")


def place(counts: list[float], ep: int, num_slots: int, budget: int = IMPROVE_BUDGET
          ) -> LayerPlacement:
    """Placement of one layer's experts with token ``counts`` on ``ep`` ranks (``budget``:
    pair comparisons the swap search may make)."""
    _check(counts, ep, num_slots)
    e = len(counts)
    copies = [1] * e
    heap = [(-c, i) for i, c in enumerate(counts)]
    heapq.heapify(heap)
    for _ in range(num_slots - e):  # a copy more for the expert with most load per copy
        while True:
            _, i = heapq.heappop(heap)
            if copies[i] < ep:
                break
        copies[i] += 1
        heapq.heappush(heap, (-counts[i] / copies[i], i))
    items = sorted(((counts[i] / copies[i], i) for i in range(e) for _ in range(copies[i])),
                   key=lambda x: (-x[0], x[1]))
    per = num_slots // ep
    load = [0.0] * ep
    held: list[list[int]] = [[] for _ in range(ep)]
    for share, i in items:
        free = [r for r in range(ep) if len(held[r]) < per and i not in held[r]]
        if not free:  # only copies of this expert have room left: allow a second copy
            free = [r for r in range(ep) if len(held[r]) < per]
        r = min(free, key=lambda r: (load[r], r))
        held[r].append(i)
        load[r] += share
    _improve(held, load, [counts[i] / copies[i] for i in range(e)], budget)
    slots = [i for r in range(ep) for i in sorted(held[r])]
    return LayerPlacement(slots, rank_loads(slots, counts, ep))


def _improve(held: list[list[int]], load: list[float], share: list[float], budget: int
             ) -> None:
    """Swap a copy on the hottest rank with a lighter copy elsewhere while that lowers the
    hotter of the two ranks (greedy packing leaves a few percent on small layers), within
    ``budget`` pair comparisons (unbounded, a layer of 4096 experts took half a minute)."""
    slots = sum(map(len, held))
    while budget > 0:
        hot = max(range(len(load)), key=lambda r: load[r])
        budget -= len(held[hot]) * (slots - len(held[hot]))
        best = None
        for r in range(len(held)):
            if r == hot:
                continue
            for a in held[hot]:
                for b in held[r]:
                    d = share[a] - share[b]
                    if d <= 0 or (a != b and (a in held[r] or b in held[hot])):
                        continue
                    new = max(load[hot] - d, load[r] + d)
                    if new < load[hot] - 1e-12 and (best is None or new < best[0]):
                        best = (new, r, a, b, d)
        if best is None:
            return
        _, r, a, b, d = best
        held[hot].remove(a)
        held[r].remove(b)
        held[hot].append(b)
        held[r].append(a)
        load[hot] -= d
        load[r] += d


# -- counts in, placement out ---------------------------------------------------------------

def counts_from_metrics(text: str, where: str) -> dict[int, list[float]]:
    """Per-layer expert token counts from Prometheus text (a Triton ``/metrics`` page of the
    cpu target: ``moepipe_expert_tokens_total{model,layer,expert}``)."""
    cells: dict[int, dict[int, float]] = {}
    for (layer, expert), tokens in expert_token_counts(text, where).items():
        cells.setdefault(layer, {})[expert] = tokens
    if not cells:
        raise ConfigError(f"{where}: no moepipe_expert_tokens_total samples",
                          "point --metrics at a running cpu deployment's metrics port "
                          "(http://127.0.0.1:8002/metrics) after it served some requests")
    # a layer that routed nothing while the others routed tokens is a dense layer (DeepSeek's
    # first_k_dense_replace): it has no experts to place
    rows = {layer: _dense(row, f"{where} layer {layer}") for layer, row in cells.items()}
    if any(sum(r) for r in rows.values()):
        rows = {layer: r for layer, r in rows.items() if sum(r)}
    return rows


def _dense(row: dict[int, float], where: str) -> list[float]:
    n = max(row) + 1  # expert indices are bounded by expert_token_counts
    missing = [e for e in range(n) if e not in row]
    if missing:
        raise ConfigError(f"{where}: no count for expert(s) {missing[:5]}")
    return [row[e] for e in range(n)]


@dataclass(frozen=True)
class DumpMapping:
    """How the deployment that wrote a TensorRT-LLM expert-statistic folder ran: its ranks
    and, when its MoE load balancer was on, the slot -> expert lists of its placement."""

    tp: int
    pp: int
    attention_dp: bool
    assignments: dict[int, list[int]] | None = None


def counts_from_dump(folder: Path, mapping: DumpMapping) -> dict[int, list[float]]:
    """Counts from the folder TensorRT-LLM's expert statistics wrote
    (:mod:`moepipe.trtllm.expert_statistic`: ranks combined as the mapping requires, layer
    keys as TensorRT-LLM numbers them)."""
    from moepipe.trtllm.expert_statistic import StatisticError, combine, read_dump

    def bounded(path: Path, limit: int) -> bytes:  # moepipe's one reader of user-named files
        return read_file(path, limit, "expert-statistic file")

    try:
        counts = combine(read_dump(folder, mapping.tp * mapping.pp, read=bounded),
                         tp=mapping.tp, pp=mapping.pp, attention_dp=mapping.attention_dp,
                         assignments=mapping.assignments)
    except StatisticError as e:
        raise ConfigError(e.message, e.hint or None) from None
    if len(counts.layers) > MAX_LAYERS or any(len(r) > MAX_EXPERTS
                                              for r in counts.layers.values()):
        raise ConfigError(f"{folder}: more than {MAX_LAYERS} layers or {MAX_EXPERTS} experts")
    rows = {layer: [float(c) for c in row] for layer, row in counts.layers.items() if sum(row)}
    if not rows:
        raise ConfigError(f"{folder}: the window counted no routed tokens",
                          "serve traffic during the iteration window")
    return rows


_COUNTS_HINT = ('expected {"layers": {"0": [tokens per expert, ...], ...}}, a validate.json '
                "with a balance job, or saved metrics text")


def counts_from_file(path: Path) -> dict[int, list[float]]:
    """Counts from a JSON file ``{"layers": {"<layer>": [tokens per expert, ...]}}``, from
    ``validate.json`` (its balance job) or from saved Prometheus text; at most
    :data:`COUNTS_LIMIT` bytes of UTF-8, never a pickle, every count and index checked."""
    raw = read_file(path, COUNTS_LIMIT, "counts file")
    refuse_pickle(raw, str(path))
    text = decode_utf8(raw, str(path))
    if not text.lstrip().startswith(("{", "[")):
        return counts_from_metrics(text, str(path))
    data = loads_json(text, str(path), allow_nan=False)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not an expert-count file", _COUNTS_HINT)
    if "jobs" in data:
        return _counts_from_validate(data, path)
    layers = data.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise ConfigError(f"{path}: no layers", _COUNTS_HINT)
    out = {}
    for key, row in layers.items():
        layer = _layer_index(key, f"{path}: layer {str(key)[:40]!r}")
        if not isinstance(row, list) or not 1 <= len(row) <= MAX_EXPERTS:
            raise ConfigError(f"{path}: layer {layer} is not a list of 1..{MAX_EXPERTS} counts",
                              _COUNTS_HINT)
        out[layer] = [token_count(c, f"{path}: layer {layer} expert {e}")
                      for e, c in enumerate(row)]
    return out


def _layer_index(key: Any, where: str) -> int:
    if not isinstance(key, str) or not re.fullmatch(r"\d{1,9}", key) \
            or int(key) >= MAX_LAYERS:
        raise ConfigError(f"{where} is not a layer index in 0..{MAX_LAYERS - 1}", _COUNTS_HINT)
    return int(key)


def token_count(value: Any, where: str) -> float:
    """``value`` as a token count: a finite number in 0..2^53 (JSON's NaN and Infinity are
    refused when the file is read); anything else is a ConfigError naming ``where``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 0 <= value <= MAX_COUNT:  # an int of 400 digits too: no float overflow
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}..."
        raise ConfigError(f"{where}: {shown} is not a token count (a finite number in "
                          "0..2^53)", _COUNTS_HINT)
    return float(value)


def _counts_from_validate(data: dict, path: Path) -> dict[int, list[float]]:
    """Counts from ``validate.json``: the balance job's per-layer shares (``layer_expert``)
    times the tokens it routed in that layer (``layers[i].tokens``)."""
    jobs = data["jobs"] if isinstance(data["jobs"], list) else []
    job = next((j for j in jobs if isinstance(j, dict) and j.get("job") == "balance"), None)
    d = job.get("data") if job is not None else None
    if not isinstance(d, dict) or "layer_expert" not in d:
        raise ConfigError(f"{path}: this validate.json has no balance measurement",
                          "run `moepipe validate --job balance` on the deployment first")
    shares, layers = d.get("layer_expert"), d.get("layers")
    if not isinstance(shares, list) or not isinstance(layers, list) \
            or len(shares) != len(layers) or len(shares) > MAX_LAYERS:
        raise ConfigError(f"{path}: the balance job's layer_expert and layers do not have one "
                          "row per layer", "validate.json is damaged; validate again")
    out = {}
    for i, (row, layer) in enumerate(zip(shares, layers, strict=True)):
        if not isinstance(row, list) or not isinstance(layer, dict) \
                or not 1 <= len(row) <= MAX_EXPERTS:
            raise ConfigError(f"{path}: the balance job's layer {i} is not a row of shares",
                              "validate.json is damaged; validate again")
        tokens = token_count(layer.get("tokens", 0.0), f"{path}: layer {i} tokens")
        out[i] = [token_count(share, f"{path}: layer {i} share {e}") * tokens
                  for e, share in enumerate(row)]
    out = {i: row for i, row in out.items() if sum(row) > 0}
    if not out:
        raise ConfigError(f"{path}: the balance job routed no tokens",
                          "raise validate.balance.requests and validate again")
    return out


@dataclass(frozen=True)
class Placement:
    """A static placement for every MoE layer and what it predicts."""

    moe_ep: int
    num_slots: int
    layers: dict[int, LayerPlacement]
    before: dict[int, list[float]]  # rank loads with TensorRT-LLM's default placement

    def load_balancer(self) -> dict:
        """``moe_config.load_balancer`` of TensorRT-LLM's LLM API (MoeLoadBalancerConfig)."""
        return {"num_slots": self.num_slots, "layer_updates_per_iter": 0,
                "initial_global_assignments": {layer: p.slots
                                               for layer, p in sorted(self.layers.items())}}

    def summary(self) -> dict:
        def ratio(loads: list[float]) -> float:
            mean = sum(loads) / len(loads)
            return max(loads) / mean if mean else 1.0

        before = {k: ratio(v) for k, v in self.before.items()}
        after = {k: p.max_over_mean for k, p in self.layers.items()}
        return {"moe_ep": self.moe_ep, "num_slots": self.num_slots,
                "max_over_mean_before": max(before.values()),
                "max_over_mean_after": max(after.values()),
                "mean_max_over_mean_before": sum(before.values()) / len(before),
                "mean_max_over_mean_after": sum(after.values()) / len(after),
                "layers": {k: {"before": round(before[k], 4), "after": round(after[k], 4)}
                           for k in sorted(after)}}


def balance(counts: dict[int, list[float]], moe_ep: int, num_slots: int | None = None
            ) -> Placement:
    """Placements for every layer of ``counts``; ``num_slots`` defaults to one redundant slot
    per rank (``E + moe_ep``), the example of TensorRT-LLM's wide-EP guide."""
    sizes = {len(v) for v in counts.values()}
    if len(sizes) != 1:
        raise ConfigError(f"layers have different expert counts: {sorted(sizes)}")
    experts = sizes.pop()
    if moe_ep < 2:
        raise ConfigError("expert placement needs expert parallelism (moe_ep >= 2)",
                          "TensorRT-LLM's load balancer runs with attention DP and EP > 1")
    slots = experts + moe_ep if num_slots is None else num_slots
    _check(next(iter(counts.values())), moe_ep, slots)
    if len(counts) * slots * moe_ep > PLACE_WORK:
        raise ConfigError(f"{len(counts)} layers of {slots} slots on moe_ep={moe_ep} ranks is a "
                          f"larger placement than moepipe computes (layers x slots x ranks at "
                          f"most {PLACE_WORK})", "use fewer slots or EP ranks")
    budget = max(IMPROVE_BUDGET // len(counts), MIN_LAYER_BUDGET)
    layers = {layer: place(row, moe_ep, slots, budget) for layer, row in counts.items()}
    before = {layer: rank_loads(default_slots(experts, moe_ep), row, moe_ep)
              for layer, row in counts.items()}
    return Placement(moe_ep, slots, layers, before)


def write_placement(placement: Placement, path: Path) -> None:
    """YAML: ``moe_ep``, ``load_balancer`` (rendered into model.yaml by deploy) and the
    prediction."""
    text = ("# Expert placement written by `moepipe balance`; `deploy.trtllm.expert_placement`"
            " puts load_balancer into model.yaml's moe_config.\n"
            + yaml.safe_dump({"moe_ep": placement.moe_ep,
                              "load_balancer": placement.load_balancer(),
                              "predicted": placement.summary()},
                             sort_keys=False, default_flow_style=None))
    check_load_balancer(placement.load_balancer(), placement.moe_ep, str(path))
    write_text_atomic(path, text)


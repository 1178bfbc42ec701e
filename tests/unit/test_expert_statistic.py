"""TensorRT-LLM's expert-statistic dumps (the trtllm-pytorch target's expert counts): read
exactly as TensorRT-LLM 1.2 writes them, ranks combined as the mapping requires, pickle
refused unopened, and ``moepipe balance --counts DIR`` placing experts from them.

The dumps are written by :mod:`trtllm_dump` (upstream's recorder, cited there:
``tensorrt_llm/_torch/expert_statistic.py`` at c85e8726 / 0fccc5b9), from routing whose true
load per layer is known.
"""

import json
import os
import pickle
import time

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from trtllm_dump import simulate

from moepipe.cli import main
from moepipe.trtllm import expert_statistic as es

DEEPSEEK_LAYERS = [3, 4, 5, 6, 7, 8]  # first_k_dense_replace = 3: MoE layers from 3 on


def _truth(truth):
    return {k: [int(x) for x in v] for k, v in sorted(truth.items())}


def test_the_dump_is_upstreams_format(tmp_path):
    """What the recorder writes is what the reader reads: meta_info.json (rank 0 only), one
    rank file per rank, int64 count vectors keyed ITER_LAYER for every iteration of the window
    and every layer of the rank's stage."""
    simulate(tmp_path, tp=2, pp=2, attention_dp=True, layers=DEEPSEEK_LAYERS, experts=8,
             top_k=2, span="3-6")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "meta_info.json", "rank0.safetensors", "rank1.safetensors", "rank2.safetensors",
        "rank3.safetensors"]
    assert json.loads((tmp_path / "meta_info.json").read_text()) == {
        "num_experts": 8, "num_experts_per_token": 2}
    rank0, rank2 = load_file(tmp_path / "rank0.safetensors"), load_file(
        tmp_path / "rank2.safetensors")
    assert sorted(rank0) == sorted(f"{i}_{layer}" for i in (3, 4, 5) for layer in (3, 4, 5))
    assert sorted(rank2) == sorted(f"{i}_{layer}" for i in (3, 4, 5) for layer in (6, 7, 8))
    assert {v.dtype for v in rank0.values()} == {torch.int64}
    ours = es.read_counts(tmp_path / "rank0.safetensors")
    assert {f"{i}_{layer}" for i, layer in ours} == set(rank0)
    assert all(np.array_equal(ours[(3, 3)], rank0["3_3"].numpy()) for _ in [0])


@pytest.mark.parametrize(("tp", "pp"), [(4, 1), (2, 2)])
def test_attention_dp_sums_the_ranks_of_each_stage(tmp_path, tp, pp):
    truth = simulate(tmp_path, tp=tp, pp=pp, attention_dp=True, layers=DEEPSEEK_LAYERS,
                     experts=8, top_k=2, span="10-14", skew=0.4)
    counts = es.combine(es.read_dump(tmp_path, tp * pp), tp=tp, pp=pp, attention_dp=True)
    assert counts.layers == _truth(truth)
    assert list(counts.layers) == DEEPSEEK_LAYERS  # TensorRT-LLM's layer indices, as keys
    assert counts.iterations == (10, 14) and counts.top_k == 2
    assert counts.ranks_per_layer[3] == list(range(tp))


def test_without_attention_dp_each_stage_counts_every_token_once(tmp_path):
    """The tp ranks of a stage hold the same tokens: one rank's counts are the load (the sum
    would count every token tp times), and the ranks must agree."""
    truth = simulate(tmp_path, tp=2, pp=2, attention_dp=False, layers=DEEPSEEK_LAYERS,
                     experts=8, top_k=2, span="0-3")
    counts = es.combine(es.read_dump(tmp_path, 4), tp=2, pp=2, attention_dp=False)
    assert counts.layers == _truth(truth)
    assert sum(counts.layers[3]) == 3 * 7 * 2  # 3 iterations x 7 tokens x top-2
    assert counts.ranks_per_layer == {layer: [0] if layer < 6 else [2]
                                      for layer in DEEPSEEK_LAYERS}


def test_a_dump_of_attention_dp_read_without_it_is_refused(tmp_path):
    simulate(tmp_path, tp=2, pp=1, attention_dp=True, layers=[0, 1], experts=4, top_k=1,
             span="0-2")
    dump = es.read_dump(tmp_path, 2)
    with pytest.raises(es.StatisticError, match="disagree on layer 0.*attention DP"):
        es.combine(dump, tp=2, pp=1, attention_dp=False)


def test_slot_counts_of_the_load_balancer_become_expert_counts(tmp_path):
    """With TensorRT-LLM's load balancer the counts are per slot (num_slots long); the
    placement's slot -> expert lists turn them back into expert loads."""
    slots = {layer: [0, 1, 2, 3, 0, 1] for layer in (1, 2)}  # 4 experts, 6 slots on 2 ranks
    truth = simulate(tmp_path, tp=2, pp=1, attention_dp=True, layers=[1, 2], experts=4,
                     top_k=2, span="0-4", slots=slots, skew=0.5)
    dump = es.read_dump(tmp_path, 2)
    assert dump.width == 6 and dump.meta["num_experts"] == 6
    counts = es.combine(dump, tp=2, pp=1, attention_dp=True, assignments=slots)
    assert counts.layers == _truth(truth)
    with pytest.raises(es.StatisticError, match="slot counts"):
        es.combine(dump, tp=2, pp=1, attention_dp=True, assignments={1: [0, 1, 2, 3]})


def _pickled_dump(folder, name):
    folder.mkdir()
    (folder / "meta_info.json").write_text('{"num_experts": 4, "num_experts_per_token": 1}')
    (folder / name).write_bytes(pickle.dumps({"0_0": [1, 2, 3, 4]}, protocol=4))


@pytest.mark.parametrize("name", ["rank0.pkl", "rank0.safetensors"])
def test_the_older_pickle_format_is_refused_without_loading_it(tmp_path, monkeypatch, name):
    def never(*a, **k):
        raise AssertionError("pickle was loaded")

    monkeypatch.setattr(pickle, "load", never)
    monkeypatch.setattr(pickle, "loads", never)
    _pickled_dump(tmp_path / "dump", name)
    with pytest.raises(es.StatisticError, match="pickle.*never loads") as e:
        es.read_dump(tmp_path / "dump", 1)
    assert "TensorRT-LLM 1.2" in e.value.hint


def test_torch_save_archives_are_refused_too(tmp_path):
    (tmp_path / "d").mkdir()
    torch.save({"0_0": torch.ones(4)}, tmp_path / "d" / "rank0.safetensors")
    with pytest.raises(es.StatisticError, match="pickle"):
        es.read_counts(tmp_path / "d" / "rank0.safetensors")


def test_broken_and_foreign_dumps_are_errors(tmp_path):
    simulate(tmp_path / "d", tp=2, pp=1, attention_dp=True, layers=[0], experts=4, top_k=1,
             span="0-2")
    with pytest.raises(es.StatisticError, match=r"world size of 4 \(missing \[2, 3\]\)"):
        es.read_dump(tmp_path / "d", 4)
    data = (tmp_path / "d" / "rank1.safetensors").read_bytes()
    (tmp_path / "d" / "rank1.safetensors").write_bytes(data[:-5])
    with pytest.raises(es.StatisticError, match="truncated|outside the file"):
        es.read_dump(tmp_path / "d", 2)
    save_file({"model.layers.0.weight": torch.ones(4)}, tmp_path / "d" / "rank1.safetensors")
    with pytest.raises(es.StatisticError, match="not an ITER_LAYER count"):
        es.read_dump(tmp_path / "d", 2)
    save_file({"0_0": torch.ones(4)}, tmp_path / "d" / "rank1.safetensors")
    with pytest.raises(es.StatisticError, match="not a 1-D integer count"):
        es.read_dump(tmp_path / "d", 2)
    save_file({"0_0": torch.zeros(5, dtype=torch.int64)}, tmp_path / "d" / "rank1.safetensors")
    with pytest.raises(es.StatisticError, match="different lengths"):
        es.combine(es.read_dump(tmp_path / "d", 2), tp=2, pp=1, attention_dp=True)
    (tmp_path / "d" / "meta_info.json").unlink()
    with pytest.raises(es.StatisticError, match="meta_info.json: missing"):
        es.read_dump(tmp_path / "d", 2)
    with pytest.raises(es.StatisticError, match="no rank"):
        es.read_dump(tmp_path, 1)


def test_a_fifo_is_refused_not_read(tmp_path):
    os.mkfifo(tmp_path / "rank0.safetensors")  # a reader that opened it would block forever
    (tmp_path / "meta_info.json").write_text("{}")
    with pytest.raises(es.StatisticError, match="not a regular file"):
        es.read_dump(tmp_path, 1)


def test_iteration_ranges_parse_as_upstream():
    assert es.parse_range(" 100-1100 ") == (100, 1100)
    for bad in ("100", "5-5", "10-2", "a-b", "-1-3"):
        with pytest.raises(es.StatisticError):
            es.parse_range(bad)
    assert es.environment(1, 2, "/x") == {"EXPERT_STATISTIC_ITER_RANGE": "1-2",
                                           "EXPERT_STATISTIC_PATH": "/x"}


def test_the_watcher_waits_for_a_complete_dump_of_this_run(tmp_path):
    started = time.time() - 1
    watch = es.DumpWatcher(tmp_path, tp=2, pp=1, attention_dp=True, assignments=None,
                           started=started)
    assert watch.poll() is None  # nothing written
    truth = simulate(tmp_path, tp=2, pp=1, attention_dp=True, layers=[0, 1], experts=4,
                     top_k=2, span="0-3")
    assert watch.poll() is None  # first sighting: maybe still being written
    assert watch.poll().layers == _truth(truth)
    old = es.DumpWatcher(tmp_path, tp=2, pp=1, attention_dp=True, assignments=None,
                         started=time.time() + 60)
    assert old.poll() is None and old.poll() is None  # an earlier run's files never count


def _config(tmp_path, **parallel):
    data = {"model": {"example": "tiny-mixtral"}, "target": "trtllm-pytorch",
            "parallel": {"tp": 2, "moe_ep": 2, **parallel}, "workdir": str(tmp_path / "w")}
    path = tmp_path / "moepipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_balance_reads_a_dump_with_the_configs_mapping(tmp_path, capsys):
    truth = simulate(tmp_path / "dump", tp=2, pp=1, attention_dp=True, layers=[0, 1],
                     experts=8, top_k=2, span="0-20", skew=0.6, tokens=32)
    out = tmp_path / "placement.yaml"
    main(["balance", "--counts", str(tmp_path / "dump"), "-c",
          str(_config(tmp_path, attention_dp=True)), "--out", str(out), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert set(summary["layers"]) == {"0", "1"}
    placed = yaml.safe_load(out.read_text())
    assert set(placed["load_balancer"]["initial_global_assignments"]) == {0, 1}
    # the skewed expert 0 holds most tokens: it gets the redundant slot
    hot = int(np.argmax(truth[0].numpy()))
    assert placed["load_balancer"]["initial_global_assignments"][0].count(hot) == 2
    assert summary["max_over_mean_after"] < summary["max_over_mean_before"]


def test_balance_of_a_dump_read_with_the_wrong_mapping_is_one_line(tmp_path, capsys):
    simulate(tmp_path / "dump", tp=2, pp=1, attention_dp=True, layers=[0], experts=8,
             top_k=2, span="0-2")
    with pytest.raises(SystemExit) as e:
        main(["balance", "--counts", str(tmp_path / "dump"), "-c", str(_config(tmp_path)),
              "--out", str(tmp_path / "p.yaml")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1
    assert "attention DP" in err and not (tmp_path / "p.yaml").exists()

"""moepipe plan: exact weights from shapes, KV formulas, ranking with reasons, aiconfigurator
inputs. Full-size models come from their published config.json files (no weights)."""

import json
import re
from pathlib import Path

import pytest
import yaml

from moepipe.arch import REGISTRY
from moepipe.arch.hf import open_hf_checkpoint
from moepipe.checkpoints.reader import CheckpointReader
from moepipe.conversion.plan import plan_conversion
from moepipe.errors import MoepipeError
from moepipe.examples import family_examples
from moepipe.mapping import legal_mappings
from moepipe.planner.aic import TASK_FIELDS, aiconfigurator_task, write_aiconfigurator
from moepipe.planner.estimate import Workload
from moepipe.planner.hardware import parse_cluster
from moepipe.planner.plan import PUBLISHED, load_model, make_plan
from moepipe.sizing.gpu import kv_bytes_per_token
from moepipe.sizing.shapes import model_shape
from moepipe.sizing.weights import Sharding, model_bytes, stage_weight_bytes

FAMILIES = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"]


def published(name):
    return load_model(name)


# Published parameter counts: Mixtral-8x7B (Mistral AI), the Qwen3 model cards' 30.5B / 235B,
# DeepSeek-V3's 671B (README; main model incl. the routing bias, without the MTP layer).
PARAMETERS = {
    "Mixtral-8x7B": 46_702_792_704,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Qwen3-235B-A22B": 235_093_634_560,
    "DeepSeek-V3": 671_026_419_200,
}


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_parameter_count_of_published_configs(name):
    assert published(name).parameters() == PARAMETERS[name]


@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_parameter_count_equals_transformers_on_meta_device(name):
    """The same config, cut to 4 layers (DeepSeek-V3: 3 dense + 1 MoE) to stay fast, built by
    transformers on the meta device: every tensor the arithmetic counts exists, and no more."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads(PUBLISHED[name].read_text())
    for key in ("quantization_config", "auto_map"):
        cfg.pop(key, None)
    cfg["num_hidden_layers"] = 4
    mine = model_shape(cfg, name).parameters()
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    bias = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    assert params + bias == mine


def test_qwen3_30b_active_parameters_match_model_card():
    assert published("Qwen3-30B-A3B").active_parameters() == 3_353_032_704


def test_mixtral_bf16_bytes_equal_the_published_index():
    # model.safetensors.index.json metadata.total_size of mistralai/Mixtral-8x7B-v0.1;
    # TensorRT-LLM's checkpoint keeps the router in float32 (2 more bytes per router weight).
    m = published("Mixtral-8x7B")
    assert model_bytes(m, "none", hf_layout=True) == 93_405_585_408
    assert model_bytes(m, "none") == 93_405_585_408 + 32 * 8 * 4096 * 2


def test_deepseek_v3_fp8_block_bytes():
    # fp8 GEMM weights + one float32 scale per 128x128 block, bf16 embedding/head/norms,
    # routers and routing bias in float32 on the HF layout as published (gate bf16, bias fp32)
    m = published("DeepSeek-V3")
    assert m.published_quant == "fp8_block"
    total = model_bytes(m, "fp8_block", hf_layout=True)
    assert 673.0e9 < total < 673.3e9


# every registered family the planner reads (DeepSeek's MLA and dense layers included)
CONVERTED = [name for arch, name in family_examples().items() if arch in REGISTRY]


@pytest.mark.parametrize("family", CONVERTED)
def test_rank_bytes_equal_the_converter_plan_for_every_legal_mapping(family, examples):
    ckpt = open_hf_checkpoint(examples[family])
    model = load_model(examples[family])
    with CheckpointReader(ckpt.path) as reader:
        for dtype in ("float32", "bfloat16"):
            for m in legal_mappings(ckpt.spec, 8):
                plan = plan_conversion(ckpt.family, ckpt.spec, m, dtype, reader)
                s = Sharding(m.tp, m.pp, m.moe_tp, m.moe_ep)
                for rank in range(m.world_size):
                    assert stage_weight_bytes(model, s, m.pp_rank(rank), "none", dtype) \
                        == plan.rank_bytes(rank), (m, rank, dtype)


@pytest.mark.parametrize("name,kv", [("Mixtral-8x7B", 131_072), ("Qwen3-30B-A3B", 98_304),
                                     ("Qwen3-235B-A22B", 192_512), ("DeepSeek-V3", 70_272)])
def test_kv_bytes_per_token_whole_model_bf16(name, kv):
    # GQA: 2 x L x kv_heads x head_dim x 2 B; MLA: L x (kv_lora_rank + qk_rope_head_dim) x 2 B
    m = published(name)
    assert kv_bytes_per_token(m, Sharding(1, 1, 1, 1), m.num_layers, 2) == kv


def test_kv_bytes_per_token_split_duplicated_and_mla():
    mix, ds = published("Mixtral-8x7B"), published("DeepSeek-V3")
    # 8 KV heads: tp=8 keeps one per GPU; tp=16 duplicates it (ceil(8/16) = 1)
    assert kv_bytes_per_token(mix, Sharding(8, 1, 8, 1), 32, 2) == 131_072 // 8
    assert kv_bytes_per_token(mix, Sharding(16, 1, 16, 1), 32, 2) == 131_072 // 8
    # attention DP keeps every head for its own requests
    assert kv_bytes_per_token(mix, Sharding(8, 1, 8, 1, attention_dp=True), 32, 2) == 131_072
    # MLA's latent is not split by tp; pp splits layers; fp8 halves it
    assert kv_bytes_per_token(ds, Sharding(8, 1, 1, 8), 61, 1) == 35_136
    assert kv_bytes_per_token(ds, Sharding(8, 2, 1, 8), 31, 2) == 31 * 576 * 2


def _plan(name, cluster, target="trtllm-pytorch", **kw):
    return make_plan(published(name), parse_cluster(cluster),
                     Workload(isl=kw.pop("isl", 2048), osl=kw.pop("osl", 512), **kw), target)


@pytest.mark.parametrize("cluster", ["8xH100", "8xH200", "2x8xH100"])
@pytest.mark.parametrize("name", sorted(PARAMETERS))
def test_plan_answers_for_published_models(name, cluster):
    fmt = "fp8_block" if name == "DeepSeek-V3" else "fp8"
    plan = _plan(name, cluster, fmt=fmt)
    assert plan.candidates
    ranked = [e for e in plan.candidates if e.fits]
    if name == "DeepSeek-V3" and cluster == "8xH100":  # 673 GB of weights > 8 x 80 GiB
        assert not ranked
        assert all(e.problems for e in plan.candidates)
        return
    best = ranked[0]
    assert best.weights + best.activations + best.moe_workspace + best.runtime \
        + best.kv_budget <= plan.cluster.gpu.memory
    assert best.max_sequences >= 1 and best.tokens_per_s_per_gpu > 0


def test_mapping_that_does_not_fit_is_ranked_out_with_the_reason():
    plan = _plan("Mixtral-8x7B", "8xH100")
    single = next(e for e in plan.candidates if e.sharding.world_size == 1)
    assert not single.fits
    assert "exceed the 80 GiB of one H100" in single.problems[0]
    assert plan.candidates.index(single) > max(
        i for i, e in enumerate(plan.candidates) if e.fits)


def test_kv_too_small_for_one_sequence_is_a_reason():
    # tp=2: 43.5 GiB of weights leave ~31 GiB; 5 % of it holds 25k tokens of 64 KiB each
    plan = _plan("Mixtral-8x7B", "8xH100", isl=30000, osl=2000, kv_fraction=0.05)
    tp2 = next(e for e in plan.candidates if (e.sharding.tp, e.sharding.pp) == (2, 1)
               and not e.sharding.attention_dp)
    assert not tp2.fits and "one sequence of 32000 tokens" in tp2.problems[0]
    assert plan.best is not None and plan.best.sharding.tp >= 4


def test_format_the_gpu_cannot_run_is_a_reason():
    plan = _plan("Mixtral-8x7B", "8xA100-80", fmt="fp8")
    assert all("A100-80 has no fp8 kernels" in e.problems for e in plan.candidates)


def test_goals_rank_differently():
    thr = _plan("Qwen3-30B-A3B", "8xH100", goal="throughput")
    lat = _plan("Qwen3-30B-A3B", "8xH100", goal="latency")
    assert thr.best.tokens_per_s_per_gpu == max(e.tokens_per_s_per_gpu for e in thr.candidates)
    assert lat.best.tpot_s == min(e.tpot_s for e in lat.candidates if e.fits)


def test_plan_for_built_in_examples():
    for name in FAMILIES:
        plan = make_plan(load_model(name), parse_cluster("2xL40S"), Workload(128, 64), "cpu")
        assert plan.best is not None
        assert not any(e.sharding.attention_dp for e in plan.candidates)


@pytest.mark.parametrize("bad", ["8xH300", "H100", "0x8xH100", "8xh100x"])
def test_bad_cluster_is_a_clear_error(bad):
    with pytest.raises(MoepipeError):
        parse_cluster(bad)


def test_aiconfigurator_inputs_use_only_its_task_fields(tmp_path):
    # aiconfigurator 0.12.0 sdk/task_v2.py Task fields (subset this writer sets)
    plan = _plan("DeepSeek-V3", "8xH200", fmt="fp8_block")
    path = write_aiconfigurator(plan, "deepseek-ai/DeepSeek-V3", tmp_path)
    doc = yaml.safe_load(path.read_text())
    assert doc["exps"] == ["moepipe_agg"]
    task = doc["moepipe_agg"]
    assert set(task) <= set(TASK_FIELDS)
    assert task["system_name"] == "h200_sxm" and task["total_gpus"] == 8
    assert task["isl"] == 2048 and task["osl"] == 512 and task["serving_mode"] == "agg"
    # attention DP in aiconfigurator: attention tp 1, dp = the group; moe_tp x moe_ep = tp x dp
    assert 8 in task["agg_dp_candidates"] and 1 in task["agg_tp_candidates"]


def test_aiconfigurator_refuses_a_gpu_it_has_no_data_for():
    plan = _plan("Qwen3-30B-A3B", "8xA100-40")
    with pytest.raises(MoepipeError, match="no performance data"):
        aiconfigurator_task(plan, "Qwen/Qwen3-30B-A3B")


def test_published_configs_are_shipped():
    for path in PUBLISHED.values():
        assert Path(path).is_file()


def _cli(capsys, *argv):
    """moepipe's real entry point in this process: (exit status, stdout, stderr)."""
    from moepipe.cli import main

    try:
        main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_plan_json(capsys):
    code, out, err = _cli(capsys, "plan", "Qwen3-30B-A3B", "--cluster", "2x8xH100", "--isl",
                          "1024", "--osl", "256", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["model"]["parameters"] == PARAMETERS["Qwen3-30B-A3B"]
    assert data["cluster"] == {**data["cluster"], "gpus": 16, "gpus_per_node": 8}
    first = data["plans"][0]
    assert first["rank"] == 1 and first["fits"]
    assert set(first["comm_bytes_per_token_per_gpu"]) == {"tp_allreduce", "ep_alltoall",
                                                          "pp_sendrecv"}
    assert data["host_memory"]["convert"] > 0 and data["host_memory"]["quantize"] > 0


def test_cli_plan_table_and_aiconfigurator_write(tmp_path, capsys):
    code, out, err = _cli(capsys, "plan", "Mixtral-8x7B", "--cluster", "8xH100", "--write",
                          str(tmp_path / "aic"))
    assert code == 0, err
    assert "exceed the 80 GiB of one H100" in out
    task = yaml.safe_load((tmp_path / "aic" / "aiconfigurator.yaml").read_text())["moepipe_agg"]
    assert task["model_path"] == "mistralai/Mixtral-8x7B-v0.1"


@pytest.mark.parametrize("argv,message", [
    (["--goal", "cheap"], "'cheap' is not one of 'throughput', 'latency'"),  # typer's check
    (["--cluster", "8xH300"], "GPU 'H300' is not in the planner's table"),
    (["--quantize", "int3"], "'int3' is not one of 'auto', 'none'"),
    (["--isl", "40000"], "exceeds the model's max_position_embeddings"),
])
def test_cli_plan_bad_input_is_one_line(capsys, argv, message):
    code, out, err = _cli(capsys, "plan", "Mixtral-8x7B", *argv)
    assert code == 2 and err.startswith("error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_init_plan_fills_parallel_and_build(tmp_path, monkeypatch, capsys):
    from moepipe.config import load_config

    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(capsys, "init", "--example", "tiny-qwen3-moe", "--target",
                          "trtllm-pytorch", "--plan", "--cluster", "4xL40S", "--isl", "512",
                          "--osl", "128")
    assert code == 0, err
    cfg = load_config(tmp_path / "moepipe.yaml")
    best = make_plan(load_model("tiny-qwen3-moe"), parse_cluster("4xL40S"),
                     Workload(512, 128, hf_layout=True), "trtllm-pytorch")
    top = best.best.sharding
    assert (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.attention_dp) == \
        (top.tp, top.pp, top.attention_dp)
    assert cfg.build.max_input_len == 512 and cfg.build.max_seq_len == 640
    assert "# from `moepipe plan` on 4xL40S" in (tmp_path / "moepipe.yaml").read_text()


def test_plan_says_what_moepipe_cannot_build():
    ds = _plan("DeepSeek-V3", "8xH200", fmt="fp8_block")
    assert not ds.notes  # moepipe builds DeepSeek-V3 (cpu target; trtllm-pytorch serves HF)
    assert not _plan("Mixtral-8x7B", "8xH100").notes
    engine = _plan("DeepSeek-V3", "8xH200", fmt="fp8_block", target="trtllm-engine")
    assert engine.best is None
    assert all("no DeepSeek-V3 engines" in e.problems[-1] for e in engine.candidates)


class QuantizedShapes:
    """Shapes of a modelopt unified checkpoint of ``folder`` without its data: every linear
    (expert, attention, shared expert) gains the scalar ``weight_scale`` and ``input_scale`` its
    export writes; SmoothQuant leaves routed experts unquantized."""

    LINEAR = re.compile(r"(proj|w[123])\.weight$")

    def __init__(self, folder, experts_quantized=True):
        with CheckpointReader(folder) as reader:
            self.shapes = {n: i.shape for n, i in reader.tensors.items()}
        for name, shape in list(self.shapes.items()):
            if len(shape) == 2 and self.LINEAR.search(name) \
                    and (experts_quantized or ".experts." not in name):
                module = name.removesuffix(".weight")
                self.shapes[module + ".weight_scale"] = ()
                self.shapes[module + ".input_scale"] = ()

    def has(self, name):
        return name in self.shapes

    def shape(self, name):
        return self.shapes[name]


@pytest.mark.parametrize("algo,fmt,family", [
    *[("FP8", "fp8", f) for f in FAMILIES],
    *[("W8A8_SQ_PER_CHANNEL", "int8_sq", f) for f in FAMILIES],
    ("W4A16_AWQ", "int4_awq", "tiny-mixtral-256"),
])
def test_quantized_rank_bytes_equal_the_converter_plan(algo, fmt, family, examples, tmp_path):
    from moepipe.checkpoints.modelopt import QuantInfo
    from moepipe.errors import MappingError
    from moepipe.examples import write_example

    folder = examples.get(family) or write_example(family, tmp_path / family)
    ckpt = open_hf_checkpoint(folder)
    model = load_model(folder)
    reader = QuantizedShapes(folder, experts_quantized=fmt != "int8_sq")
    checked = 0
    for m in legal_mappings(ckpt.spec, 8):
        try:
            plan = plan_conversion(ckpt.family, ckpt.spec, m, "bfloat16", reader,
                                   QuantInfo(algo, None, 128, ()))
        except MappingError:  # AWQ groups of 128 inputs do not split this way
            continue
        s = Sharding(m.tp, m.pp, m.moe_tp, m.moe_ep)
        for rank in range(m.world_size):
            assert stage_weight_bytes(model, s, m.pp_rank(rank), fmt, "bfloat16") \
                == plan.rank_bytes(rank), (m, rank)
            checked += 1
    assert checked >= 8


def test_the_planner_and_the_engine_preflight_count_the_same_weights(tmp_path):
    """One sizing model: on the trtllm-engine target the planner's weights per GPU are the
    engine pre-flight's (moepipe.trtllm.engine.engine_memory), mapping by mapping."""
    from moepipe.arch import get_family
    from moepipe.config import parse_config
    from moepipe.mapping import Mapping
    from moepipe.trtllm.engine import engine_memory

    spec = get_family("MixtralForCausalLM").spec(json.loads(PUBLISHED["Mixtral-8x7B"]
                                                            .read_text()), "Mixtral-8x7B")
    cfg = parse_config({"model": {"example": "tiny-mixtral"}, "target": "trtllm-engine",
                        "workdir": str(tmp_path)})
    plan = _plan("Mixtral-8x7B", "2x8xH100", target="trtllm-engine")
    assert len(plan.candidates) > 10
    for e in plan.candidates:
        s = e.sharding
        mapping = Mapping.create(tp=s.tp, pp=s.pp, moe_tp=s.moe_tp, moe_ep=s.moe_ep)
        assert engine_memory(cfg, spec, mapping)["weights"] == e.weights, s

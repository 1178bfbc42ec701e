"""Model configs and cluster fields that make no sense are one line and exit 2 in `plan`,
`inspect` and `convert` alike (issue 26, item 11): zero, negative, string or fractional
counts, relations that cannot hold, configs that are not a JSON object, a billion layers, and
link speeds or planner options that are zero, negative or NaN. The model checks live in one
place (moepipe.arch.bounds), which both the stages' normalised spec and the planner call."""

import json
import shutil
import time

import pytest

from moepipe.arch.bounds import LIMITS
from moepipe.arch.spec import DEFAULT_CONFIG_KEYS
from moepipe.cli import main
from moepipe.errors import CheckpointError
from moepipe.planner.plan import PUBLISHED

MIXTRAL = json.loads(PUBLISHED["Mixtral-8x7B"].read_text())


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return exc.value.code, out.err


def one_line_error(code, err):
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def plan_config(tmp_path, capsys, cfg, *argv):
    path = tmp_path / "config.json"
    path.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    t0 = time.monotonic()
    code, err = run_cli(capsys, "plan", path, *argv)
    assert time.monotonic() - t0 < 30, "plan took too long to refuse"
    return one_line_error(code, err)


@pytest.mark.parametrize("change, says", [
    ({"num_local_experts": 0}, "num_local_experts = 0 is outside 1.."),
    ({"num_local_experts": -8}, "num_local_experts = -8 is outside 1.."),
    ({"hidden_size": 0}, "hidden_size = 0 is outside 1.."),
    ({"num_attention_heads": 0}, "num_attention_heads = 0 is outside 1.."),
    ({"num_key_value_heads": 0}, "num_key_value_heads = 0 is outside 1.."),
    ({"num_hidden_layers": "32"}, "num_hidden_layers must be an integer, not '32'"),
    ({"num_hidden_layers": 32.5}, "num_hidden_layers must be an integer, not 32.5"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer, not True"),
    ({"hidden_size": float("nan")}, "hidden_size must be an integer, not nan"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 is outside 1..1024"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0 is outside 1.."),
    ({"vocab_size": 0}, "vocab_size = 0 is outside 1.."),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok = 0 is outside 1.."),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds the number of experts 8"),
    ({"num_key_value_heads": 64}, "num_attention_heads 32 is not a multiple of "
                                  "num_key_value_heads 64"),
    ({"num_key_value_heads": 5}, "is not a multiple of num_key_value_heads 5"),
    ({"hidden_size": 4100}, "hidden_size 4100 is not divisible by num_attention_heads 32"),
    ({"intermediate_size": -1}, "intermediate_size = -1 is outside 1.."),
    ({"num_hidden_layers": int("9" * 400)}, "num_hidden_layers = a 400-digit number"),
])
def test_plan_refuses_impossible_model_shapes(tmp_path, capsys, change, says):
    assert says in plan_config(tmp_path, capsys, {**MIXTRAL, **change})


def test_deepseek_numbers_are_checked_too(tmp_path, capsys):
    cfg = json.loads(PUBLISHED["DeepSeek-V3"].read_text())
    for change, says in [({"n_routed_experts": 0}, "n_routed_experts = 0"),
                         ({"kv_lora_rank": -1}, "kv_lora_rank = -1"),
                         ({"moe_layer_freq": 0}, "moe_layer_freq = 0"),
                         ({"first_k_dense_replace": 99}, "first_k_dense_replace 99 exceeds")]:
        assert says in plan_config(tmp_path, capsys, {**cfg, **change})


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "expected a JSON object, not a list"),
    ("null", "expected a JSON object, not null"),
    ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply"),
    ('{"a": 1', "not valid JSON"),
    ("{" + '"x": ' + "1" * 5000 + "}", "not valid JSON"),
])
def test_plan_refuses_configs_that_are_not_objects(tmp_path, capsys, text, says):
    assert says in plan_config(tmp_path, capsys, text)


def test_plan_refuses_a_device_as_config(capsys):
    code, err = run_cli(capsys, "plan", "/dev/zero")
    assert "/dev/zero: is a character device" in one_line_error(code, err)


@pytest.mark.parametrize("argv, says", [
    (["--nvlink-gbps", "0"], "--nvlink-gbps 0 is not a link speed"),
    (["--internode-gbps", "0"], "--internode-gbps 0 is not a link speed"),
    (["--nvlink-gbps", "-5"], "--nvlink-gbps -5 is not a link speed"),
    (["--nvlink-gbps", "nan"], "--nvlink-gbps nan is not a link speed"),
    (["--internode-gbps", "inf"], "--internode-gbps inf is not a link speed"),
    (["--max-num-tokens", "0"], "max_num_tokens 0 is outside 1.."),
    (["--top", "-3"], "Invalid value for '--top'"),
    (["--cluster", "0x8xH100"], "needs 1..4096 nodes"),
    (["--cluster", "1" * 5000 + "xH100"], "is not GPUSxKIND"),
    (["--kv-fraction", "nan"], "KV-cache memory fraction must be in (0, 1)"),
])
def test_plan_refuses_nonsense_cluster_and_options(capsys, argv, says):
    code, err = run_cli(capsys, "plan", "Mixtral-8x7B", *argv)
    assert says in one_line_error(code, err)


# Every bound of the shared check, at both ends, through both readers: the stages' normalised
# spec (arch.spec.normalize: inspect, convert, build) and the planner's shapes.
GQA = {name: keys[0] for name, keys in DEFAULT_CONFIG_KEYS.items() if keys[0] in MIXTRAL}
GQA["expert_intermediate_size"] = "intermediate_size"  # Mixtral's experts; no dense layers
GQA.pop("dense_intermediate_size")


@pytest.mark.parametrize("name", sorted(set(GQA) & set(LIMITS)))
def test_every_limit_is_enforced_by_stages_and_planner_alike(name):
    from moepipe.arch import get_family
    from moepipe.sizing.shapes import model_shape

    lo, hi = LIMITS[name]
    key = GQA[name]
    for bad in (lo - 1, hi + 1):
        cfg = {**MIXTRAL, key: bad}
        for read in (lambda c: get_family("MixtralForCausalLM").spec(c, "config.json"),
                     lambda c: model_shape(c, "m", "config.json")):
            with pytest.raises(CheckpointError, match=f"{key} = {bad} is outside {lo}..{hi}"):
                read(cfg)


@pytest.fixture()
def mixtral_folder(examples, tmp_path):
    def make(**change):
        folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        shutil.copytree(examples["tiny-mixtral"], folder)
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        return folder
    return make


@pytest.mark.parametrize("change, says", [
    ({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000 is outside 1..1024"),
    ({"num_local_experts": 0}, "num_local_experts = 0 is outside"),
    ({"num_attention_heads": 0}, "num_attention_heads = 0 is outside"),
    ({"num_key_value_heads": 0}, "num_key_value_heads = 0 is outside"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer"),
])
def test_inspect_and_convert_share_the_checks(mixtral_folder, tmp_path, capsys, change, says):
    folder = mixtral_folder(**change)
    code, err = run_cli(capsys, "inspect", folder)
    assert says in one_line_error(code, err)
    code, err = run_cli(capsys, "convert", "--model", folder, "--output", tmp_path / "out")
    assert says in one_line_error(code, err)
    assert not (tmp_path / "out").exists()


def test_inspect_refuses_more_layers_than_the_checkpoint_holds(mixtral_folder, capsys):
    """It printed a negative active-parameter count."""
    folder = mixtral_folder(num_hidden_layers=1000)
    code, err = run_cli(capsys, "inspect", folder)
    assert "are more parameters than the checkpoint's tensors hold" in one_line_error(code, err)

"""A trtllm-pytorch deployment rendered with TensorRT-LLM's expert statistics
(``deploy.trtllm.expert_statistic``): what model.py is given (tests/unit/test_pytorch_adapter.py
runs it on a dump; tests/unit/test_expert_statistic_deploy.py checks the pods and rules)."""

from moepipe.deploy.render.targets import Artifacts

WINDOW = {"trtllm": {"expert_statistic": {"start": 100, "stop": 1100}}}


def test_the_rendered_model_repository_ships_the_reader_and_the_window(examples, tmp_path):
    """config.pbtxt tells model.py the window and folder; the reader model.py imports is
    moepipe's own module, copied beside it (NVIDIA's container has no moepipe)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from moepipe.config import parse_config
    from moepipe.deploy.render.repository import render_deployment
    from moepipe.trtllm import expert_statistic

    model = examples["tiny-mixtral"]
    cfg = parse_config({"model": {"path": str(model)}, "target": "trtllm-pytorch",
                        "parallel": {"tp": 2, "moe_ep": 2}, "workdir": str(tmp_path / "w"),
                        "deploy": WINDOW}).resolve_paths(tmp_path)
    repo = render_deployment(cfg, Artifacts(version="0123456789ab", model_dir=model, vocab_size=128))
    pbtxt = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(),
                              model_config_pb2.ModelConfig())
    params = {k: v.string_value for k, v in pbtxt.parameters.items()}
    assert params["expert_statistic_iters"] == "100-1100"
    assert params["expert_statistic_path"] == str(tmp_path / "w" / "expert-statistic")
    shipped = repo / "tensorrt_llm" / "1" / "expert_statistic.py"
    assert shipped.read_text() == open(expert_statistic.__file__).read()

"""The cpu target's TensorRT-LLM metric families: the names, labels and category values of
TensorRT-LLM's Triton backend (custom_metrics_reporter.cc, pinned in
moepipe.deploy.metric_names), and values computed as model_instance_state.cc's WaitForStats
computes them."""

from dataclasses import dataclass, field

from moepipe.deploy.metric_names import CPU_TRTLLM_FAMILIES, TRTLLM_FAMILIES
from moepipe.serving import trtllm_metrics as tm


@dataclass
class FakeEngine:
    max_batch_size: int = 4
    max_seq_len: int = 100  # 4 blocks of 32 per slot
    held: list = field(default_factory=lambda: [5, 33, 64])
    waiting: int = 2
    last_step: tuple = (3, 1)

    def running_tokens(self):
        return self.held

    def load(self):
        return {"waiting": self.waiting}


def test_families_are_upstreams():
    for name, _, label, values in (tm.REQUEST, tm.KV_CACHE):
        assert name in CPU_TRTLLM_FAMILIES
        assert TRTLLM_FAMILIES[name] == (label, values)


def test_values_follow_the_executor_statistics():
    v = tm.iteration_values(FakeEngine())
    assert v["nv_trt_llm_request_metrics"] == {"active": 5, "max": 4, "scheduled": 3,
                                               "context": 1, "waiting": 2}
    kv = v["nv_trt_llm_kv_cache_block_metrics"]
    assert kv["max"] == 16 and kv["used"] == 1 + 2 + 2 and kv["free"] == 11
    assert kv["tokens_per"] == 32 and kv["reused"] == 0 and kv["fraction"] == 5 / 16


class FakePb:
    class MetricFamily:
        GAUGE = "gauge"
        made: list = []

        def __init__(self, name, description, kind):
            self.name, self.kind = name, kind
            FakePb.MetricFamily.made.append(self)

        def Metric(self, labels):  # noqa: N802 - pb_utils' spelling
            return FakePb.Gauge(self.name, labels)

    class Gauge:
        def __init__(self, family, labels):
            self.family, self.labels, self.value = family, labels, None

        def set(self, value):
            self.value = value


def test_published_series_carry_model_version_and_category_labels():
    metrics = tm.TrtllmMetrics(FakePb, "tensorrt_llm", "1")
    metrics.publish(tm.iteration_values(FakeEngine()))
    g = metrics.gauges["nv_trt_llm_request_metrics"]["waiting"]
    assert g.labels == {"model": "tensorrt_llm", "version": "1", "request_type": "waiting"}
    assert g.value == 2.0
    assert {f.kind for f in metrics.families} == {"gauge"}

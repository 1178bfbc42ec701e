"""The in-flight batching engine: batching never changes results, and the request options
(streaming, stop/bad words, min_tokens, penalties, seeds, cancellation) do what they say."""

import threading
import time

import pytest
import torch

from moepipe.conversion.write import convert
from moepipe.runtime import model as runtime_model
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.generate import generate
from moepipe.runtime.model import Batch, ReferenceModel
from moepipe.runtime.sampling import SamplingParams
from moepipe.serving.batcher import Batcher
from moepipe.serving.request import GenerationRequest, RequestError

PROMPTS = [[54, 260, 402, 305, 77], [7, 300, 33, 41, 120, 9, 256, 12, 99], [3], [400] * 20]


@pytest.fixture(scope="module")
def model(examples, tmp_path_factory):
    out = tmp_path_factory.mktemp("engine") / "ckpt"
    convert(examples["tiny-qwen2-moe"], out, tp=2, moe_ep=2)
    return ReferenceModel(load_checkpoint(out))


class Sink:
    def __init__(self):
        self.tokens, self.finals, self.error = [], [], None
        self.done = threading.Event()

    def on_tokens(self, tokens, log_probs, final):
        self.tokens += tokens
        self.finals.append(final)
        if final:
            self.done.set()

    def on_error(self, message):
        self.error = message
        self.done.set()


def run(engine, **kw):
    sink = Sink()
    engine.submit(GenerationRequest(on_tokens=sink.on_tokens, on_error=sink.on_error, **kw))
    return sink


@pytest.fixture
def engine(model):
    e = Batcher(model, max_batch_size=3, max_seq_len=64, max_input_len=32)
    e.start()
    yield e
    e.stop()


def test_concurrent_requests_get_what_they_would_alone(engine, model):
    sinks = [run(engine, prompt=p, max_new_tokens=4 + i, end_id=1)
             for i, p in enumerate(PROMPTS * 2)]  # more requests than slots: some wait
    for s in sinks:
        assert s.done.wait(30) and s.error is None
    for i, (p, s) in enumerate(zip(PROMPTS * 2, sinks, strict=True)):
        assert s.tokens == generate(model, [p], 4 + i, end_id=1)[0]


def test_streaming_sends_each_token_and_one_final(engine, model):
    s = run(engine, prompt=PROMPTS[1], max_new_tokens=6, streaming=True)
    assert s.done.wait(30)
    assert s.finals == [False] * 5 + [True]
    assert s.tokens == generate(model, [PROMPTS[1]], 6)[0]


def test_stop_words_min_tokens_and_bad_words(engine, model):
    ref = generate(model, [PROMPTS[0]], 8)[0]
    stop = run(engine, prompt=PROMPTS[0], max_new_tokens=8, stop_words=[ref[2:4]])
    assert stop.done.wait(30) and stop.tokens == ref[:4]
    eos = ref[1]  # pretend the 2nd token is the end id
    early = run(engine, prompt=PROMPTS[0], max_new_tokens=8, end_id=eos)
    held = run(engine, prompt=PROMPTS[0], max_new_tokens=8, end_id=eos, min_tokens=4)
    banned = run(engine, prompt=PROMPTS[0], max_new_tokens=8, bad_words=[[ref[0]]])
    for s in (early, held, banned):
        assert s.done.wait(30)
    assert early.tokens == ref[:2]
    assert len(held.tokens) >= 4 and eos not in held.tokens[:3]
    assert banned.tokens[0] != ref[0]


def test_penalties_change_the_distribution(engine, model):
    plain = run(engine, prompt=[400] * 20, max_new_tokens=6)
    rep = run(engine, prompt=[400] * 20, max_new_tokens=6, repetition_penalty=100.0,
              presence_penalty=5.0, frequency_penalty=5.0)
    for s in (plain, rep):
        assert s.done.wait(30)
    assert len(set(rep.tokens)) == len(rep.tokens)  # heavy penalties forbid repeats


def test_seeded_sampling_is_reproducible(engine):
    params = dict(prompt=PROMPTS[1], max_new_tokens=10)
    a = run(engine, sampling=SamplingParams(temperature=2.0, top_k=100, seed=5), **params)
    b = run(engine, sampling=SamplingParams(temperature=2.0, top_k=100, seed=5), **params)
    c = run(engine, sampling=SamplingParams(temperature=2.0, top_k=100, seed=6), **params)
    for s in (a, b, c):
        assert s.done.wait(30)
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_cancelled_request_frees_its_slot(engine):
    flag = threading.Event()
    s = Sink()
    engine.submit(GenerationRequest(prompt=PROMPTS[0], max_new_tokens=50,
                                    on_tokens=s.on_tokens, on_error=s.on_error,
                                    streaming=True, is_cancelled=flag.is_set))
    flag.set()
    assert s.done.wait(30) and s.error == "the request was cancelled"
    after = [run(engine, prompt=p, max_new_tokens=3) for p in PROMPTS[:3]]
    assert all(x.done.wait(30) and x.error is None for x in after)


@pytest.mark.parametrize("kw,match", [
    (dict(prompt=[], max_new_tokens=4), "prompt is empty"),
    (dict(prompt=[1], max_new_tokens=0), "max_tokens must be >= 1"),
    (dict(prompt=[1], max_new_tokens=-2**31), "above 2147483647 wrap around"),
    (dict(prompt=[1] * 33, max_new_tokens=1), "max_input_len=32"),
    (dict(prompt=[1] * 30, max_new_tokens=40), "exceeds max_seq_len=64"),
    (dict(prompt=[99999], max_new_tokens=1), "outside the vocabulary"),
])
def test_invalid_requests_are_refused(engine, kw, match):
    with pytest.raises(RequestError, match=match):
        engine.submit(GenerationRequest(**kw))


def test_expert_loop_path_matches_dense_path(model, hf_models):
    """The runtime picks a dense MoE for small work and a per-expert loop for large; both
    must give transformers' logits."""
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = hf_models["tiny-qwen2-moe"](torch.tensor([ids])).logits[0]
    dense = model.forward(Batch.single(ids), all_logits=True)
    limit = runtime_model.DENSE_LIMIT
    runtime_model.DENSE_LIMIT = 0
    try:
        loop = model.forward(Batch.single(ids), all_logits=True)
    finally:
        runtime_model.DENSE_LIMIT = limit
    assert (dense - ref).abs().max() <= 1e-4 and (loop - ref).abs().max() <= 1e-4


def test_stop_answers_requests_still_in_the_incoming_queue(model):
    e = Batcher(model, max_batch_size=3, max_seq_len=64, max_input_len=32)  # never started:
    sinks = [run(e, prompt=p, max_new_tokens=4) for p in PROMPTS]  # all sit in the queue
    e.stop()
    for s in sinks:
        assert s.done.is_set() and s.error == "the server is shutting down"


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1e-45, top_k=5, seed=1),   # 1/temperature overflows
    SamplingParams(temperature=1e-30, top_k=0, top_p=0.5, seed=2),
])
def test_degenerate_temperature_samples_like_greedy(engine, model, sampling):
    """Issue 9 case 1: a tiny temperature is the greedy limit, not inf - inf = NaN."""
    params = dict(prompt=PROMPTS[0], max_new_tokens=6)
    got = run(engine, sampling=sampling, **params)
    want = run(engine, **params)
    assert got.done.wait(30) and want.done.wait(30)
    assert got.error is None and got.tokens == want.tokens


@pytest.mark.parametrize("kw,match", [
    (dict(sampling=SamplingParams(temperature=float("nan"), top_k=5)), "temperature must be"),
    (dict(sampling=SamplingParams(temperature=float("inf"), top_k=5)), "temperature must be"),
    (dict(sampling=SamplingParams(temperature=1.0, top_p=float("nan"))), "top_p must be"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite"),
    (dict(presence_penalty=float("inf")), "presence_penalty must be a finite"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
])
def test_non_finite_sampling_settings_are_refused_at_submit(engine, kw, match):
    with pytest.raises(RequestError, match=match):
        engine.submit(GenerationRequest(prompt=[1], max_new_tokens=2, **kw))


def test_a_failing_request_fails_alone_and_frees_its_slot(engine, monkeypatch):
    """A request whose sampling fails is answered with the error and gives its slot back;
    the requests batched with it finish normally, and the engine keeps serving."""
    bad = SamplingParams(temperature=1.0, top_k=3, seed=9)
    real = GenerationRequest.process_logits

    def nan_for_bad(self, logits):
        out = real(self, logits)
        return out * float("nan") if self.sampling is bad else out

    monkeypatch.setattr(GenerationRequest, "process_logits", nan_for_bad)
    sinks = [run(engine, prompt=PROMPTS[0], max_new_tokens=8, sampling=bad)
             for _ in range(engine.max_batch_size)]
    good = [run(engine, prompt=p, max_new_tokens=5) for p in PROMPTS[:2]]
    assert all(s.done.wait(30) for s in sinks + good)
    assert all(s.error and "sampling failed" in s.error for s in sinks)
    assert all(s.error is None and len(s.tokens) == 5 for s in good)
    assert sorted(engine._free) == list(range(engine.max_batch_size))


def test_a_full_queue_refuses_at_once_as_busy_and_serves_again_after(model):
    """Slots + deploy.max_queue_size requests are held; the next is refused with Triton's
    queue-full wording, a multi-row request all-or-nothing, and once the engine drained
    requests are taken again."""
    from moepipe.serving.batcher import Busy

    e = Batcher(model, max_batch_size=2, max_seq_len=64, max_input_len=32, max_queue_size=2)
    held = [run(e, prompt=p, max_new_tokens=3) for p in PROMPTS]  # 2 slots + 2 waiting
    with pytest.raises(Busy, match="^Exceeds maximum queue size: 2 requests are waiting"):
        run(e, prompt=PROMPTS[0], max_new_tokens=3)
    assert e.admission.held == 4 and e.load()["waiting"] == 4  # nothing half-queued
    e.start()
    try:
        for s in held:
            assert s.done.wait(30) and s.error is None
        for _ in range(1000):  # a request leaves the bound just after its final response
            if not e.admission.held:
                break
            time.sleep(0.01)
        assert e.admission.held == 0
        rows = [GenerationRequest(prompt=p, max_new_tokens=3) for p in PROMPTS[:2]]
        e.submit_all(rows)  # 2 rows, room for 4
        assert run(e, prompt=PROMPTS[2], max_new_tokens=3).done.wait(30)
    finally:
        e.stop()


def test_a_multi_row_request_is_admitted_whole_or_refused_whole(model):
    from moepipe.serving.batcher import Busy

    e = Batcher(model, max_batch_size=1, max_seq_len=64, max_input_len=32, max_queue_size=1)
    run(e, prompt=PROMPTS[0], max_new_tokens=3)
    with pytest.raises(Busy):
        e.submit_all([GenerationRequest(prompt=p, max_new_tokens=3) for p in PROMPTS[:2]])
    assert e.admission.held == 1 and e.load()["waiting"] == 1
    e.stop()


def test_a_request_waiting_longer_than_the_queue_timeout_is_refused(model):
    e = Batcher(model, max_batch_size=1, max_seq_len=64, max_input_len=32,
                queue_timeout_s=0.5)
    first = run(e, prompt=PROMPTS[0], max_new_tokens=3)
    late = Sink()
    e.submit(GenerationRequest(prompt=PROMPTS[1], max_new_tokens=3, on_tokens=late.on_tokens,
                               on_error=late.on_error,
                               arrival_ns=time.monotonic_ns() - 10**9))  # waited 1 s
    e.start()
    try:
        assert late.done.wait(30) and late.error.startswith("Request timeout expired")
        assert first.done.wait(30) and first.error is None
    finally:
        e.stop()

"""A rank group of OS processes (rank 0 here, ranks 1..W-1 as ``python -m
moepipe.ranks.worker``, each loading only its own rank file, exchanging activations through
torch.distributed / gloo) reproduces Hugging Face transformers and the single-process reference,
for every family at tp=2/moe_ep=2, tp=2/moe_tp=2 and pp=2; a rank killed with SIGKILL is
noticed at once and the next group serves again."""

import os
import signal
import threading
import time

import pytest
import torch
from rank_helpers import workers

from moepipe.conversion.write import convert
from moepipe.examples import family_examples
from moepipe.ranks.errors import RANK_GROUP_LOST, RankGroupLost
from moepipe.ranks.leader import GroupSettings, Leader
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.generate import generate
from moepipe.runtime.model import Batch, ReferenceModel

FAMILIES = list(family_examples().values())
# (tp, pp, moe_tp, moe_ep): the suite's mappings with world size 2
MAPPINGS = [(2, 1, 1, 2), (2, 1, 2, 1), (1, 2, 1, 1)]
PROMPTS = [[54, 260, 402, 305, 77, 445, 510, 271, 494, 12, 99, 300],
           [7, 300, 33, 41, 120, 9, 256]]


def _leader(ckpt, address, world):
    return Leader(ckpt, GroupSettings(world, address, collective_timeout_s=30,
                                      form_timeout_s=120),
                  max_batch_size=4, max_seq_len=64)


@pytest.mark.parametrize("mapping", MAPPINGS, ids=lambda m: "tp{}pp{}mtp{}mep{}".format(*m))
def test_rank_processes_match_transformers(mapping, examples, hf_models, tmp_path):
    tp, pp, moe_tp, moe_ep = mapping
    for family in FAMILIES:
        out = tmp_path / family
        convert(examples[family], out, tp=tp, pp=pp, moe_tp=moe_tp, moe_ep=moe_ep)
        single = ReferenceModel(load_checkpoint(out))
        with workers(out, tp * pp, log_dir=tmp_path) as (address, _):
            leader = _leader(out, address, tp * pp)
            try:
                leader.form()
                model = leader.model
                assert sorted(model.ckpt.ranks) == [0]  # rank 0 loaded only its own file
                hf = hf_models[family]
                for ids in PROMPTS:
                    with torch.no_grad():
                        ref = hf(torch.tensor([ids])).logits[0]
                    ours = model.forward(Batch.single(ids), all_logits=True)
                    assert (ours - ref).abs().max().item() <= 1e-4, family
                batched = generate(model, PROMPTS, 16, end_id=1)
                assert batched == generate(single, PROMPTS, 16, end_id=1), family
                for ids, gen in zip(PROMPTS, batched, strict=True):
                    with torch.no_grad():
                        ref_gen = hf.generate(torch.tensor([ids]), max_new_tokens=16,
                                              do_sample=False, eos_token_id=1,
                                              pad_token_id=2)[0, len(ids):].tolist()
                    assert gen == ref_gen, family
                # every rank reported each step's timings: compute and collectives
                deadline = time.monotonic() + 5
                while leader.timings.steps < leader.comm.step and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert leader.timings.steps == leader.comm.step
                assert set(leader.timings.totals) == {0, 1}
                assert all(t["compute"] > 0 for t in leader.timings.totals.values())
            finally:
                leader.close()


def test_a_killed_rank_is_noticed_and_the_next_group_serves(examples, tmp_path):
    """SIGKILL of the worker: the leader notices within a second (idle, and in the middle of a
    step), refuses with the group's error, and serves again once a new worker has joined."""
    out = tmp_path / "ckpt"
    convert(examples["tiny-mixtral"], out, tp=2, moe_ep=2)
    ids = PROMPTS[0]
    expected = ReferenceModel(load_checkpoint(out)).forward(Batch.single(ids))
    with workers(out, 2, log_dir=tmp_path) as (address, procs):
        leader = _leader(out, address, 2)
        try:
            leader.form()
            assert torch.equal(leader.model.forward(Batch.single(ids)), expected)
            # idle: the connection's end is the signal
            os.kill(procs[0].pid, signal.SIGKILL)
            killed = time.monotonic()
            while leader.ready and time.monotonic() - killed < 5:
                time.sleep(0.01)
            assert not leader.ready
            assert time.monotonic() - killed < 1.0
            with pytest.raises(RankGroupLost, match=RANK_GROUP_LOST):
                leader.check()
            with pytest.raises(RankGroupLost, match="rank 1"):
                leader.model.forward(Batch.single(ids))
            # the next generation: a new worker joins; the same answer
            with workers(out, 2, port=int(address.rsplit(":", 1)[1])) as (_, again):
                assert leader.recover(threading.Event())
                assert leader.ready and leader.generation == 2
                assert torch.equal(leader.model.forward(Batch.single(ids)), expected)
                # in the middle of a step: the collective fails at once
                stall = threading.Timer(0.05, os.kill, (again[0].pid, signal.SIGKILL))
                stall.start()
                started = time.monotonic()
                with pytest.raises(RankGroupLost):
                    for _ in range(10_000):
                        leader.model.forward(Batch.single(ids * 8))
                elapsed = time.monotonic() - started
                assert elapsed < 2.0, elapsed
                assert not leader.ready
        finally:
            leader.close()


def test_the_leader_closes_its_store_socket_once(examples, tmp_path):
    """The TCPStore owns the listening descriptor it is given and closes it when dropped. The
    leader once kept a Python socket on the same number, so the number was closed twice: the
    second close hit whatever file had been opened in between (CI: a conversion's reader got
    'Bad file descriptor' after the previous family's rank group was dropped)."""
    import gc

    out = tmp_path / "ckpt"
    convert(examples["tiny-mixtral"], out, tp=2, moe_ep=2)
    leader = _leader(out, "127.0.0.1:0", 2)
    leader.close()
    store = leader.store
    del leader
    gc.collect()  # the leader and everything it held but the store are gone
    # files opened now take the lowest free descriptors, the ones the leader let go of among them
    victims = [open(out / "config.json", "rb") for _ in range(8)]  # noqa: SIM115
    try:
        del store
        gc.collect()  # the store closes its own descriptor: none of these files'
        for victim in victims:
            os.fstat(victim.fileno())
            assert victim.read(1) == b"{"
    finally:
        for victim in victims:
            try:
                victim.close()
            except OSError:
                pass

"""A worker rank's process: ``python -m moepipe.ranks.worker --leader HOST:PORT --rank R
[--checkpoint DIR]``.

It loads only ``rank{R}.safetensors`` (of ``DIR``, or of the checkpoint the leader names),
connects to the leader (retrying while the leader is not listening yet), says hello, gets the
group's settings, joins the gloo process group, and then
runs every step the leader sends until the leader stops or dissolves the group, or a
collective fails: it exits then (0 when told to, 1 otherwise) and whoever started it (the
deployment's supervisor, a LeaderWorkerSet worker's loop) starts it again for the next
generation. Its stderr is its log.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from moepipe.ranks import gloo
from moepipe.ranks.channel import HEARTBEAT_S, Channel, ChannelClosed, Kind
from moepipe.ranks.errors import RankGroupLost
from moepipe.ranks.steps import Op, Step
from moepipe.ranks.timings import StepTiming

if TYPE_CHECKING:
    from moepipe.runtime.checkpoint import TrtllmCheckpoint
    from moepipe.runtime.model import ReferenceModel

log = logging.getLogger("moepipe.worker")
MODULE = "moepipe.ranks.worker"  # how the deployment's processes are recognised on /proc


def connect(leader: str, timeout_s: float) -> Channel:
    """The control connection to ``leader`` (host:port), retried until ``timeout_s``."""
    host, port = leader.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Channel.connect(host.strip("[]"), int(port), timeout=5.0)
        except OSError as e:
            if time.monotonic() > deadline:
                raise ChannelClosed(f"cannot reach the leader at {leader}: {e}") from None
            time.sleep(0.1)


def _beat(ch: Channel) -> None:
    """Heartbeats; the leader gone (the connection broken) ends the process at once."""
    while True:
        time.sleep(HEARTBEAT_S)
        try:
            ch.send(Kind.BEAT)
        except ChannelClosed:
            log.warning("the leader closed the connection; exiting")
            os._exit(0)


def serve(args: argparse.Namespace) -> int:
    from moepipe.runtime.checkpoint import load_checkpoint
    from moepipe.runtime.model import KVCache

    started = time.monotonic()
    # with --checkpoint the rank file is loaded before the leader is reached (a restart
    # overlaps the leader's wait); without, from the path the leader sends
    ckpt = load_checkpoint(args.checkpoint, ranks=[args.rank]) if args.checkpoint else None
    ch = connect(args.leader, args.connect_timeout)
    ch.send_json(Kind.HELLO, {"rank": args.rank, "pid": os.getpid(), "host": socket.gethostname(),
                              **({"world_size": ckpt.mapping.world_size} if ckpt else {})})
    setup = ch.recv_json(Kind.SETUP)
    if ckpt is None:
        ckpt = load_checkpoint(setup["checkpoint"], ranks=[args.rank])
    world = ckpt.mapping.world_size
    if world != int(setup["world_size"]):
        raise RankGroupLost(f"the checkpoint's world size is {world}, the group's "
                            f"{setup['world_size']}")
    model, comm = _model(ckpt, args.rank)
    if Path(setup["checkpoint"]).resolve() != Path(ckpt.path).resolve():
        # the group serves a build a live update switched to since this rank's command line
        # was written: read this rank's tensors that differ
        from moepipe.runtime.update import load_update

        model = load_update(model, setup["checkpoint"]).model
    loaded = time.monotonic() - started
    torch.set_num_threads(int(setup["threads"]))
    cache = KVCache(model, int(setup["max_batch_size"]), int(setup["max_seq_len"]))
    threading.Thread(target=_beat, args=(ch,), name="moepipe-heartbeat", daemon=True).start()
    host = args.leader.rsplit(":", 1)[0].strip("[]")
    store = dist.TCPStore(host, int(setup["store_port"]), None, False,
                          timeout=datetime.timedelta(seconds=60))
    gloo.bind_gloo_to(ch.local_address)
    gloo.join(store, int(setup["generation"]), args.rank, world,
              float(setup["collective_timeout_s"]))
    comm.joined()
    log.info("rank %d joined generation %s (loaded in %.1fs)", args.rank, setup["generation"],
             loaded)
    # a later stage's tp rank 0 routes layers the leader does not hold: their expert counts go
    # back with the timings
    counts = args.rank % ckpt.mapping.tp == 0 and args.rank >= ckpt.mapping.tp
    sent = model.expert_tokens.clone()

    def report(timing: StepTiming) -> None:
        nonlocal sent
        if counts:
            delta = model.expert_tokens - sent
            sent = model.expert_tokens.clone()
            timing.experts = [[layer.index, *delta[layer.index].tolist()]
                              for layer in model.layers if layer.router is not None]
        ch.send(Kind.TIMING, json.dumps(timing.to_json()).encode())

    comm.on_end = report
    model.weights_id = int(setup.get("weights", 0))  # the version the group serves
    versions = {model.weights_id: model}  # weights id -> this rank's model of that version
    while True:
        kind, payload = ch.recv()
        if kind != Kind.STEP:
            continue
        step = Step.decode(payload)
        if step.op == Op.STOP:
            log.info("rank %d: stopped by the leader", args.rank)
            return 0
        if step.op == Op.STAGE:  # loaded beside the steps, which go on
            threading.Thread(target=_stage, args=(ch, versions, step), daemon=True,
                             name="moepipe-stage").start()
            continue
        if step.op == Op.DISCARD:
            versions.pop(step.weights, None)
            continue
        if step.batch is None:
            continue
        comm.step = step.number - 1  # begin_step counts it
        if step.weights not in versions:  # the leader ran a version this rank never staged
            raise RankGroupLost(f"weights version {step.weights} is not loaded on rank "
                                f"{args.rank}")
        versions[step.weights].run(step.batch, cache, step.all_logits)


def _stage(ch: Channel, versions: dict[int, ReferenceModel], step: Step) -> None:
    """Load weights version ``step.weights`` (this rank's changed tensors) and say so."""
    from moepipe.errors import MoepipeError
    from moepipe.runtime.update import load_update

    detail = json.loads(step.detail)
    try:
        update = load_update(versions[int(detail["base"])], detail["checkpoint"])
    except (MoepipeError, KeyError, OSError) as e:
        answer = {"weights": step.weights, "ok": False,
                  "error": getattr(e, "message", None) or str(e)}
    else:
        update.model.weights_id = step.weights
        versions[step.weights] = update.model
        answer = {"weights": step.weights, "ok": True, "read_bytes": update.read_bytes,
                  "extra_bytes": update.extra_bytes,
                  "changed_tensors": update.diff.changed_tensors}
    try:
        ch.send(Kind.STAGED, json.dumps(answer).encode())
    except ChannelClosed:
        pass


def _model(ckpt: TrtllmCheckpoint, rank: int) -> tuple[ReferenceModel, gloo.GlooComm]:
    """The rank-local model and its collectives."""
    from moepipe.runtime.model import ReferenceModel

    comm = gloo.GlooComm(rank, ckpt.mapping)
    return ReferenceModel(ckpt, comm=comm), comm


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m " + MODULE,
                                description="A worker rank of a moepipe rank group.")
    p.add_argument("--leader", required=True, help="host:port of rank 0 (the leader)")
    p.add_argument("--rank", type=int, required=True, help="this process's rank (>= 1)")
    p.add_argument("--checkpoint", type=Path, default=None,
                   help="the TensorRT-LLM checkpoint folder (rank{R}.safetensors is loaded); "
                        "default: the one the leader names")
    p.add_argument("--connect-timeout", type=float, default=300.0,
                   help="seconds to keep trying to reach the leader")
    p.add_argument("--deployment", default=None,
                   help="the model repository this rank belongs to (names it on /proc)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s moepipe rank {args.rank}: %(message)s")
    try:
        code = serve(args)
    except (ChannelClosed, RankGroupLost) as e:
        log.warning("rank %d: %s; exiting", args.rank, e)
        code = 1
    except Exception as e:  # a bad checkpoint, a bug: say it in one line, exit non-zero
        from moepipe.errors import MoepipeError

        if not isinstance(e, MoepipeError):
            raise
        log.error("rank %d: %s", args.rank, e.message)
        code = 2
    # the process group's threads may block a normal exit when a peer is gone
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

"""Rank 0 of a rank group, inside the serving process: it forms the group, starts every step
(the step description to each worker, then its own part of the forward), watches the workers
and, when one is lost, dissolves the group and forms the next one from the workers the
deployment's supervisor starts again.

Group formation (a *generation*): the leader listens on ``settings.listen``; each worker
connects, says hello (its rank, pid, world size) and gets the settings (the generation, the
rendezvous store's port, the engine limits); then every rank joins the generation's
``torch.distributed`` gloo group through the leader's ``TCPStore`` (bound next to the
listener, never on another interface).

Health: the monitor thread reads every control connection. A connection that ends (a worker
exited or was killed) or goes silent for ``HEARTBEAT_TIMEOUT_S`` marks the group lost at once:
:meth:`check` raises :class:`~moepipe.ranks.errors.RankGroupLost` from then on and
:attr:`ready` is False; a collective that fails in the middle of a step raises it too. The
leader then closes the other connections (their workers exit) and the batcher, having answered
every request in flight with that error, calls :meth:`recover`, which forms the next generation.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from moepipe.errors import MoepipeError
from moepipe.ranks import gloo
from moepipe.ranks.channel import HEARTBEAT_TIMEOUT_S, Channel, ChannelClosed, Kind
from moepipe.ranks.errors import RankGroupLost
from moepipe.ranks.steps import Op, Step
from moepipe.ranks.timings import GroupTimings, StepTiming
from moepipe.runtime.batch import Batch
from moepipe.runtime.checkpoint import load_checkpoint
from moepipe.runtime.model import ReferenceModel

log = logging.getLogger("moepipe")
HELLO_TIMEOUT_S = 10.0  # a connection that says nothing is not a worker


@dataclass(frozen=True)
class GroupSettings:
    """How the leader runs its group (``ranks.json`` of the rendered model, or the caller)."""

    world_size: int
    listen: str  # host:port the leader listens on for its workers
    collective_timeout_s: float = 60.0  # one collective; a step slower than this fails
    form_timeout_s: float = 180.0  # every worker has connected and joined within this

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])


class Leader:
    """Rank 0: the rank-local model (:attr:`model`, what the batcher runs) and its group."""

    def __init__(self, checkpoint_dir: str | Path, settings: GroupSettings, *,
                 max_batch_size: int, max_seq_len: int, threads: int = 1,
                 on_health: Callable[[bool, str | None], None] | None = None):
        self.settings, self.threads = settings, threads
        self.limits = {"max_batch_size": max_batch_size, "max_seq_len": max_seq_len}
        self.on_health = on_health
        ckpt = load_checkpoint(checkpoint_dir, ranks=[0])
        if ckpt.mapping.world_size != settings.world_size:
            raise RankGroupLost(f"the checkpoint's world size is {ckpt.mapping.world_size}, "
                                f"the group's {settings.world_size}")
        self.checkpoint_dir = str(Path(checkpoint_dir).resolve())
        self.serving_weights = 0  # the id of the weights version served (moepipe.serving.live)
        self.mapping = ckpt.mapping
        self.timings = GroupTimings(settings.world_size)
        self.comm = gloo.GlooComm(0, ckpt.mapping, on_begin=self._announce,
                                  on_end=self.timings.add, on_lost=self.mark_lost)
        self.model = ReferenceModel(ckpt, comm=self.comm)
        self.listener = socket.create_server((settings.host, settings.port))
        # The store owns the listening socket's descriptor and closes it when it is dropped:
        # the Python socket object lets go of it (detach), or it would close the same number a
        # second time later, by then perhaps a file another thread has just opened.
        store_socket = socket.create_server((settings.host, 0))
        store_port = store_socket.getsockname()[1]
        self.store = dist.TCPStore(
            settings.host, store_port, None, True, wait_for_workers=False,
            master_listen_fd=store_socket.detach())
        self.generation = 0
        self.losses = 0  # groups lost so far
        self.workers: dict[int, Channel] = {}
        self.pids: dict[int, int] = {}
        self.lost: str | None = "the rank group is being formed"
        self.lost_at: float | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._staged: dict[int, dict] = {}  # rank -> its answer to the latest STAGE
        self._staged_cv = threading.Condition()
        self._staging = -1  # the weights id of the latest STAGE
        self._monitor: threading.Thread | None = None

    # -- health (the batcher's view) ----------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.lost is None

    def check(self) -> None:
        """Raise :class:`RankGroupLost` unless the group can run steps."""
        if self.lost is not None:
            raise RankGroupLost(self.lost)

    def mark_lost(self, why: str) -> None:
        """The group cannot go on: remember why (the first reason), tell the workers (their
        connections close, so they exit) and withdraw readiness."""
        with self._lock:
            if self.lost is not None:
                return
            self.lost, self.lost_at = why, time.monotonic()
            self.losses += 1
            workers, self.workers = self.workers, {}
        log.warning("rank group lost: %s", why)
        for ch in workers.values():
            ch.close()
        if self.on_health is not None:
            self.on_health(False, why)

    def recover(self, stop: threading.Event) -> bool:
        """Form the next generation from the workers that connect (the supervisor starts them
        again); returns False when ``stop`` was set first."""
        self.mark_lost("the rank group is formed again")  # no-op when already lost
        gloo.leave()
        self.timings.forget_pending()
        while not stop.is_set() and not self._closed.is_set():
            try:
                self.form(stop)
                return True
            except (RankGroupLost, RuntimeError, OSError) as e:
                log.warning("forming the rank group again failed: %s", e)
                gloo.leave()
                time.sleep(0.2)
        return False

    # -- formation ----------------------------------------------------------------------
    def form(self, stop: threading.Event | None = None) -> None:
        """Accept every worker, hand out the settings, join the process group."""
        s, world = self.settings, self.settings.world_size
        deadline = time.monotonic() + s.form_timeout_s
        self.generation += 1
        self.lost = f"the rank group is being formed (generation {self.generation})"
        accepted: dict[int, Channel] = {}
        pids: dict[int, int] = {}
        local = s.host
        try:
            while len(accepted) < world - 1:
                if stop is not None and stop.is_set():
                    raise RankGroupLost("stopped while forming the rank group")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(1, world)) - set(accepted))
                    raise RankGroupLost(
                        f"rank(s) {', '.join(map(str, missing))} did not connect to "
                        f"{s.listen} within {s.form_timeout_s:g}s")
                self.listener.settimeout(min(left, 0.5))
                try:
                    conn, _ = self.listener.accept()
                except TimeoutError:
                    continue
                rank, pid, ch = self._hello(conn, accepted)
                if rank is not None and ch is not None:
                    accepted[rank], pids[rank] = ch, pid
                    local = ch.local_address
            setup = {"generation": self.generation, "world_size": world,
                     "store_port": self.store.port, "threads": self.threads,
                     "collective_timeout_s": s.collective_timeout_s,
                     "checkpoint": self.checkpoint_dir, "weights": self.serving_weights,
                     **self.limits}
            for ch in accepted.values():
                ch.send_json(Kind.SETUP, setup)
            gloo.bind_gloo_to(local)
            gloo.join(self.store, self.generation, 0, world,
                      max(1.0, deadline - time.monotonic()))
            self.comm.joined()
        except BaseException:
            for ch in accepted.values():
                ch.close()
            raise
        with self._lock:
            self.workers, self.pids = accepted, pids
            self.lost = None
        log.info("rank group formed (generation %d, world size %d, workers %s)",
                 self.generation, world, ", ".join(f"{r}: pid {p}" for r, p in pids.items()))
        self._monitor = threading.Thread(target=self._watch, args=(self.generation, accepted),
                                         name="moepipe-rank-monitor", daemon=True)
        self._monitor.start()
        if self.on_health is not None:
            self.on_health(True, None)

    def _hello(self, conn: socket.socket, accepted: dict[int, Channel]
               ) -> tuple[int | None, int, Channel | None]:
        ch = Channel(conn)
        conn.settimeout(HELLO_TIMEOUT_S)
        try:
            hello = ch.recv_json(Kind.HELLO)
            rank, pid = int(hello["rank"]), int(hello["pid"])
        except (ChannelClosed, ValueError, KeyError, TypeError) as e:
            log.warning("a connection that is not a moepipe worker: %s", e)
            ch.close()
            return None, 0, None
        world = self.settings.world_size
        why = None
        if int(hello.get("world_size", world)) != world:
            why = f"its checkpoint has world size {hello.get('world_size')}, the group {world}"
        elif not 1 <= rank < world:
            why = f"rank {rank} is not a worker rank of world size {world} (1..{world - 1})"
        elif rank in accepted:
            why = f"rank {rank} is already taken"
        if why is not None:
            log.warning("refused a worker (pid %d): %s", pid, why)
            try:
                ch.send_json(Kind.REFUSED, {"why": why})
            except ChannelClosed:
                pass
            ch.close()
            return None, 0, None
        conn.settimeout(None)
        return rank, pid, ch

    # -- steps ------------------------------------------------------------------------------
    def _announce(self, batch: Batch, all_logits: bool, weights: int = 0) -> None:
        """Send the step to every worker (the start of every forward on rank 0)."""
        self._send_all(Step(Op.FORWARD, self.comm.step, batch, all_logits, weights))

    def _send_all(self, step: Step) -> None:
        self.check()
        payload = step.encode()
        for rank, ch in list(self.workers.items()):
            try:
                ch.send(Kind.STEP, payload)
            except ChannelClosed:
                self.mark_lost(f"rank {rank} (pid {self.pids.get(rank)}) is unreachable")
                self.check()

    # -- weights versions (a live update: moepipe.serving.live) ------------------------------
    def stage(self, weights: int, checkpoint: str, base: int, timeout_s: float) -> dict:
        """Every worker loads weights version ``weights`` from ``checkpoint`` as an update of
        its version ``base`` (its own rank's changed tensors), beside the versions it runs;
        returns their figures summed. A worker that cannot is a MoepipeError (the version is
        then discarded everywhere); steps go on meanwhile."""
        with self._staged_cv:
            self._staged.clear()
            self._staging = weights
            generation = self.generation
        self._send_all(Step(Op.STAGE, weights=weights, detail=json.dumps(
            {"checkpoint": checkpoint, "base": base})))
        deadline = time.monotonic() + timeout_s
        with self._staged_cv:
            while len(self._staged) < self.settings.world_size - 1:
                left = deadline - time.monotonic()
                if self.generation != generation or self.lost is not None or left <= 0:
                    break
                self._staged_cv.wait(min(left, 0.2))
            acks = dict(self._staged)
        failed = [f"rank {r}: {a.get('error')}" for r, a in sorted(acks.items())
                  if not a.get("ok")]
        missing = sorted(set(range(1, self.settings.world_size)) - set(acks))
        if failed or missing:
            self.discard(weights)
            why = "; ".join(failed) or (f"rank(s) {', '.join(map(str, missing))} did not load "
                                        f"it within {timeout_s:g}s")
            raise MoepipeError(f"the rank group did not stage the new weights ({why})",
                               "the serving version keeps serving; see the worker logs")
        return {k: sum(int(a.get(k, 0)) for a in acks.values())
                for k in ("read_bytes", "extra_bytes", "changed_tensors")}

    def discard(self, weights: int) -> None:
        """Every worker drops weights version ``weights`` (no answer)."""
        try:
            self._send_all(Step(Op.DISCARD, weights=weights))
        except RankGroupLost:  # the next group loads only the serving version anyway
            pass

    def serve(self, checkpoint: str, weights: int) -> None:
        """The version the group serves from now on: what a worker of a later generation
        loads (and under which id)."""
        self.checkpoint_dir, self.serving_weights = str(Path(checkpoint).resolve()), weights

    def _staged_ack(self, rank: int, payload: bytes) -> None:
        answer = json.loads(payload)
        with self._staged_cv:
            if answer.get("weights") == self._staging:  # not a late answer to an earlier one
                self._staged[rank] = answer
                self._staged_cv.notify_all()

    def _watch(self, generation: int, workers: dict[int, Channel]) -> None:
        """Read every worker's timings and heartbeats; a closed or silent one is lost."""
        sel = selectors.DefaultSelector()
        for rank, ch in workers.items():
            sel.register(ch.sock, selectors.EVENT_READ, rank)
        seen = {rank: time.monotonic() for rank in workers}
        try:
            while self.generation == generation and self.lost is None:
                for key, _ in sel.select(timeout=0.1):
                    rank = key.data
                    try:
                        kind, payload = workers[rank].recv()
                    except ChannelClosed:
                        self.mark_lost(f"rank {rank} (pid {self.pids.get(rank)}) closed its "
                                       "connection (the process exited or was killed)")
                        return
                    seen[rank] = time.monotonic()
                    if kind == Kind.TIMING:
                        self._timing(payload)
                    elif kind == Kind.STAGED:
                        self._staged_ack(rank, payload)
                now = time.monotonic()
                for rank, t in seen.items():
                    if now - t > HEARTBEAT_TIMEOUT_S:
                        self.mark_lost(f"rank {rank} (pid {self.pids.get(rank)}) sent nothing "
                                       f"for {now - t:.1f}s")
                        return
        except (OSError, ValueError):  # the sockets were closed under us: the group is gone
            pass
        finally:
            sel.close()

    def _timing(self, payload: bytes) -> None:
        timing = StepTiming.from_json(json.loads(payload))
        for row in timing.experts or []:
            self.model.expert_tokens[row[0]] += torch.tensor(row[1:])
        self.timings.add(timing)

    def close(self) -> None:
        """Stop the workers (STOP, then the connections close) and release the ports."""
        self._closed.set()
        with self._lock:
            workers, self.workers = self.workers, {}
            self.lost = self.lost or "the server is shutting down"
        stop = Step(Op.STOP).encode()
        for ch in workers.values():
            try:
                ch.send(Kind.STEP, stop)
            except ChannelClosed:
                pass
            ch.close()
        gloo.leave()
        self.listener.close()

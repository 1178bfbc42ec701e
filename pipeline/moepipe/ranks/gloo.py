"""The runtime's :class:`~moepipe.runtime.parallel.Collectives` over ``torch.distributed`` with
the gloo backend (CPU), as TensorRT-LLM's engines place them for a mapping: the tensor-parallel
group (tp ranks of one pipeline stage; ``moe_tp x moe_ep = tp`` inside it, so expert parallelism
needs no group of its own - every rank of the group routes all tokens, runs its experts on its
slice and the sum is all-reduced, as TensorRT-LLM's ``MixtureOfExperts`` does without attention
data parallelism) all-reduces row-parallel outputs and all-gathers the vocabulary; stages pass
hidden states by send / recv. Each operation is timed (:class:`~moepipe.ranks.timings.StepClock`).

gloo binds each rank to one network interface: the one of the address the rank reaches the
leader from (``GLOO_SOCKET_IFNAME`` unless the environment sets it), so that ranks on two hosts
(or two network namespaces) find each other.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
from collections.abc import Callable

import torch
import torch.distributed as dist

from moepipe.mapping import Mapping
from moepipe.ranks.errors import RankGroupLost
from moepipe.ranks.timings import StepClock, StepTiming
from moepipe.runtime.batch import Batch

SIOCGIFADDR = 0x8915


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (None: none here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def bind_gloo_to(address: str) -> None:
    """Make gloo use the interface of ``address`` (unless ``GLOO_SOCKET_IFNAME`` is set)."""
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        name = interface_of(address)
        if name:
            os.environ["GLOO_SOCKET_IFNAME"] = name


def join(store: dist.Store, generation: int, rank: int, world_size: int,
         timeout_s: float) -> None:
    """Join the generation's process group (every rank calls it; it returns when all have)."""
    dist.init_process_group("gloo", store=dist.PrefixStore(f"g{generation}/", store), rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def leave() -> None:
    """Drop the process group (a lost group's, before the next generation joins)."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):  # already broken
            pass


class GlooComm:
    """One rank's collectives. ``on_begin(batch, all_logits, weights)`` runs at the start of
    each step (the leader sends the step there); ``on_end(timing)`` gets the step's timings;
    ``on_lost(why)`` hears of a collective that failed (before it raises)."""

    def __init__(self, rank: int, mapping: Mapping,
                 on_begin: Callable[[Batch, bool, int], None] | None = None,
                 on_end: Callable[[StepTiming], None] | None = None,
                 on_lost: Callable[[str], None] | None = None):
        self._rank, self.mapping = rank, mapping
        self.on_begin, self.on_end, self.on_lost = on_begin, on_end, on_lost
        self.clock = StepClock(rank)
        self.step = 0
        self.tp_group: dist.ProcessGroup | None = None
        self.last_stage_rank = (mapping.pp - 1) * mapping.tp  # its tp rank 0 has the logits

    def joined(self) -> None:
        """After :func:`join`: the tensor-parallel group of this rank's stage (``new_group``
        is collective: every rank creates every stage's group, in the same order)."""
        m, self.tp_group = self.mapping, None
        if m.pp > 1:
            for stage in range(m.pp):
                group = dist.new_group([stage * m.tp + t for t in range(m.tp)])
                if stage == m.pp_rank(self.rank):
                    self.tp_group = group

    @property
    def rank(self) -> int:
        return self._rank

    def _lost(self, op: str, e: Exception) -> RankGroupLost:
        why = f"{op} on rank {self.rank} failed ({str(e).splitlines()[0]})"
        if self.on_lost is not None:
            self.on_lost(why)
        return RankGroupLost(why)

    def begin_step(self, batch: Batch, all_logits: bool, weights: int = 0) -> None:
        self.step += 1
        self.clock.start(self.step)
        if self.on_begin is not None:
            with self.clock.timed("control"):
                self.on_begin(batch, all_logits, weights)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.mapping.tp == 1:
            return x
        x = x.contiguous()
        with self.clock.timed("all_reduce"):
            try:
                dist.all_reduce(x, group=self.tp_group)
            except RuntimeError as e:
                raise self._lost("all_reduce", e) from None
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.mapping.tp == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.mapping.tp)]
        with self.clock.timed("all_gather"):
            try:
                dist.all_gather(parts, x, group=self.tp_group)
            except RuntimeError as e:
                raise self._lost("all_gather", e) from None
        return torch.cat(parts, dim=-1)

    def recv_activations(self, shape: tuple[int, ...]) -> torch.Tensor:
        buf = torch.empty(shape)
        self._recv(buf, self.rank - self.mapping.tp, "recv")
        return buf

    def send_activations(self, h: torch.Tensor) -> None:
        self._send(h, self.rank + self.mapping.tp)

    def finish_step(self, logits: torch.Tensor | None, shape: tuple[int, int]
                    ) -> torch.Tensor | None:
        if self.mapping.pp > 1 and self.rank in (0, self.last_stage_rank):
            if self.rank == self.last_stage_rank and logits is not None:
                self._send(logits, 0)
            elif self.rank == 0:
                logits = torch.empty(shape)
                self._recv(logits, self.last_stage_rank, "recv")
        timing = self.clock.stop()
        if self.on_end is not None:
            self.on_end(timing)
        return logits if self.rank == 0 else None

    def _send(self, x: torch.Tensor, dst: int) -> None:
        with self.clock.timed("send"):
            try:
                dist.send(x.contiguous(), dst)
            except RuntimeError as e:
                raise self._lost(f"send to rank {dst}", e) from None

    def _recv(self, buf: torch.Tensor, src: int, op: str) -> None:
        with self.clock.timed(op):
            try:
                dist.recv(buf, src)
            except RuntimeError as e:
                raise self._lost(f"recv from rank {src}", e) from None

"""``recovery``: kill a serving process under steady load and measure how service comes back.

For each configured kill (``server``: the tritonserver process; ``backend``: the Python backend
process of the ``tensorrt_llm`` model; ``rank``: the last worker rank of a rank group, world
size > 1), under an open-loop load: the time until readiness is withdrawn and until the server
is ready again (for a rank group: Triton's readiness and ``moepipe_rank_group_up``), the time
until the first request sent after the kill succeeds, the time until a probe answers exactly
as it did before the kill (the first correct answer), and the requests lost (failed or timed
out) on the way. The load ends ``after_s`` after a request succeeds
again (with ``validate.load.processes`` 1; else at ``max_seconds`` + ``after_s``). Bringing
the process back is the supervisor's work (``moepipe deploy`` with a restart policy); the job
only kills and watches. Gate: ``validate.recovery.max_seconds`` (kill -> first successful
response).

Only for a local deployment this machine can signal (the job refuses a remote endpoint).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from moepipe.deploy.local.state import ServerState, read_state
from moepipe.validate import client, rank_figures
from moepipe.validate.base import Endpoint, JobContext
from moepipe.validate.load import run_load
from moepipe.validate.report import CheckFailed, JobResult, Skip, check
from moepipe.validate.stats import timeline
from moepipe.validate.workload import plan, prompts_for

BACKEND_STUB = "triton_python_backend_stub"


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            out.append(int(entry.name))
    return out


def backend_pid(server_pid: int, model: str = "tensorrt_llm") -> int | None:
    """PID of the Python backend stub serving ``model`` (its command line names the model's
    folder), a child of the server."""
    for pid in _children(server_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(BACKEND_STUB.encode()) and \
                any(f"/{model}/".encode() in a or a.endswith(f"/{model}".encode())
                    for a in argv[1:]):
            return pid
    return None


def _ready(ep: Endpoint) -> bool:
    """Triton's readiness and, on a rank group, the group's (Triton before 26.04 does not ask
    the model, so the group's own gauge is read too)."""
    try:
        ep.get("/v2/health/ready")
        ep.get("/v2/models/tensorrt_llm/ready")
    except Exception:  # down, restarting, or not ready yet
        return False
    return rank_figures.group_up(ep.metrics) is not False


PROBE = {"text_input": "It is a truth universally acknowledged", "max_tokens": 4}


def _probe(ep: Endpoint) -> str | None:
    """The answer to one short greedy generation through the ensemble (None: it failed)."""
    try:
        return str(client.generate(ep.http, "ensemble", PROBE, timeout=10).get("text_output"))
    except Exception:  # not yet
        return None


def recovery(ctx: JobContext) -> JobResult:
    """Kill the server, then its model's backend process, under load; watch service return."""
    ep, cfg = ctx.endpoint, ctx.cfg
    job = JobResult("recovery")
    rc = cfg.validation.recovery
    job.data["runs"] = []

    def local_state() -> ServerState:
        st = read_state(ctx.state_dir) if ctx.state_dir else None
        if st is None or f"{st.host}:{st.http_port}" != ep.http:
            raise Skip(f"{ep.http} is not this workdir's local deployment (or it is down): the "
                       "job kills processes, so it runs only against `moepipe deploy`'s own "
                       "server")
        return st

    def supervisor(before: ServerState) -> str:
        """What the deployment's supervisor did, for the failure message."""
        if before.supervisor_pid is None:
            return "the server is not supervised (deploy.max_restarts, `moepipe deploy`)"
        gave_up = ctx.state_dir / "supervisor.json" if ctx.state_dir else None
        if gave_up is not None and gave_up.is_file():
            return f"supervisor: {json.loads(gave_up.read_text()).get('gave_up', '?')}"
        return (f"supervisor: {before.restarts} of deploy.max_restarts={before.max_restarts} "
                "restarts used before the kill")

    for kill in rc.kill:
        def run(kill=kill):
            st = local_state()
            models = st.models or {}
            if kill == "rank":
                if not st.ranks:
                    raise Skip("the deployment is one process (world size 1): no worker rank "
                               "to kill")
                victim: int | None = st.ranks[max(st.ranks)]
            else:
                victim = st.pid if kill == "server" else (models.get("tensorrt_llm_0_0")
                                                           or backend_pid(st.pid))
            if victim is None:
                raise CheckFailed(f"no {BACKEND_STUB} process of tensorrt_llm under "
                                  f"server pid {st.pid}")
            expected = _probe(ep)  # what a correct answer is
            total = rc.warmup_s + rc.max_seconds + rc.after_s
            box: dict = {}
            stop = threading.Event()
            # A daemon, stopped on any exception (a signal: validate must not wait it out).
            load = threading.Thread(target=lambda: box.setdefault("res", run_load(
                plan(cfg, ep, prompts_for(cfg), schedule=[(total, rc.rate)],
                     max_requests=int(rc.rate * total) + 8, duration_s=total), stop)),
                daemon=True)
            started = time.monotonic()
            load.start()
            try:
                time.sleep(rc.warmup_s)
                killed_mono = time.monotonic()
                killed_at = killed_mono - started
                os.kill(victim, signal.SIGKILL)
                ready_at = None
                deadline = killed_at + rc.max_seconds + rc.after_s
                # readiness can outlive a dead model process for a moment (the supervisor polls):
                # wait until it is withdrawn, then until it is back
                down_by = time.monotonic() + 3.0
                withdrawn = None
                while time.monotonic() < down_by:
                    if not _ready(ep):
                        withdrawn = time.monotonic() - killed_mono
                        break
                    time.sleep(0.02)
                while time.monotonic() - started < deadline:
                    if _ready(ep):
                        ready_at = time.monotonic() - started
                        break
                    time.sleep(0.2)
                probe_ok = None  # seconds after the kill; a request of its own, sent after it
                correct = None  # ... that answered as before the kill
                while ready_at is not None and time.monotonic() - started < deadline:
                    answer = _probe(ep)
                    if answer is not None:
                        probe_ok = probe_ok or time.monotonic() - killed_mono
                        if answer == expected or expected is None:
                            correct = time.monotonic() - killed_mono
                            time.sleep(rc.after_s)  # service is back: after_s more load, then stop
                            stop.set()
                            break
                    time.sleep(0.1)
                load.join()
            except BaseException:
                stop.set()
                raise
            res = box["res"]
            kill_t = killed_mono - res.t0  # on the samples' clock
            after = [s for s in res.samples if s.sent >= kill_t]
            first_ok = min((s.done for s in after if s.status == "ok"), default=None)
            lost = [s for s in res.samples
                    if s.status in ("failed", "timeout") and s.done is not None
                    and s.done >= kill_t]
            firsts = [t for t in (None if first_ok is None else first_ok - kill_t, probe_ok)
                      if t is not None]
            served = round(min(firsts), 3) if firsts else None
            row = {"kill": kill, "pid": victim, "killed_at": round(kill_t, 3),
                   "readiness_withdrawn_after_s": None if withdrawn is None
                   else round(withdrawn, 3),
                   "time_to_ready_s": None if ready_at is None else round(ready_at - killed_at,
                                                                          3),
                   "time_to_first_success_s": served,
                   "time_to_first_correct_s": None if correct is None else round(correct, 3),
                   "requests_lost": len(lost),
                   "requests": len(res.samples),
                   "served_at": None if first_ok is None else round(first_ok, 3),
                   "timeline": timeline(res.samples, 1.0, res.wall_s)}
            job.data["runs"].append(row)
            details = {k: v for k, v in row.items() if k != "timeline"}
            check(served is not None, (
                f"no successful response within {rc.max_seconds:g}s after the {kill} was "
                f"killed (ready again: {row['time_to_ready_s']}); {len(lost)} requests lost; "
                f"{supervisor(st)}"))
            check(served <= rc.max_seconds, (
                f"service back {served:g}s after the {kill} was killed > {rc.max_seconds:g}s "
                f"(validate.recovery.max_seconds)"))
            return details

        job.run(f"kill_{kill}", run)
    return job

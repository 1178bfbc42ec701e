"""Progress of long work: the counts the work keeps (conversion bytes of every rank, training
steps, validation requests) and what a terminal or a log shows of them (moepipe.terminal).
The command line in a real pseudo-terminal: tests/e2e/test_progress_bars.py."""

import io
import socket
import threading

import pytest
from rich.console import Console

from moepipe.conversion.write import convert
from moepipe.terminal import BarView, LineView
from moepipe.utils import progress
from moepipe.utils.progress import IDLE, Task, current, task
from moepipe.validate import load as driver
from moepipe.validate.load import LoadPlan, Prompt


class Recorder:
    """A view that keeps every task it was shown, and what it saw at the close."""

    def __init__(self):
        self.opened_tasks, self.closed_at = [], []

    def opened(self, t):
        self.opened_tasks.append(t)

    def closed(self, t):
        self.closed_at.append((t.label, t.done, t.total, t.note))


@pytest.fixture
def recorder():
    view = Recorder()
    old = progress.install(view)
    yield view
    progress.install(old)


def test_counts_from_many_threads_add_up_exactly():
    t = Task("convert", 4 * 20000, "bytes")

    def work():
        for _ in range(20000):
            t.advance()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.done == t.total == 80000
    t.plan(10)
    t.plan(-4)
    assert t.total == 80006


def test_tasks_nest_and_deep_code_counts_into_the_innermost(recorder):
    assert current() is IDLE
    with task("validate perf", unit="requests") as outer:
        with task("inner") as inner:
            assert current() is inner
        current().advance(3)  # the load driver does this without being handed the task
        assert current() is outer
    assert current() is IDLE and outer.done == 3
    assert [t.label for t in recorder.opened_tasks] == ["validate perf", "inner"]
    assert [c[0] for c in recorder.closed_at] == ["inner", "validate perf"]


def test_a_terminal_shows_bytes_done_of_the_total_the_rate_and_the_time_left():
    out, clock = io.StringIO(), [0.0]
    view = BarView(Console(file=out, force_terminal=True, width=150), get_time=lambda: clock[0])
    view.progress.live.auto_refresh = False  # frames drawn here, on a clock of the test's
    old = progress.install(view)
    try:
        with task("convert", 9e9, "bytes", "0 of 4 rank files written") as meter:
            for _ in range(4):
                clock[0] += 1
                meter.advance(0.5e9)
                view.progress.refresh()
            frame = out.getvalue().rsplit("\r", 1)[-1]
            assert view.progress.live.is_started
        with task("validate perf (job 2 of 3)", unit="requests") as requests:
            requests.plan(48)
            for _ in range(4):
                clock[0] += 1
                requests.advance(3)
                view.progress.refresh()
            counts = out.getvalue().rsplit("\r", 1)[-1]
    finally:
        progress.install(old)
    assert "convert: 0 of 4 rank files written" in frame
    assert "2.0/9.0 GB  500.0 MB/s" in frame and "0:00:14 left" in frame  # 7 GB at 0.5 GB/s
    assert "12/48 requests  3.0 requests/s" in counts and "0:00:12 left" in counts
    assert not view.progress.live.is_started  # stopped between tasks: plain prints are safe
    # the bar erased (the command prints its own summary) and the cursor given back
    assert out.getvalue().endswith("\r\x1b[2K\x1b[?25h\r")


def test_bars_open_and_close_while_rich_redraws_them_without_a_deadlock():
    view = BarView(Console(file=io.StringIO(), force_terminal=True, width=150))
    view.progress.live.refresh_per_second = 500  # rich's thread redraws all the time
    old = progress.install(view)

    def work():
        for i in range(150):
            with task("stage"), task("convert", 100, "bytes", f"rank {i}") as t:
                t.advance(50)

    try:
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        worker.join(timeout=60)
        assert not worker.is_alive(), "opening and closing bars deadlocked with a redraw"
    finally:
        progress.install(old)
    assert not view.progress.live.is_started


def test_a_log_gets_a_plain_line_at_most_once_an_interval():
    view = LineView(io.StringIO(), interval=30)
    convert_task = Task("convert", 9e9, "bytes", "1 of 4 rank files written")
    convert_task.started = 100.0
    view.opened(Task("build"))
    view.opened(convert_task)
    assert view.tick(120.0) is None  # short work prints nothing
    convert_task.advance(1.2e9)
    assert view.tick(110.0 + 30) == ("convert: 1.2 GB of 9.0 GB (13%), 30.0 MB/s, 0:04:20 left "
                                     "(1 of 4 rank files written)")
    view.closed(convert_task)
    steps = Task("train", None, "steps")
    steps.started = 0.0
    steps.advance(50)
    view.opened(steps)
    assert view.tick(100.0) == "train: 50 steps, 0.5 steps/s, 0:01:40 so far"
    view.close()


def test_conversion_counts_every_byte_of_every_rank_as_it_goes(tmp_path, recorder, examples,
                                                               monkeypatch):
    calls = []
    advance = Task.advance
    monkeypatch.setattr(Task, "advance", lambda self, n=1: (calls.append(n),
                                                            advance(self, n)))
    res = convert(examples["tiny-mixtral"], tmp_path / "out", tp=2, moe_ep=2, dtype="float32")
    (label, done, total, note), = recorder.closed_at
    world = res.plan.mapping.world_size
    data = sum(res.plan.rank_bytes(r) for r in range(world))
    assert (label, done, total, note) == ("convert", data, data,
                                          f"{world} of {world} rank files written")
    # counted block by block inside each rank, not once per finished rank
    assert len(calls) > world * 10 and max(calls) < data / world


def test_the_load_driver_counts_its_requests_in_the_callers_task():
    with socket.socket() as s:  # a port nothing listens on: every request fails at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = [Prompt("short", "x", 4)]
    with task("validate perf", unit="requests") as job:
        driver.run_load(LoadPlan(f"127.0.0.1:{port}", prompts, concurrency=2, max_requests=7,
                                 protocol="http", timeout_s=2))
        assert job.done == job.total == 7
        # a deadline that ends the sending early: what was not sent leaves the plan
        res = driver.run_load(LoadPlan(f"127.0.0.1:{port}", prompts, schedule=[(0.3, 10.0)],
                                       arrival="constant", max_requests=50, protocol="http",
                                       duration_s=0.3, timeout_s=2))
    assert 0 < len(res.samples) < 50 and job.done == job.total == 7 + len(res.samples)


def test_training_counts_its_steps(recorder):
    import transformers

    from moepipe.examples import EXAMPLES
    from moepipe.examples.train import Recipe, train

    ex = EXAMPLES["tiny-mixtral"]
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, ex.config_class)(**ex.config))
    train(model, list(range(3, 200)), Recipe(steps=3, batch_size=2, seq_len=16, warmup=1,
                                             window_stride=8), seed=0)
    (label, done, total, note), = recorder.closed_at
    assert (label, done, total) == ("train", 3, 3) and note.startswith("loss ")

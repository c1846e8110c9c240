"""turns.py: the compile thread runs compiled graphs only while no CUDA graph is being captured, and
a capture starts only while it runs none; compiling itself goes on beside captures. On the CPU the
capture side is the turn alone (no CUDA graph); the compiled side is a real inductor compile."""

import threading
import time

import torch

from cosyapp.engine.token2wav import turns
from cosyapp.engine.token2wav.compiling import COMPILER, Deferred, kind
from cosyapp.engine.token2wav.turns import TURNS


def scaled_gelu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w) * 0.5 + x


def wait_for(condition, timeout_s: float = 300.0) -> bool:
    until = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > until:
            return False
        time.sleep(0.01)
    return True


def test_the_compile_threads_first_run_waits_for_a_capture_in_progress(fresh_compiles):
    fn = Deferred("scaled gelu", scaled_gelu, turns.compile(scaled_gelu))
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    key = kind((x, w), {})
    with TURNS.capture():
        # Eager meanwhile; the compile thread compiles, then waits at its graph's first run.
        torch.testing.assert_close(fn(x, w), scaled_gelu(x, w), rtol=0, atol=0)
        assert wait_for(lambda: TURNS.waiting_runs == 1), "the compile never reached its first run"
        time.sleep(0.2)
        assert key not in fn.ready and not COMPILER.settled  # still waiting for the capture
    assert COMPILER.wait(timeout_s=120)
    assert key in fn.ready and TURNS.waiting_runs == 0
    torch.testing.assert_close(fn(x, w), scaled_gelu(x, w), rtol=1e-5, atol=1e-6)  # compiled now


def test_a_capture_waits_for_the_compile_threads_run_and_serving_threads_take_no_turn():
    entered = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def compile_thread_run():
        with TURNS.run():
            entered.set()
            release.wait(10)
            order.append("run ended")

    runner = threading.Thread(target=compile_thread_run, name=turns.COMPILE_THREAD)
    runner.start()
    assert entered.wait(10)

    def capture():
        with TURNS.capture():
            order.append("capture began")

    capturer = threading.Thread(target=capture)
    capturer.start()
    time.sleep(0.2)
    assert order == []  # the capture waits for the run
    # A compiled graph called on a serving thread (here, this one) runs at once, in a run's turn or not.
    calls = []
    turns._taking_turns(lambda *a: calls.append(a))(1, 2)
    assert calls == [(1, 2)]
    release.set()
    runner.join(10)
    capturer.join(10)
    assert order == ["run ended", "capture began"]


def test_a_waiting_run_goes_before_captures_that_come_after_it():
    """A start captures many buckets back to back: the compile thread's run waiting for a gap goes
    in the first one, before the next capture."""
    order: list[str] = []
    first = TURNS.capture()
    first.__enter__()

    def run():
        with TURNS.run():
            order.append("run")

    def capture():
        with TURNS.capture():
            order.append("next capture")

    runner = threading.Thread(target=run, name=turns.COMPILE_THREAD)
    runner.start()
    assert wait_for(lambda: TURNS.waiting_runs == 1, 10)
    capturer = threading.Thread(target=capture)
    capturer.start()
    time.sleep(0.2)
    assert order == []
    first.__exit__(None, None, None)
    runner.join(10)
    capturer.join(10)
    assert order == ["run", "next capture"]


def test_captures_on_two_threads_take_turns():
    """torch.cuda.graph captures on one side stream shared by every capture: a second thread's
    capture begun during the first would fail (seen on an H100), so it waits for the first to end."""
    order: list[str] = []
    first = TURNS.capture()
    first.__enter__()
    order.append("first began")

    def capture():
        with TURNS.capture():
            order.append("second began")

    capturer = threading.Thread(target=capture, name="incremental-capture")
    capturer.start()
    time.sleep(0.2)
    assert order == ["first began"]  # the second waits
    order.append("first ended")
    first.__exit__(None, None, None)
    capturer.join(10)
    assert order == ["first began", "first ended", "second began"]


class _HeldTrace(torch.nn.Module):
    """A module whose symbolic trace (torch.fx, as inductor's passes run it) stays in progress until
    ``release`` is set: the process-wide tracing flag stays up meanwhile."""

    def __init__(self):
        super().__init__()
        self.tracing, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.tracing.set()
        self.release.wait(30)
        return x + 1


def test_a_compiled_call_on_a_serving_thread_runs_eagerly_while_another_thread_traces():
    compiled = turns.compile(scaled_gelu)
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    torch.testing.assert_close(compiled(x, w), scaled_gelu(x, w), rtol=1e-5, atol=1e-6)
    held = _HeldTrace()
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(held,), name=turns.COMPILE_THREAD)
    tracer.start()
    try:
        assert held.tracing.wait(10)
        assert torch.fx._symbolic_trace.is_fx_symbolic_tracing()  # the flag this thread sees
        torch.testing.assert_close(compiled(x, w), scaled_gelu(x, w), rtol=1e-5, atol=1e-6)
    finally:
        held.release.set()
        tracer.join(10)
    assert not torch.fx._symbolic_trace.is_fx_symbolic_tracing()


def test_the_compile_thread_runs_compiled_graphs_inside_its_own_capture(fresh_compiles):
    """Recapturing a stale bucket, the compile thread calls compiled graphs inside its own capture:
    they are recorded there, so they take no turn (waiting for the capture would wait for itself)."""
    compiled = turns.compile(scaled_gelu)
    x, w = torch.randn(5, 8), torch.randn(8, 8)
    results, left = [], []

    def recapture():
        with TURNS.capture():
            results.append(compiled(x, w))
        left.append(TURNS.captures_here())  # this thread's count, back to none

    thread = threading.Thread(target=recapture, name=turns.COMPILE_THREAD)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the compile thread waited for its own capture"
    torch.testing.assert_close(results[0], scaled_gelu(x, w), rtol=1e-5, atol=1e-6)
    assert left == [0] and TURNS.waiting_runs == 0

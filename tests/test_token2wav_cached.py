"""The token2wav worker with the incremental streaming flow (tiny model, CPU, float32): the same audio
as the recompute path, pages given back however a stream ends, and the fall back to recomputing."""

import asyncio

import numpy as np
import pytest
from test_token2wav import _as_lm, _prompt, _run, _tokens

from cosyapp.engine.token2wav.flow_cache import raw_estimator
from cosyapp.engine.token2wav.pages import KVPool
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.options import DEFAULTS

POOL = 64 << 20  # bytes: plenty of pages for the tiny model


def page_bytes(model, inputs: bool = DEFAULTS.flow_cache_inputs) -> int:
    """One page of the pool a worker builds by default (attention inputs, or keys and values)."""
    flow = model.flow
    dtype = flow.input_embedding.weight.dtype
    return KVPool.page_bytes(raw_estimator(flow), flow.decoder.n_timesteps, dtype, inputs)


async def streams(engine: Token2Wav, specs: list[tuple[int, int, int, float]]) -> list[list[np.ndarray]]:
    """Streams (prompt length, tokens, seed, speed) run concurrently; each one's chunks."""

    async def one(prompt_len, count, seed, speed):
        stream = engine.open_stream(_prompt(prompt_len, seed), speed=speed, seed=seed)
        return [chunk async for chunk in stream.run(_as_lm(_tokens(count, seed)))]

    return await asyncio.gather(*(one(*spec) for spec in specs))


SPECS = [(75, 160, 1, 1.0), (37, 120, 2, 1.0), (75, 90, 3, 1.5), (12, 140, 4, 0.8)]


def assert_same_chunks(got: list[np.ndarray], want: list[np.ndarray]):
    assert [len(c) for c in got] == [len(c) for c in want]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * max(1e-3, float(np.abs(b).max())))


@pytest.mark.parametrize(
    ("inputs", "overlap"),
    [(False, False), (True, False), (True, True)],
    ids=["keys-values", "attention-inputs", "attention-inputs-overlapped"],
)
def test_cached_streams_give_the_recompute_audio(tiny_model, inputs, overlap):
    """overlap: each step's incremental calls launched unwaited (on a GPU, on a stream of their own)
    before its recompute calls, and waited for after them (worker.py ``_flow``)."""
    want = _run(tiny_model, lambda e: streams(e, SPECS))

    async def main(engine):
        got = await streams(engine, SPECS)
        return got, engine.cached, engine.stats()

    options = {"flow_cache_inputs": inputs, "flow_overlap": overlap}
    got, cached, stats = _run(tiny_model, main, flow_cache_bytes=POOL, **options)
    for g, w in zip(got, want, strict=True):
        assert_same_chunks(g, w)
    assert cached.pool.inputs == inputs
    assert not cached.holders and cached.fallbacks == 0
    held = cached.voices.held_pages
    assert held > 0 and cached.pool.free_pages == cached.pool.pages - held
    # Every chunk but each stream's last (upstream's full-attention recompute) went the incremental way.
    chunks = sum(len(g) for g in got)
    assert stats.recompute_jobs == len(SPECS) and stats.incremental_jobs == chunks - len(SPECS)
    assert stats.flow_cache_fallbacks == 0 and stats.flow_cache_pages == cached.pool.pages
    assert 0 <= stats.flow_cache_least_free < cached.pool.pages - held
    # Two mel frames per token, each handed over once; the last chunks recomputed prompt and tokens.
    assert stats.incremental_frames + stats.recompute_frames == sum(2 * n for _, n, _, _ in SPECS)
    assert stats.recompute_run_frames >= sum(2 * (p + n) for p, n, _, _ in SPECS)
    assert stats.incremental_run_frames > stats.incremental_frames > 0
    # Streams of different lengths: some steps held one stream's last chunk and others' chunks.
    assert (stats.overlapped_steps > 0) == overlap


def test_a_full_pool_falls_back_to_recomputing_with_the_same_audio(tiny_model):
    want = _run(tiny_model, lambda e: streams(e, SPECS))

    async def main(engine):
        return await streams(engine, SPECS), engine.cached, engine.stats()

    # 3 pages: no stream of 90 tokens or more fits, whatever the timing, so every one falls back.
    got, cached, stats = _run(tiny_model, main, flow_cache_bytes=3 * page_bytes(tiny_model))
    for g, w in zip(got, want, strict=True):
        assert_same_chunks(g, w)
    assert cached.fallbacks > 0 and not cached.holders
    assert stats.flow_cache_fallbacks == cached.fallbacks and stats.flow_cache_least_free == 0
    assert stats.recompute_jobs > len(SPECS)  # more than the last chunks: the refused streams' chunks


def test_a_cancelled_stream_gives_its_pages_back(tiny_model):
    async def main(engine):
        free = engine.cached.pool.free_pages

        async def lm_that_stalls():  # 100 tokens, then nothing until the stream is closed
            yield _tokens(100, 9)
            await asyncio.Event().wait()

        stream = engine.open_stream(_prompt(75, 9), seed=9)
        chunks = stream.run(lm_that_stalls())
        await anext(chunks)  # the first chunk is out; the stream holds pages now
        assert engine.cached.holders
        await chunks.aclose()
        await streams(engine, [(37, 60, 5, 1.0)])  # the worker's next step sweeps
        voices = engine.cached.voices.held_pages
        return free, engine.cached, voices

    free, cached, voices = _run(tiny_model, main, flow_cache_bytes=POOL)
    assert not cached.holders
    assert cached.pool.free_pages == free - voices


@pytest.mark.parametrize("speed", [1.0, 1.3])
def test_a_chunked_final_changes_only_the_last_chunk(tiny_model, speed):
    spec = [(75, 160, 6, speed)]
    [want] = _run(tiny_model, lambda e: streams(e, spec))
    [got] = _run(tiny_model, lambda e: streams(e, spec), flow_cache_bytes=POOL, chunked_final=True)
    assert [len(c) for c in got] == [len(c) for c in want]
    assert_same_chunks(got[:-1], want[:-1])
    assert not np.allclose(got[-1], want[-1], atol=1e-4)


def test_the_default_sizes_the_pool_at_start_and_is_off_on_a_cpu(tiny_model):
    engine = Token2Wav(tiny_model, flow_cache_bytes=None)
    engine.start()
    try:
        assert engine.cached is None  # no GPU: every chunk recomputes its prefix
    finally:
        engine.stop()
    engine = Token2Wav(tiny_model, flow_cache_bytes=3 * page_bytes(tiny_model))
    assert engine.cached is None  # the pool is allocated at start, after the LM engine's
    engine.start()
    try:
        assert engine.cached.pool.free_pages == 3
    finally:
        engine.stop()


def storage_of(tensor) -> int | None:
    """Where a tensor's data lives; None for tensors without data (the fake tensors torch.compile
    leaves behind in a process that ran other tests)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_freeing_a_stopped_pool_leaves_no_tensor_on_its_memory(tiny_model, graphs):
    """The bench swaps workers in one process: free() must give the pool's memory back even while
    something still refers to the old worker (here the test itself)."""
    import gc

    import torch

    async def main(engine):
        await streams(engine, SPECS[:2])
        return engine.cached

    cached = _run(tiny_model, main, flow_cache_bytes=POOL, flow_cache_graphs=graphs)
    assert (cached.flow.graphs is not None) == graphs
    storage = cached.pool.kv.untyped_storage().data_ptr()
    cached.free()
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    on_pool = [t for t in tensors if storage_of(t) == storage]
    assert not on_pool
    assert cached.pool.kv.numel() == 0 and cached.pool.free_pages == 0

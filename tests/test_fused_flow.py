"""--compile-flow: the flow estimator compiled by inductor (its forward whole, its pieces where the
incremental flow calls them; the engine's on the compile thread) gives the eager mel in both flow
paths (tiny model, CPU, float32), and the option reaches the engine from the command line."""

import contextlib
import copy
import os

import pytest
import torch
from test_flow_cache import assert_close, prompt, recompute, schedule, stream_frames

from cosyapp.engine.build import build_pipeline, compiles_flow
from cosyapp.engine.token2wav import compiled_blocks
from cosyapp.engine.token2wav.compiled_blocks import attend_block, compile_blocks, deferred_attend_block
from cosyapp.engine.token2wav.compiling import COMPILER
from cosyapp.engine.token2wav.flow_cache import FlowItem, IncrementalFlow, raw_estimator
from cosyapp.engine.token2wav.graphs import GraphedEstimator, capture_estimator_graphs
from cosyapp.engine.token2wav.incremental import ROWS, IncrementalEstimator
from cosyapp.engine.token2wav.pages import TRASH, FlowCache, KVPool
from cosyapp.models.checkpoint import load_model
from cosyapp.models.flow_estimator import CausalBlock1D, CausalConditionalDecoder, TransformerBlock
from cosyapp.options import ServeOptions


@contextlib.contextmanager
def built_copy(model_dir, cache_dir, **options):
    """A second copy of the tiny model, prepared by build_pipeline with ``options`` (what they compile
    keeps its kernels under ``cache_dir``, not in a cache the user chose)."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        model = load_model(model_dir, device="cpu")
        build_pipeline(model, ServeOptions(engine="torch", cache_dir=cache_dir, **options))
        yield model


@pytest.fixture(scope="module")
def fused(tiny_model_dir, tmp_path_factory):
    """(model, cache_dir): a second copy of the tiny model, its flow fused by build_pipeline."""
    cache_dir = tmp_path_factory.mktemp("serving-cache")
    with built_copy(tiny_model_dir, cache_dir, compile_flow=True) as model:
        yield model, cache_dir


def pool(model, inputs: bool = False) -> KVPool:
    est = raw_estimator(model.flow)
    steps = model.flow.decoder.n_timesteps
    return KVPool(est, pages=32, steps=steps, device=torch.device("cpu"), dtype=torch.float32, inputs=inputs)


def compiled_graphs(cls: type, name: str) -> int:
    return compiled_graphs_of(getattr(cls, name))


def compiled_graphs_of(fn) -> int:
    return len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__))


@pytest.mark.parametrize("streaming", [False, True])
def test_the_recompute_path_gives_the_eager_mel(tiny_model, fused, streaming, compile_threads):
    model, _ = fused
    p = prompt(75, seed=3)
    tokens = torch.randint(0, 6561, (120,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        got = once_compiled(
            lambda: (
                recompute(model.flow, p, tokens, final=True) if streaming else whole(model.flow, p, tokens)
            )
        )
        assert raw_estimator(model.flow).forward.ready
        assert set(compile_threads) <= {"flow-compile"}  # never the caller's thread
        want = (
            recompute(tiny_model.flow, p, tokens, final=True)
            if streaming
            else whole(tiny_model.flow, p, tokens)
        )
    assert_close(got, want)


def whole(flow, p, tokens):
    return recompute(flow, p, tokens, final=True, streaming=False)


def once_compiled(call):
    """``call()`` again once the compile thread has compiled what its first run met (the engine's
    --compile-flow compiles there while the calls run eagerly: compiling.py)."""
    first = call()
    assert COMPILER.wait(timeout_s=900)
    again = call()
    assert_close(again, first)  # eager and compiled alike
    return again


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("inputs", [False, True], ids=["keys-values", "attention-inputs"])
def test_the_incremental_path_gives_the_eager_mel_chunk_by_chunk(
    tiny_model, fused, padded, inputs, compile_threads
):
    """padded: the calls padded to the CUDA graphs' buckets, as served on a GPU. inputs: a pool of
    attention inputs. Either way the step runs the compiled pieces (its blocks compiled whole,
    compiled_blocks.py, are not served)."""
    model, _ = fused
    assert IncrementalFlow(model.flow, pool(model, inputs)).step_fn.attend_block is None
    p = prompt(37, seed=5)
    tokens = torch.randint(0, 6561, (260,), generator=torch.Generator().manual_seed(6))
    calls = schedule(37, len(tokens), 25)
    got = stream_frames(model.flow, pool(model, inputs), p, tokens, calls, padded=padded)  # eager
    assert COMPILER.wait(timeout_s=900)
    got = stream_frames(model.flow, pool(model, inputs), p, tokens, calls, padded=padded)  # compiled
    # The first call has no past pages, the others have: kinds of their own, both compiled there.
    assert set(compile_threads) <= {"flow-compile"}
    want = stream_frames(tiny_model.flow, pool(tiny_model, inputs), p, tokens, calls, padded=padded)
    assert len(got) == len(calls) > 3
    for (got_start, got_mel), (want_start, want_mel) in zip(got, want, strict=True):
        assert got_start == want_start
        assert_close(got_mel, want_mel)


def test_one_compiled_graph_per_attention_mode_and_piece(tiny_model_dir, tmp_path, fresh_compiles):
    """The forward: one graph per attention mode, whatever the length; the incremental flow's pieces:
    one graph (two with the batch-of-one one) for all the blocks, never one per block or length.
    fresh_compiles: the graphs are shared by every copy of the estimator, so they count from none."""
    graphs = {
        "forward": lambda: compiled_graphs(CausalConditionalDecoder, "forward"),
        "after_attention": lambda: compiled_graphs(TransformerBlock, "after_attention"),
        "finish": lambda: compiled_graphs(CausalBlock1D, "finish"),
    }
    with built_copy(tiny_model_dir, tmp_path, compile_flow=True) as model, torch.inference_mode():
        for n, seed in ((40, 7), (65, 8)):  # two lengths in each mode
            p = prompt(25, seed=seed)
            tokens = torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed))
            whole(model.flow, p, tokens)
            recompute(model.flow, p, tokens, final=True)
        p = prompt(37, seed=5)
        tokens = torch.randint(0, 6561, (160,), generator=torch.Generator().manual_seed(6))
        calls = schedule(37, len(tokens), 25)
        stream_frames(model.flow, pool(model), p, tokens, calls)
        est = raw_estimator(model.flow)
        assert sum(isinstance(m, TransformerBlock) for m in est.modules()) > 1
        assert sum(isinstance(m, CausalBlock1D) for m in est.modules()) > 1
        assert COMPILER.wait(timeout_s=900)
    added = {name: count() for name, count in graphs.items()}
    assert added["forward"] == 2, added  # full attention over a whole clip, streaming masks
    assert 1 <= added["after_attention"] <= 2 and 1 <= added["finish"] <= 2, added


def test_the_start_compiles_the_mode_no_graph_bucket_captures(tiny_model_dir, tmp_path, fresh_compiles):
    """The worker's start (capture_estimator_graphs) runs a compiled forward without a mask too, so
    calls past the buckets do not compile during a request."""
    with built_copy(tiny_model_dir, tmp_path, compile_flow=True) as model:
        decoder = model.flow.decoder
        decoder.estimator = GraphedEstimator(decoder.estimator, use_graphs=False)  # as on a GPU
        assert compiled_graphs(CausalConditionalDecoder, "forward") == 0
        # Compiles on the compile thread what the buckets' captures met (dynamo tells some sizes
        # apart), and the mode without a mask.
        capture_estimator_graphs(model, None)
        assert COMPILER.wait(timeout_s=900)
        started = compiled_graphs(CausalConditionalDecoder, "forward")
        assert started >= 1
        p = prompt(25, seed=9)
        tokens = torch.randint(0, 6561, (40,), generator=torch.Generator().manual_seed(9))
        with torch.inference_mode():
            decoder.estimator.max_cells = 0  # past the buckets: eager, no mask
            whole(model.flow, p, tokens)
        assert COMPILER.wait(timeout_s=900)
        assert compiled_graphs(CausalConditionalDecoder, "forward") == started  # nothing more to compile


def test_compiled_kernels_are_kept_under_the_serving_cache_dir(fused):
    model, cache_dir = fused
    with torch.inference_mode():
        once_compiled(lambda: whole(model.flow, prompt(25, seed=2), torch.arange(30)))
    kept = cache_dir / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(kept)
    assert any(f.is_file() for f in kept.rglob("*"))


def test_a_cache_dir_the_user_chose_is_kept(tiny_model, tmp_path, monkeypatch):
    from cosyapp.engine.token2wav.fused import fuse_estimator

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    fuse_estimator(copy.deepcopy(raw_estimator(tiny_model.flow)), tmp_path / "serving")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def assert_compiled_calls_match_eager(model, total: int, compile_step, padded: bool = False) -> None:
    """One stream's incremental calls on a pool of attention inputs (37 prompt tokens, ``total``
    generated, a first hop of 25) give the same frames, call by call, eagerly and with
    ``compile_step(runner)`` applied. padded: the calls padded to the CUDA graphs' buckets."""
    p = prompt(37, seed=5)
    tokens = torch.randint(0, 6561, (total,), generator=torch.Generator().manual_seed(6))
    calls = schedule(37, len(tokens), 25)  # widths of whole pages and not, with and without a past
    frames = {}
    for compiled in (False, True):
        runner = IncrementalFlow(model.flow, pool(model, inputs=True), graphs=padded)
        if compiled:
            compile_step(runner)
        cache, frames[compiled] = FlowCache(), []
        with torch.inference_mode():
            for n, final in calls:
                [(mel, start)] = runner([FlowItem(cache, *p, tokens[:n], final)])
                frames[compiled].append((start, mel))
    assert len(frames[True]) == len(calls) >= 3
    for (got_start, got), (want_start, want) in zip(frames[True], frames[False], strict=True):
        assert got_start == want_start
        assert_close(got, want)


def test_the_incremental_step_compiled_whole_gives_the_eager_frames(tiny_model):
    """The step as one compiled graph, pool reads and writes included (what scripts/flow_compile_speed.py
    measures with FLOW_CACHE_COMPILE_SCOPE=step): the caches' step is indexed through a tensor, so
    one graph serves all ten steps, and the frames are eager's, call by call."""

    def compile_step(runner):
        runner.step_fn = torch.compile(runner.step_fn.__call__, dynamic=True)

    assert_compiled_calls_match_eager(tiny_model, 100, compile_step)
    graphs = torch._dynamo.eval_frame._debug_get_cache_entry_list(IncrementalEstimator.__call__.__code__)
    assert len(graphs) <= 3  # one per call at most (3 of them), not one per Euler step


@pytest.mark.parametrize("padded", [False, True])
def test_the_compiled_blocks_give_the_eager_frames_with_one_graph_for_every_block(
    tiny_model, padded, fresh_compiles
):
    """compiled_blocks.py (--compile-flow with a pool of attention inputs): each transformer block of
    the incremental step through one compiled graph, call by call as eager; a second graph at most,
    for calls whose reads and writes have one size (no past pages yet). padded: the calls padded to
    the CUDA graphs' buckets, as served on a GPU."""
    assert_compiled_calls_match_eager(tiny_model, 160, lambda runner: compile_blocks(runner.step_fn), padded)
    assert sum(isinstance(m, TransformerBlock) for m in raw_estimator(tiny_model.flow).modules()) > 2
    assert 1 <= compiled_graphs_of(attend_block) <= 2


def test_the_worker_with_the_compiled_flow_streams_the_eager_audio(tiny_model, fused, compile_threads):
    """The token2wav worker over the --compile-flow model (its thread compiling and running the
    step's pieces, the final chunks through the compiled forward) streams the eager model's audio."""
    from test_token2wav import _run
    from test_token2wav_cached import POOL, SPECS, assert_same_chunks, streams

    model, _ = fused
    want = _run(tiny_model, lambda e: streams(e, SPECS), flow_cache_bytes=POOL)

    async def main(engine):
        first = await streams(engine, SPECS)  # eager while the compile thread compiles what they meet
        await engine.compiles_settled()
        return first, await streams(engine, SPECS), engine.cached, engine.stats()

    first, got, cached, stats = _run(model, main, flow_cache_bytes=POOL)
    for f, g, w in zip(first, got, want, strict=True):
        assert_same_chunks(f, w)
        assert_same_chunks(g, w)
    assert cached.pool.inputs and cached.flow.step_fn.attend_block is None
    assert raw_estimator(model.flow).forward.ready
    assert stats.incremental_jobs > 0 and stats.recompute_jobs == 2 * len(SPECS)
    assert stats.flow_compiles > 0 and not stats.flow_compiling
    assert set(compile_threads) <= {"flow-compile"}  # not the worker's threads, nor this one


def test_the_compile_thread_writes_no_page_a_stream_holds(fused):
    """The compile thread runs attend_block on copies of a call's arguments, but the page pool is the
    pool itself: its writes go to the trash page only (compiled_blocks._trash_writes)."""
    model, _ = fused
    compiled_blocks._deferred_attend_block.cache_clear()  # a new one: this call's kinds compile now
    runner = IncrementalFlow(model.flow, pool(model, inputs=True))
    compile_blocks(runner.step_fn, background=True)
    p = prompt(37, seed=5)
    tokens = torch.randint(0, 6561, (60,), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        runner([FlowItem(FlowCache(), *p, tokens, False)])
    kept = runner.pool.kv[:, ROWS * (TRASH + 1) :].clone()  # every block's rows but the trash page's
    assert kept.abs().sum() > 0  # the call committed pages
    assert COMPILER.wait(timeout_s=900) and deferred_attend_block().ready
    assert torch.equal(runner.pool.kv[:, ROWS * (TRASH + 1) :], kept)


def test_the_default_compiles_the_flow_on_a_gpu_and_a_choice_wins_anywhere():
    """The rule prepare_flow follows; a CUDA device object needs no GPU to exist."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert compiles_flow(gpu, ServeOptions()) and not compiles_flow(cpu, ServeOptions())
    assert not compiles_flow(gpu, ServeOptions(compile_flow=False))
    assert compiles_flow(cpu, ServeOptions(compile_flow=True))

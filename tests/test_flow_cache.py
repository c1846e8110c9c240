"""The incremental streaming flow gives the recompute path's frames (tiny model, float32)."""

import pytest
import torch

from cosyapp.deploy.sizing import PAGE_BYTES
from cosyapp.engine.token2wav.chunking import ChunkSchedule
from cosyapp.engine.token2wav.flow_cache import WIDTH_BUCKETS, FlowItem, IncrementalFlow, raw_estimator
from cosyapp.engine.token2wav.graphs import bucket
from cosyapp.engine.token2wav.pages import (
    FlowCache,
    KVPool,
    VoiceEntry,
    VoicePages,
    transformer_count,
    voice_frames,
)
from cosyapp.engine.token2wav.writes import as_words
from cosyapp.models.flow_estimator import CausalConditionalDecoder

PAGE = 50  # frames per chunk (25 tokens x 2)
LOOKAHEAD = 3


def prompt(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 6561, (tokens,), generator=g),
        torch.randn(2 * tokens, 80, generator=g) - 5.0,
        torch.randn(192, generator=g),
    )


def recompute(flow, p, tokens: torch.Tensor, final: bool, streaming: bool = True) -> torch.Tensor:
    """All frames after the prompt from one streaming-mask pass over the prefix (the recompute path);
    ``streaming=False``: one full-attention pass (a whole clip)."""
    speech, feat, emb = p
    mel, mel_len = flow.inference(
        token=tokens[None],
        token_len=torch.tensor([len(tokens)]),
        prompt_token=speech[None],
        prompt_token_len=torch.tensor([len(speech)]),
        prompt_feat=feat[None],
        prompt_feat_len=torch.tensor([len(feat)]),
        embedding=emb[None],
        streaming=streaming,
        finalize=final,
    )
    return mel[0, :, : int(mel_len[0])]


def schedule(prompt_len: int, total: int, first_hop: int) -> list[tuple[int, bool]]:
    """(tokens handed over, final) per call of a stream of `total` tokens, as the worker makes them."""
    chunks = ChunkSchedule(prompt_len, first_hop)
    calls = []
    while chunks.ready(total):
        calls.append((chunks.advance()[1] + LOOKAHEAD, False))
    return [*calls, (total, True)]


@pytest.fixture(scope="module", params=[False, True], ids=["keys-values", "attention-inputs"])
def pool(tiny_model, request):
    """A pool of keys and values, or of the attention inputs they are projected from."""
    est = raw_estimator(tiny_model.flow)
    return KVPool(
        est,
        pages=64,
        steps=tiny_model.flow.decoder.n_timesteps,
        device=torch.device("cpu"),
        dtype=torch.float32,
        inputs=request.param,
    )


def stream_frames(flow, pool, p, tokens, calls, voices=None, key=None, padded=False):
    """Run one stream's calls incrementally; returns the frames after the prompt, call by call."""
    speech, feat, emb = p
    cache = FlowCache()
    if voices is not None:
        start_from_voice(flow, pool, voices, key, p, cache)
    out = []
    for n, final in calls:
        item = FlowItem(cache, speech, feat, emb, tokens[:n], final)
        [(mel, start)] = IncrementalFlow(flow, pool, graphs=padded)([item])
        out.append((start, mel))
    pool.release(cache.pages)
    return out


def start_from_voice(flow, pool, voices, key, p, cache):
    speech, feat, emb = p
    entry = voices.get(key)
    if entry is None:
        frames = voice_frames(len(speech), 25, LOOKAHEAD, 2)
        seed = FlowCache()
        item = FlowItem(seed, speech, feat, emb, speech[:0], False, commit_to=frames)
        IncrementalFlow(flow, pool)([item])
        entry = VoiceEntry(seed.pages, seed.tails, seed.frames)
        voices.put(key, entry)
    pool.retain(entry.pages)
    cache.pages, cache.tails, cache.frames = list(entry.pages), entry.tails.clone(), entry.frames


def assert_after_prompt(mel: torch.Tensor, start: int, whole: torch.Tensor, prompt_frames: int):
    """The call's frames from `start` on, after the prompt, against the recompute path's."""
    assert_close(mel[:, max(0, prompt_frames - start) :], whole[:, max(0, start - prompt_frames) :])


def assert_close(got: torch.Tensor, want: torch.Tensor):
    scale = want.abs().max()
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-5 * scale, float((got - want).abs().max() / scale)


@pytest.mark.parametrize(
    "prompt_len,first_hop,padded",
    [(75, 25, False), (37, 25, False), (50, 10, False), (12, 15, False), (37, 25, True)],
)
def test_every_call_gives_the_recompute_frames(tiny_model, pool, prompt_len, first_hop, padded):
    """padded: calls padded to the CUDA graphs' shape buckets (dummy rows, trash pages, masked frames)."""
    flow = tiny_model.flow
    p = prompt(prompt_len, seed=prompt_len)
    tokens = torch.randint(0, 6561, (190,), generator=torch.Generator().manual_seed(1))
    calls = schedule(prompt_len, len(tokens), first_hop)
    free = pool.free_pages
    frames = stream_frames(flow, pool, p, tokens, calls, padded=padded)
    for (n, final), (start, mel) in zip(calls, frames, strict=True):
        whole = recompute(flow, p, tokens[:n], final)
        assert_after_prompt(mel, start, whole, 2 * prompt_len)
    assert pool.free_pages == free


def test_a_batch_of_new_and_continuing_streams_matches_each_alone(tiny_model, pool):
    flow = tiny_model.flow
    prompts = [prompt(75, 1), prompt(40, 2), prompt(75, 3)]
    tokens = [
        torch.randint(0, 6561, (150,), generator=torch.Generator().manual_seed(10 + i)) for i in range(3)
    ]
    caches = [FlowCache() for _ in prompts]
    # Stream 0 has one chunk already; streams 1 and 2 start now, in the same call.
    first = FlowItem(caches[0], *prompts[0], tokens[0][:28], False)
    IncrementalFlow(flow, pool)([first])
    ends = [78, 35 + LOOKAHEAD, 25 + LOOKAHEAD]
    items = [FlowItem(c, *p, t[:n], False) for c, p, t, n in zip(caches, prompts, tokens, ends, strict=True)]
    results = IncrementalFlow(flow, pool, graphs=True)(items)  # 3 streams padded to a bucket of 4
    for (mel, start), p, t, n in zip(results, prompts, tokens, ends, strict=True):
        whole = recompute(flow, p, t[:n], False)
        assert_after_prompt(mel, start, whole, 2 * len(p[0]))
    for c in caches:
        pool.release(c.pages)


@pytest.mark.parametrize("inputs", [False, True], ids=["keys-values", "attention-inputs"])
def test_voice_pages_give_the_frames_of_computing_the_prompt(tiny_model, inputs):
    flow = tiny_model.flow
    est = raw_estimator(flow)
    pool = KVPool(
        est,
        pages=32,
        steps=flow.decoder.n_timesteps,
        device=torch.device("cpu"),
        dtype=torch.float32,
        inputs=inputs,
    )
    p = prompt(75, 5)
    voices = VoicePages(pool, max_pages=8)
    tokens = torch.randint(0, 6561, (120,), generator=torch.Generator().manual_seed(4))
    calls = schedule(75, len(tokens), 25)
    for _ in range(2):  # the first stream computes the voice's pages, the second finds them
        frames = stream_frames(flow, pool, p, tokens, calls, voices, "v")
        assert frames[0][0] == 100  # both start after the voice's 2 shared chunks
        for (n, final), (start, mel) in zip(calls, frames, strict=True):
            whole = recompute(flow, p, tokens[:n], final)
            assert_after_prompt(mel, start, whole, 150)
    assert voices.get("v").frames == 100
    assert pool.free_pages == pool.pages - voices.held_pages  # the streams gave theirs back


def test_a_full_pool_refuses_the_call_and_changes_nothing(tiny_model):
    flow = tiny_model.flow
    tiny_pool = KVPool(
        raw_estimator(flow),
        pages=1,
        steps=flow.decoder.n_timesteps,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    p = prompt(75, 6)
    cache = FlowCache()
    tokens = torch.randint(0, 6561, (60,), generator=torch.Generator().manual_seed(6))
    assert IncrementalFlow(flow, tiny_pool)([FlowItem(cache, *p, tokens[:28], False)]) is None
    assert cache.frames == 0 and cache.pages == [] and tiny_pool.free_pages == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_page_writes_as_words_move_the_same_bytes(dtype):
    store = torch.zeros(6, 3, 4, 2, 8, dtype=dtype)  # pool rows, steps, page, K/V, head_dim
    new = torch.randn(2, 4, 3, 8).to(dtype)[:, :, 1:]  # a slice, as the keys and values of q/k/v
    rows = torch.tensor([4, 1])
    assert as_words(store).dtype == torch.int64 and as_words(new).dtype == torch.int64
    as_words(store)[rows, 2] = as_words(new)
    assert torch.equal(store[rows, 2], new) and store[:, :2].abs().sum() == 0
    odd = torch.zeros(5, dtype=dtype)[1:]  # 4 elements from an odd offset: left as they are
    assert as_words(odd).dtype == dtype


def test_a_page_of_attention_inputs_holds_a_quarter_of_the_bytes_at_full_size():
    """A page per frame, block, Euler step and CFG row keeps keys and values (2 x 8 heads x 64) or the
    attention input (256 channels): 115 MB against 29 MB per 50-frame page in fp16 at full size."""
    with torch.device("meta"):
        est = CausalConditionalDecoder()  # the defaults are CosyVoice2-0.5B's shapes
    assert transformer_count(est) == 56
    assert KVPool.page_bytes(est, 10, torch.float16) == 56 * 10 * 2 * 50 * (2 * 8 * 64) * 2 == 114_688_000
    assert KVPool.page_bytes(est, 10, torch.float16, inputs=True) == 56 * 10 * 2 * 50 * 256 * 2
    # The deploy sizing keeps these page sizes as constants, as measured: they are the formula's.
    for inputs in (True, False):
        assert PAGE_BYTES[inputs] == KVPool.page_bytes(est, 10, torch.float16, inputs=inputs)


def test_a_call_of_17_to_24_streams_runs_on_the_bucket_of_24_rows(tiny_model):
    """The incremental graphs' row buckets include 24 and 48 (flow_cache.BATCH_BUCKETS): a call of 17
    streams pads to 24 rows, not 32, and every stream still gets the recompute path's frames."""
    flow = tiny_model.flow
    steps, cpu = flow.decoder.n_timesteps, torch.device("cpu")
    pool = KVPool(raw_estimator(flow), pages=96, steps=steps, device=cpu, dtype=torch.float32, inputs=True)
    p = prompt(75, 7)
    tokens = torch.randint(0, 6561, (28,), generator=torch.Generator().manual_seed(8))
    caches = [FlowCache() for _ in range(17)]
    runner = IncrementalFlow(flow, pool, graphs=True)
    results = runner([FlowItem(c, *p, tokens, False) for c in caches])
    width = max(mel.shape[1] for mel, _ in results)
    assert runner.run_frames == 24 * bucket(width, WIDTH_BUCKETS)
    whole = recompute(flow, p, tokens, False)
    for mel, start in (results[0], results[16]):
        assert_after_prompt(mel, start, whole, 150)
    for c in caches:
        pool.release(c.pages)


@pytest.mark.parametrize("inputs", [False, True], ids=["keys-values", "attention-inputs"])
def test_steps_indexed_by_a_tensor_give_the_same_frames_tails_and_pages(tiny_model, inputs):
    """With step_graphs a bucket's CUDA graph is one Euler step, which reads the step from a tensor
    (incremental_graphs.py); on a CPU the calls run eagerly indexed that way. Two streams in one
    padded call, chunk after chunk: the same frames, tails and pool pages as the steps given as ints,
    bit for bit."""
    flow = tiny_model.flow
    steps, cpu = flow.decoder.n_timesteps, torch.device("cpu")
    pools = [KVPool(raw_estimator(flow), 48, steps, cpu, torch.float32, inputs) for _ in range(2)]
    runners = [IncrementalFlow(flow, pools[0], graphs=True), IncrementalFlow(flow, pools[1], True, True)]
    prompts = [prompt(75, 21), prompt(37, 22)]
    tokens = torch.randint(0, 6561, (150,), generator=torch.Generator().manual_seed(23))
    caches = [[FlowCache() for _ in prompts] for _ in runners]
    for n, final in [(28, False), (78, False), (150, True)]:
        results = [
            runner([FlowItem(c, *p, tokens[:n], final) for c, p in zip(cs, prompts, strict=True)])
            for runner, cs in zip(runners, caches, strict=True)
        ]
        for (mel_int, start_int), (mel_t, start_t) in zip(*results, strict=True):
            assert start_int == start_t and torch.equal(mel_int, mel_t)
        for by_int, by_tensor in zip(*caches, strict=True):
            assert by_int.pages == by_tensor.pages and by_int.frames == by_tensor.frames
            assert torch.equal(by_int.tails, by_tensor.tails)
        assert torch.equal(pools[0].kv, pools[1].kv)
    # The int way is the one the other tests check against the recompute path.
    whole = recompute(flow, prompts[1], tokens, True)
    assert_after_prompt(results[1][1][0], results[1][1][1], whole, 74)


def test_a_tensor_step_writes_float32_convolution_inputs_to_half_precision_tails():
    """As served on a GPU: the tails are in float16 (the x-vector's dtype), a convolution's input
    in float32. A step given as a tensor keeps the same tails as one given as an int, whose writes
    cast (on an H100 the tensor way's indexed write refused the float32 input)."""
    from cosyapp.engine.token2wav.incremental import CallInputs, _StepIO

    g = torch.Generator().manual_seed(5)
    steps, rows, channels = 3, 2, 6
    tails = torch.randn(steps, 2 * rows, channels, 2, generator=g).half()
    inputs = CallInputs(
        *(torch.zeros(1) for _ in range(5)),
        read_rows=torch.zeros(1, dtype=torch.long),
        attn_mask=torch.zeros(1),
        tails=tails,
        keep=torch.tensor([3, 5]),
        write_rows=torch.zeros(1, dtype=torch.long),
    )
    x = torch.randn(2 * rows, channels, 7, generator=g)
    kv = torch.zeros(1, 4, steps, 2, 8)
    got = []
    for step in (1, torch.tensor([1])):
        io = _StepIO(kv, inputs, tails.clone())
        io.start_step(step)
        full = io.conv_input(x)
        io.end_step()
        got.append((full, io.new_tails))
    (full_int, tails_int), (full_tensor, tails_tensor) = got
    assert torch.equal(full_int, full_tensor) and torch.equal(tails_int, tails_tensor)
    assert not torch.equal(tails_int[1], tails[1]) and torch.equal(tails_int[0], tails[0])


def test_blank_inputs_make_a_real_calls_bucket_and_touch_only_the_trash_page(tiny_model):
    """With step graphs on a GPU every bucket of a row size met is captured from blank inputs
    (IncrementalGraphs.plan): they must give a real call's bucket key, shapes and dtypes, and the
    capture's runs must leave every page but the trash page as it was, at each width and past."""
    from dataclasses import fields

    from cosyapp.engine.token2wav.flow_cache import PAST_BUCKETS, blank_inputs
    from cosyapp.engine.token2wav.incremental import CallInputs, run_cfm
    from cosyapp.engine.token2wav.incremental_graphs import IncrementalGraphs
    from cosyapp.engine.token2wav.pages import TRASH

    flow = tiny_model.flow
    steps, cpu = flow.decoder.n_timesteps, torch.device("cpu")
    pool = KVPool(raw_estimator(flow), pages=48, steps=steps, device=cpu, dtype=torch.float32, inputs=True)
    runner = IncrementalFlow(flow, pool, graphs=True)
    seen: list[CallInputs] = []
    run = runner.graphs.run
    runner.graphs.run = lambda inputs: seen.append(inputs) or run(inputs)  # records, then runs it
    caches = [FlowCache() for _ in range(3)]  # 3 streams: the row bucket of 4
    tokens = torch.randint(0, 6561, (78,), generator=torch.Generator().manual_seed(31))
    runner([FlowItem(c, *prompt(75, 30), tokens[:28], False) for c in caches])
    runner([FlowItem(c, *prompt(75, 30), tokens, False) for c in caches])
    real = seen[-1]
    rows, width = real.x.size(0), real.x.size(2)
    past = real.read_rows.numel() // (2 * rows) - -(-width // PAGE)
    blank = blank_inputs(real, (rows, width, past), PAGE)
    assert IncrementalGraphs.key(blank) == IncrementalGraphs.key(real)
    for f in fields(CallInputs):
        want, got = getattr(real, f.name), getattr(blank, f.name)
        assert got.shape == want.shape and got.dtype == want.dtype, f.name
    cfg = flow.decoder.inference_cfg_rate
    trash = [2 * TRASH, 2 * TRASH + 1]  # the trash page's rows (both CFG rows) in every block
    others = [r for r in range(pool.kv.size(1)) if r not in trash]
    like = blank_inputs(real, (1, WIDTH_BUCKETS[0], 0), PAGE)
    for w in WIDTH_BUCKETS:
        for p in PAST_BUCKETS:
            before = pool.kv[:, others].clone()
            x, _ = run_cfm(runner.step_fn, pool.kv, blank_inputs(like, (1, w, p), PAGE), cfg, True)
            assert x.shape == (1, 80, w) and torch.isfinite(x).all()
            assert torch.equal(pool.kv[:, others], before), (w, p)
    for c in caches:
        pool.release(c.pages)

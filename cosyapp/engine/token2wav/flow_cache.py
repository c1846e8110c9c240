"""Incremental streaming flow: a chunk call computes only the mel frames no earlier call has kept.

Why this is exact (docs/model.md §6.7, §8.7): in streaming mode the estimator attends within static
50-frame chunks counted from frame 0, with every earlier chunk visible, its convolutions are causal
and its norms act per frame, and the CFM starts every frame from the same column of the fixed noise.
So once a chunk is complete, its frames' trajectory through the ten Euler steps, and everything later
frames read from it, never change. Kept per stream, for every Euler step and both CFG rows:

- the keys and values of each committed frame in every transformer block, in pages of one chunk in
  a shared pool (``KVPool``), so batching streams costs one gather per block and step; or, with
  ``inputs``, each attention's normalised input instead (a quarter of the bytes at full size: 256
  channels against keys and values of 2 x 512), from which every call projects the past's keys and
  values again with the same weights (the same values: the projection reads what it read when the
  frame was new);
- the last two inputs of every causal convolution at the committed boundary (``FlowCache.tails``).

The encoder is cheap (about 1 % of the flow's work) and is recomputed over the whole prefix, as the
recompute path does, so its output for the new frames is the same by construction.

A voice's prompt chunks that no generated token can reach (the 3-token lookahead ends inside the
prompt) are computed once and shared by every stream of that voice (``VoicePages``).
"""

import functools
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from cosyapp.engine.token2wav.graphs import bucket
from cosyapp.engine.token2wav.incremental import (
    ROWS,
    TAIL,
    CallInputs,
    IncrementalEstimator,
    run_cfm,
)
from cosyapp.engine.token2wav.incremental_graphs import IncrementalGraphs
from cosyapp.engine.token2wav.pages import TRASH, FlowCache, KVPool
from cosyapp.models.flow import CausalMaskedDiffWithXvec, join_prompt, prompt_condition
from cosyapp.models.flow_encoder import length_mask
from cosyapp.models.flow_estimator import CausalConditionalDecoder, CausalResnetBlock1D

# Rows of the incremental calls' graphs. 24 and 48 between the powers of two: on an H100 the three
# chunk calls of a 260-token sentence took 502 ms for 24 streams on their own bucket against 599 ms
# padded to 32, and 827 against 1061 ms for 48 against 64 (docs/benchmarks/README.md, "Row buckets").
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
WIDTH_BUCKETS = (100, 200, 250)  # new frames: a first chunk after voice pages, 100-token hops, finals
PAST_BUCKETS = (0, 1, 2, 4, 8, 16, 32)  # committed pages: a 3 s prompt and up to 29 s of speech


def raw_estimator(flow: CausalMaskedDiffWithXvec) -> CausalConditionalDecoder:
    """The flow's estimator module, unwrapped from a CUDA-graph replayer if there is one."""
    estimator = flow.decoder.estimator
    return getattr(estimator, "estimator", estimator)


def conv_channels(estimator: CausalConditionalDecoder) -> list[int]:
    """Input channels of the estimator's causal convolutions, in the order one step runs them."""

    def resnet(r: CausalResnetBlock1D) -> list[int]:
        return [r.block1.block[0].in_channels, r.block2.block[0].in_channels]

    down_resnet, _, down_conv = estimator.down_blocks[0]
    up_resnet, _, up_conv = estimator.up_blocks[0]
    channels = resnet(down_resnet) + [down_conv.in_channels]
    for mid_resnet, _ in estimator.mid_blocks:
        channels += resnet(mid_resnet)
    channels += resnet(up_resnet) + [up_conv.in_channels, estimator.final_block.block[0].in_channels]
    return channels


@dataclass
class FlowItem:
    """One stream's part of an incremental flow call."""

    cache: FlowCache
    prompt_tokens: Tensor  # (P,) long on the device
    prompt_feat: Tensor  # (M, 80)
    embedding: Tensor  # (192,)
    tokens: Tensor  # (G,) long: every generated token so far, plus the lookahead unless final
    final: bool  # no lookahead: the stream's last call
    commit_to: int | None = None  # frames to commit; None = every complete chunk (all of them if final)


def encode(
    flow: CausalMaskedDiffWithXvec, items: list[FlowItem], final: bool
) -> tuple[Tensor, list[int], Tensor]:
    """The streaming-mode encoder over each item's whole prefix: (mu (B, 80, T), each item's frames
    (from the token counts, on the host: planning the call's pages then does not wait for the
    encoder), spks (B, 80))."""
    dev = flow.input_embedding.weight.device
    pad = torch.nn.utils.rnn.pad_sequence
    token, token_len = (
        pad([i.tokens for i in items], batch_first=True),
        torch.tensor([len(i.tokens) for i in items], device=dev),
    )
    prompt, prompt_len = (
        pad([i.prompt_tokens for i in items], batch_first=True),
        torch.tensor([len(i.prompt_tokens) for i in items], device=dev),
    )
    tokens, lengths = join_prompt(prompt, prompt_len, token, token_len)
    spks = flow.spk_embed_affine_layer(F.normalize(torch.stack([i.embedding for i in items]), dim=1))
    x = flow.input_embedding(tokens.clamp(min=0)) * length_mask(lengths, tokens.size(1)).unsqueeze(-1)
    h, _ = flow.encoder(x, lengths, streaming=True, finalize=final)
    lens = flow.encoder.output_lengths([len(i.prompt_tokens) + len(i.tokens) for i in items], final)
    return flow.encoder_proj(h).transpose(1, 2), lens, spks


def _frames(values: Tensor, start: Tensor, width: int) -> Tensor:
    """values (B, C, T) -> (B, C, width) with values[b, :, start_b + j] (clamped at the end)."""
    idx = (start.unsqueeze(1) + torch.arange(width, device=values.device)).clamp(max=values.size(2) - 1)
    return values.gather(2, idx.unsqueeze(1).expand(-1, values.size(1), -1))


@dataclass
class _Plan:
    news: list[int]  # new frames per item
    keeps: list[int]  # frames each item commits (whole pages)
    pages: list[list[int]]  # fresh pool pages per item


def _plan(items: list[FlowItem], ends: list[int], pool: KVPool) -> _Plan | None:
    page = pool.page
    news, keeps = [], []
    for item, end in zip(items, ends, strict=True):
        assert end > item.cache.frames, "an incremental call needs new frames for every item"
        commit = 0 if item.final else (end // page) * page
        if item.commit_to is not None:
            commit = min(commit, item.commit_to)
        news.append(end - item.cache.frames)
        keeps.append(max(0, commit - item.cache.frames))
    fresh = pool.allocate(sum(keeps) // page)
    if fresh is None:
        return None
    pages, taken = [], 0
    for keep in keeps:
        pages.append(fresh[taken : taken + keep // page])
        taken += keep // page
    return _Plan(news, keeps, pages)


def attention_shape(shape: tuple[int, int, int], page: int) -> tuple[int, int, int, int]:
    """The attention mask's shape of a call at ``shape`` = (rows, new frames, past pages): both CFG
    rows of each row, its new frames, and as keys its past pages and the new frames' pages."""
    rows, width, past_pages = shape
    return ROWS * rows, 1, width, (past_pages + -(-width // page)) * page


def blank_inputs(like: CallInputs, shape: tuple[int, int, int], page: int) -> CallInputs:
    """A call at ``shape`` = (rows, new frames, past pages) whose rows are all dummies, with the
    dtypes and feature sizes of ``like``: a graph captured from it before any call meets its bucket
    (IncrementalGraphs.plan) reads and writes the trash page only."""
    rows, width, past_pages = shape
    dev = like.x.device
    n_pages = -(-width // page)

    def zeros(t: Tensor, *size: int) -> Tensor:
        return torch.zeros(size, dtype=t.dtype, device=dev)

    def trash(pages: int) -> Tensor:
        return pool_rows(torch.full((rows, pages), TRASH, dtype=torch.long)).to(dev)

    return CallInputs(
        x=zeros(like.x, rows, like.x.size(1), width),
        mask=zeros(like.mask, rows, 1, width),
        mu=zeros(like.mu, rows, like.mu.size(1), width),
        spks=zeros(like.spks, rows, like.spks.size(1)),
        cond=zeros(like.cond, rows, like.cond.size(1), width),
        read_rows=trash(past_pages + n_pages),
        attn_mask=zeros(like.attn_mask, *attention_shape(shape, page)),
        tails=zeros(like.tails, like.tails.size(0), ROWS * rows, like.tails.size(2), TAIL),
        keep=zeros(like.keep, rows),
        write_rows=trash(n_pages),
    )


def pool_rows(pages: Tensor) -> Tensor:
    """Pages (B, n) -> the pool rows holding them, (ROWS * B * n,) in the estimator's batch order."""
    return torch.cat([pages * ROWS + r for r in range(ROWS)]).flatten()


def _inputs(
    flow: CausalMaskedDiffWithXvec,
    items: list[FlowItem],
    plan: _Plan,
    mu_all: Tensor,
    spks: Tensor,
    shape: tuple[int, int, int],
    page: int,
) -> CallInputs:
    """The call's inputs at `shape` = (rows, new frames, past pages); rows after the items are dummies."""
    rows, width, past_pages = shape
    dev, dtype = mu_all.device, spks.dtype
    n = len(items)
    past = torch.tensor([i.cache.frames for i in items] + [0] * (rows - n), device=dev)
    news = torch.tensor(plan.news + [0] * (rows - n), device=dev)
    valid = length_mask(news, width)
    mu = F.pad(_frames(mu_all, past[:n], width), (0, 0, 0, 0, 0, rows - n))
    cond_all = prompt_condition(
        torch.nn.utils.rnn.pad_sequence([i.prompt_feat for i in items], batch_first=True),
        torch.tensor([len(i.prompt_feat) for i in items], device=dev),
        mu_all.size(2),
    ).to(mu.dtype)
    cond = F.pad(_frames(cond_all, past[:n], width), (0, 0, 0, 0, 0, rows - n))
    noise = flow.decoder.rand_noise.to(dev)  # (1, 80, max frames)
    x = _frames(noise.expand(rows, -1, -1), past, width).to(mu.dtype)
    n_pages = -(-width // page)
    write = torch.full((rows, n_pages), TRASH, dtype=torch.long)
    for b, fresh in enumerate(plan.pages):
        write[b, : len(fresh)] = torch.tensor(fresh, dtype=torch.long)
    # Each row reads its past pages, then its new pages (written just before: the trash page where
    # not committed, whose slots the new frames then cover), so the keys end on whole pages.
    table = torch.full((rows, past_pages), TRASH, dtype=torch.long)
    for b, item in enumerate(items):
        table[b, : len(item.cache.pages)] = torch.tensor(item.cache.pages, dtype=torch.long)
    table = torch.cat([table, write], dim=1)
    new_keys = length_mask(news, n_pages * page)
    keys = torch.cat([length_mask(past, past_pages * page), new_keys], dim=1)  # committed, then new frames
    pos = torch.arange(n_pages * page, device=dev)  # new x new: chunks counted from the past's end
    in_chunk = pos.unsqueeze(0) < ((pos[:width] // page + 1) * page).unsqueeze(1)
    allowed = keys.unsqueeze(1).expand(-1, width, -1).clone()
    allowed[:, :, past_pages * page :] &= in_chunk
    allowed[n:, :, 0] = True  # dummy rows attend to one key, so no softmax row is empty
    # Additive, in the attention's dtype, built once per call (SDPA would turn a boolean mask into
    # exactly this in every block).
    bias = torch.zeros(allowed.shape, device=dev, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    channels = sum(conv_channels(raw_estimator(flow)))
    steps = flow.decoder.n_timesteps
    tails = torch.zeros(steps, ROWS * rows, channels, TAIL, device=dev, dtype=dtype)
    for b, item in enumerate(items):
        if item.cache.tails is not None:
            tails[:, b::rows] = item.cache.tails.to(dtype)
    return CallInputs(
        x=x,
        mask=valid.unsqueeze(1).to(mu.dtype),
        mu=mu,
        spks=F.pad(spks, (0, 0, 0, rows - n)),
        cond=cond,
        read_rows=pool_rows(table).to(dev),
        attn_mask=bias.repeat(ROWS, 1, 1).unsqueeze(1),
        tails=tails,
        keep=torch.tensor(plan.keeps + [0] * (rows - n), device=dev),
        write_rows=pool_rows(write).to(dev),
    )


class IncrementalFlow:
    """The incremental streaming flow of one model over one page pool (see the module docstring)."""

    def __init__(
        self, flow: CausalMaskedDiffWithXvec, pool: KVPool, graphs: bool = False, step_graphs: bool = False
    ):
        """graphs: pad calls to shape buckets and replay them from CUDA graphs (on a CPU the padded
        calls run eagerly, which checks the padding); step_graphs: a graph per bucket of one Euler
        step, not of the call (IncrementalGraphs)."""
        self.flow, self.pool = flow, pool
        estimator = raw_estimator(flow)
        # With --compile-flow the step runs the estimator's compiled pieces (fused.py); its blocks
        # compiled whole (compiled_blocks.py) measured slower on an H100, so they are not served.
        self.step_fn = IncrementalEstimator(estimator, pool.inputs)
        cfg_rate = flow.decoder.inference_cfg_rate
        self.graphs = None
        if graphs:
            self.graphs = IncrementalGraphs(self.step_fn, pool, cfg_rate, step_graphs=step_graphs)
        self.run_frames = 0  # new frames the calls ran per item, their shape's padding included
        self._planned_rows: set[int] = set()  # row buckets whose every bucket the graphs capture

    def _plan_row_bucket(self, inputs: CallInputs, rows: int) -> None:
        """With step graphs on a GPU, the first call of ``rows`` rows has every bucket of that many rows
        captured (IncrementalGraphs.plan), from blank inputs of this call's dtypes."""
        if not (self.graphs.step_graphs and inputs.x.is_cuda) or rows in self._planned_rows:
            return
        self._planned_rows.add(rows)
        page = self.pool.page
        like = blank_inputs(inputs, (1, WIDTH_BUCKETS[0], 0), page)  # dtypes and sizes, little memory
        blanks = {}
        for width, past in itertools.product(WIDTH_BUCKETS, PAST_BUCKETS):
            shape = (rows, width, past)
            build = functools.partial(blank_inputs, like, shape, page)
            blanks[self.graphs.key(inputs, attention_shape(shape, page))] = build
        self.graphs.plan(blanks)

    @torch.inference_mode()
    def __call__(self, items: list[FlowItem]) -> list[tuple[Tensor, int]] | None:
        """Run the flow for ``items`` (all final or all not), computing only frames after each cache.

        Returns, per item, (mel (80, n) of frames [start, end) in float32, start = the cache's frames
        before the call), and advances each cache to its committed frames. Returns None, changing
        nothing, when the pool lacks the pages the call would commit.
        """
        final = items[0].final
        assert all(i.final == final for i in items)
        mu_all, lens, spks = encode(self.flow, items, final)
        plan = _plan(items, lens, self.pool)
        if plan is None:
            return None
        width = max(plan.news)
        past_pages = max(len(i.cache.pages) for i in items)
        exact = (len(items), width, past_pages)
        padded = (
            bucket(exact[0], BATCH_BUCKETS),
            bucket(width, WIDTH_BUCKETS),
            bucket(past_pages, PAST_BUCKETS),
        )
        graphed = self.graphs is not None and None not in padded
        shape = padded if graphed else exact
        try:
            inputs = _inputs(self.flow, items, plan, mu_all, spks, shape, self.pool.page)
            if graphed:
                self._plan_row_bucket(inputs, shape[0])
                x, tails = self.graphs.run(inputs)
            else:
                cfg_rate = self.flow.decoder.inference_cfg_rate
                x, tails = run_cfm(self.step_fn, self.pool.kv, inputs, cfg_rate)
        except BaseException:
            self.pool.release([p for pages in plan.pages for p in pages])  # the call commits nothing
            raise
        mel = x.float()
        rows = shape[0]
        self.run_frames += rows * shape[1]
        results = []
        for b, item in enumerate(items):
            cache = item.cache
            results.append((mel[b, :, : plan.news[b]], cache.frames))
            if plan.pages[b]:
                cache.pages = cache.pages + plan.pages[b]
                cache.frames += plan.keeps[b]
                cache.tails = tails[:, b::rows].clone()
        return results

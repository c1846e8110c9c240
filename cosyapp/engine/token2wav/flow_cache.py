"""Incremental streaming flow: a chunk call computes only the mel frames no earlier call has kept.

Why this is exact (docs/model.md §6.7, §8.7): in streaming mode the estimator attends within static
50-frame chunks counted from frame 0, with every earlier chunk visible, its convolutions are causal
and its norms act per frame, and the CFM starts every frame from the same column of the fixed noise.
So once a chunk is complete, its frames' trajectory through the ten Euler steps, and everything later
frames read from it, never change. Kept per stream, for every Euler step and both CFG rows:

- the keys and values of each committed frame in every transformer block, in pages of one chunk in
  a shared pool (``KVPool``), so batching streams costs one gather per block and step;
- the last two inputs of every causal convolution at the committed boundary (``FlowCache.tails``).

The encoder is cheap (about 1 % of the flow's work) and is recomputed over the whole prefix, as the
recompute path does, so its output for the new frames is the same by construction.

A voice's prompt chunks that no generated token can reach (the 3-token lookahead ends inside the
prompt) are computed once and shared by every stream of that voice (``VoicePages``).
"""

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyapp.models.flow import CausalMaskedDiffWithXvec, cosine_time_grid, join_prompt, prompt_condition
from cosyapp.models.flow_encoder import length_mask
from cosyapp.models.flow_estimator import (
    CausalBlock1D,
    CausalConditionalDecoder,
    CausalConv1d,
    CausalResnetBlock1D,
    time_embedding,
)

ROWS = 2  # CFG: the conditional row, then the unconditional one
TAIL = 2  # inputs a kernel-3 causal convolution reads before the current frame


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


def transformer_count(estimator: CausalConditionalDecoder) -> int:
    stages = [
        estimator.down_blocks[0][1],
        *(blocks for _, blocks in estimator.mid_blocks),
        estimator.up_blocks[0][1],
    ]
    return sum(len(blocks) for blocks in stages)


class KVPool:
    """Keys and values of committed frames, in pages of one chunk, shared by every stream.

    ``k``/``v`` are (blocks, pages, steps, ROWS, heads, page, head_dim). Pages are reference-counted:
    a voice's prompt pages are held by the voice cache and by every stream that started from them.
    """

    def __init__(
        self,
        estimator: CausalConditionalDecoder,
        pages: int,
        steps: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        attn = estimator.down_blocks[0][1][0].attn1
        self.page = estimator.static_chunk_size
        self.blocks = transformer_count(estimator)
        self.steps = steps
        shape = (self.blocks, pages, steps, ROWS, attn.heads, self.page, attn.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._refs = [0] * pages
        self._free = list(range(pages - 1, -1, -1))
        self._lock = threading.Lock()  # pages are released from the event loop's side too

    @staticmethod
    def page_bytes(estimator: CausalConditionalDecoder, steps: int, dtype: torch.dtype) -> int:
        attn = estimator.down_blocks[0][1][0].attn1
        per_frame = transformer_count(estimator) * 2 * steps * ROWS * attn.heads * attn.head_dim
        return per_frame * estimator.static_chunk_size * torch.finfo(dtype).bits // 8

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages (reference count 1), or None when the pool has fewer free."""
        with self._lock:
            if n > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(n)]
            for p in pages:
                self._refs[p] = 1
            return pages

    def retain(self, pages: list[int]) -> None:
        with self._lock:
            for p in pages:
                assert self._refs[p] > 0
                self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        with self._lock:
            for p in pages:
                self._refs[p] -= 1
                assert self._refs[p] >= 0
                if self._refs[p] == 0:
                    self._free.append(p)


@dataclass
class FlowCache:
    """What one stream keeps of its committed frames: pages in the pool and the convolution tails."""

    pages: list[int] = field(default_factory=list)
    tails: Tensor | None = None  # (steps, ROWS, sum of conv input channels, TAIL); None = zeros
    frames: int = 0  # committed frames, a whole number of pages


@dataclass
class VoiceEntry:
    pages: list[int]
    tails: Tensor
    frames: int


class VoicePages:
    """Prompt pages per voice, least recently used out; at most ``max_pages`` held in all."""

    def __init__(self, pool: KVPool, max_pages: int):
        self.pool = pool
        self.max_pages = max_pages
        self._entries: OrderedDict[str, VoiceEntry] = OrderedDict()
        self._held = 0

    def get(self, key: str) -> VoiceEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: VoiceEntry) -> None:
        """Keep ``entry`` (its pages already retained for the cache) under ``key``."""
        while self._entries and self._held + len(entry.pages) > self.max_pages:
            _, old = self._entries.popitem(last=False)
            self._held -= len(old.pages)
            self.pool.release(old.pages)
        self._entries[key] = entry
        self._held += len(entry.pages)

    def clear(self) -> None:
        while self._entries:
            _, old = self._entries.popitem(last=False)
            self.pool.release(old.pages)
        self._held = 0


def voice_key(speech_tokens: Tensor, speech_feat: Tensor, embedding: Tensor) -> str:
    """A digest of everything the prompt frames depend on."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (speech_tokens, speech_feat, embedding):
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def voice_frames(prompt_tokens: int, chunk_tokens: int, lookahead: int, ratio: int) -> int:
    """Mel frames of the prompt chunks whose encoder output no generated token can reach."""
    chunks = max(0, (prompt_tokens - lookahead) // chunk_tokens)
    return chunks * chunk_tokens * ratio


@dataclass
class _StepIO:
    """One call's cached context, read and written by the estimator step by step."""

    pool: KVPool
    table: Tensor | None  # (B, max past pages) long, or None when no stream has past frames
    attn_mask: Tensor  # (ROWS*B, 1, new, past + new) bool
    tails: Tensor  # (steps, ROWS*B, channels, TAIL): inputs before each stream's first new frame
    keep: Tensor  # (B,) new frames each stream commits (whole pages)
    write_pages: Tensor  # (n,) pool pages to write, in (stream, page) order
    write_index: Tensor  # (n,) flat (stream, page) index into the new frames' pages
    new_tails: Tensor  # like tails: the inputs before frame `keep` of each stream
    step: int = 0
    block: int = 0
    channel: int = 0

    def start_step(self, step: int) -> None:
        self.step, self.block, self.channel = step, 0, 0

    def conv_input(self, x: Tensor) -> Tensor:
        """x (ROWS*B, C, new) -> (ROWS*B, C, TAIL + new) with the stream's earlier inputs in front."""
        c = x.size(1)
        lo, hi = self.channel, self.channel + c
        full = torch.cat([self.tails[self.step, :, lo:hi].to(x.dtype), x], dim=2)
        # Inputs at new frames keep - 2, keep - 1 sit at columns keep, keep + 1 of `full`.
        idx = self.keep.repeat(ROWS).view(-1, 1, 1) + torch.arange(TAIL, device=x.device)
        self.new_tails[self.step, :, lo:hi] = full.gather(2, idx.expand(-1, c, -1)).to(self.new_tails.dtype)
        self.channel = hi
        return full

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """New keys/values (ROWS*B, H, new, D) -> with each stream's committed ones in front; commits
        the new frames' whole pages to the pool."""
        pool, layer, step = self.pool, self.block, self.step
        self.block += 1
        rb, heads, new, dim = k.shape
        batch = rb // ROWS
        if self.write_pages.numel():
            n_pages = math.ceil(new / pool.page)
            pad = n_pages * pool.page - new
            for store, values in ((pool.k, k), (pool.v, v)):
                paged = F.pad(values, (0, 0, 0, pad)).view(ROWS, batch, heads, n_pages, pool.page, dim)
                paged = paged.permute(1, 3, 0, 2, 4, 5).reshape(batch * n_pages, ROWS, heads, pool.page, dim)
                store[layer, self.write_pages, step] = paged[self.write_index].to(store.dtype)
        if self.table is None:
            return k, v
        out = []
        for store, values in ((pool.k, k), (pool.v, v)):
            past = store[layer][self.table, step]  # (B, pages, ROWS, H, page, D)
            past = past.permute(2, 0, 3, 1, 4, 5).reshape(rb, heads, -1, dim).to(values.dtype)
            out.append(torch.cat([past, values], dim=2))
        return out[0], out[1]


class IncrementalEstimator:
    """One estimator step over new frames only, reading and extending the streams' caches.

    Runs the modules of a ``CausalConditionalDecoder`` in the same order and with the same operations
    as its forward, except that causal convolutions get their left context from the cache instead of
    zeros and attention also sees the committed keys and values.
    """

    def __init__(self, estimator: CausalConditionalDecoder):
        self.est = estimator
        self.channels = sum(conv_channels(estimator))

    def __call__(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, io: _StepIO
    ):
        est = self.est
        t_emb = est.time_mlp(time_embedding(t, est.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)
        resnet, blocks, conv = est.down_blocks[0]
        h = self._attend(blocks, self._resnet(resnet, h, mask, t_emb, io), io)
        skip = h
        h = self._conv(conv, h * mask, io)
        for resnet, blocks in est.mid_blocks:
            h = self._attend(blocks, self._resnet(resnet, h, mask, t_emb, io), io)
        resnet, blocks, conv = est.up_blocks[0]
        h = self._attend(blocks, self._resnet(resnet, torch.cat([h, skip], dim=1), mask, t_emb, io), io)
        h = self._conv(conv, h * mask, io)
        h = self._block(est.final_block, h, mask, io)
        return est.final_proj(h * mask) * mask

    @staticmethod
    def _conv(conv: CausalConv1d, x: Tensor, io: _StepIO) -> Tensor:
        assert conv.kernel_size[0] == TAIL + 1
        return nn.Conv1d.forward(conv, io.conv_input(x))

    def _block(self, block: CausalBlock1D, x: Tensor, mask: Tensor, io: _StepIO) -> Tensor:
        conv, to_channels_last, norm, to_channels_first, mish = block.block
        h = self._conv(conv, x * mask, io)
        return mish(to_channels_first(norm(to_channels_last(h)))) * mask

    def _resnet(self, r: CausalResnetBlock1D, x: Tensor, mask: Tensor, t_emb: Tensor, io: _StepIO) -> Tensor:
        h = self._block(r.block1, x, mask, io) + r.mlp(t_emb).unsqueeze(-1)
        return self._block(r.block2, h, mask, io) + r.res_conv(x * mask)

    @staticmethod
    def _attend(blocks: nn.ModuleList, h: Tensor, io: _StepIO) -> Tensor:
        h = h.transpose(1, 2)
        for block in blocks:
            attn = block.attn1
            x = block.norm1(h)
            b, t, _ = x.shape
            q, k, v = (
                proj(x).view(b, t, attn.heads, attn.head_dim).transpose(1, 2)
                for proj in (attn.to_q, attn.to_k, attn.to_v)
            )
            k, v = io.keys_values(k, v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=io.attn_mask)
            h = h + attn.to_out[0](out.transpose(1, 2).reshape(b, t, attn.heads * attn.head_dim))
            h = h + block.ff(block.norm3(h))
        return h.transpose(1, 2)


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
) -> tuple[Tensor, Tensor, Tensor]:
    """The streaming-mode encoder over each item's whole prefix: (mu (B, 80, T), lens (B,), spks (B, 80))."""
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
    h, h_lens = flow.encoder(x, lengths, streaming=True, finalize=final)
    return flow.encoder_proj(h).transpose(1, 2), h_lens, spks


def _frames(values: Tensor, start: Tensor, width: int) -> Tensor:
    """values (B, C, T) -> (B, C, width) with values[b, :, start_b + j] (clamped at the end)."""
    idx = (start.unsqueeze(1) + torch.arange(width, device=values.device)).clamp(max=values.size(2) - 1)
    return values.gather(2, idx.unsqueeze(1).expand(-1, values.size(1), -1))


@torch.inference_mode()
def incremental_flow(
    flow: CausalMaskedDiffWithXvec, pool: KVPool, items: list[FlowItem]
) -> list[tuple[Tensor, int]] | None:
    """Run the flow for ``items`` (all final or all not), computing only frames after each cache.

    Returns, per item, (mel (80, n) of frames [cache.frames, end) in float32, cache.frames before the
    call), and advances each cache to its committed frames. Returns None, changing nothing, when the
    pool lacks the pages the call would commit.
    """
    final = items[0].final
    assert all(i.final == final for i in items)
    est = raw_estimator(flow)
    cfm = flow.decoder
    mu_all, lens, spks = encode(flow, items, final)
    dev, dtype = mu_all.device, spks.dtype
    page = pool.page
    past = torch.tensor([i.cache.frames for i in items], device=dev)
    ends = lens.tolist()
    keeps = []
    for item, end in zip(items, ends, strict=True):
        commit = end if item.final else (end // page) * page
        if item.commit_to is not None:
            commit = min(commit, item.commit_to)
        keeps.append(max(0, (commit - item.cache.frames) // page * page) if not item.final else 0)
    new_pages = [k // page for k in keeps]
    fresh = pool.allocate(sum(new_pages))
    if fresh is None:
        return None
    batch = len(items)
    news = [end - i.cache.frames for i, end in zip(items, ends, strict=True)]
    width = max(news)
    assert min(news) > 0, "an incremental call needs new frames for every item"
    n_pages = math.ceil(width / page)
    write_index = [b * n_pages + j for b in range(batch) for j in range(new_pages[b])]

    mu = _frames(mu_all, past, width)
    frames = lens.new_tensor(news)
    valid = length_mask(frames, width)
    mask = valid.unsqueeze(1).to(mu.dtype)
    cond_all = prompt_condition(
        torch.nn.utils.rnn.pad_sequence([i.prompt_feat for i in items], batch_first=True),
        torch.tensor([len(i.prompt_feat) for i in items], device=dev),
        mu_all.size(2),
    ).to(mu.dtype)
    cond = _frames(cond_all, past, width)
    noise = cfm.rand_noise.to(dev)
    x = _frames(noise.expand(batch, -1, -1), past, width).to(mu.dtype)

    past_pages = max(len(i.cache.pages) for i in items)
    table = None
    if past_pages:
        table = torch.tensor(
            [i.cache.pages + [0] * (past_pages - len(i.cache.pages)) for i in items], device=dev
        )
    key_valid = torch.cat(
        [length_mask(past, past_pages * page), valid], dim=1
    )  # (B, past + new): committed frames, then this call's real frames
    pos = torch.arange(width, device=dev)
    in_chunk = pos.unsqueeze(0) < ((pos // page + 1) * page).unsqueeze(
        1
    )  # new x new, chunks from the past's end
    allowed = key_valid.unsqueeze(1).expand(-1, width, -1).clone()
    allowed[:, :, past_pages * page :] &= in_chunk
    attn_mask = allowed.repeat(ROWS, 1, 1).unsqueeze(1)

    channels = sum(conv_channels(est))
    tails = torch.zeros(cfm.n_timesteps, ROWS * batch, channels, TAIL, device=dev, dtype=dtype)
    for b, item in enumerate(items):
        if item.cache.tails is not None:
            tails[:, b::batch][:, :ROWS] = item.cache.tails.to(dtype)
    keep = torch.tensor(keeps, device=dev)
    io = _StepIO(
        pool=pool,
        table=table,
        attn_mask=attn_mask,
        tails=tails,
        keep=keep,
        write_pages=torch.tensor(fresh, device=dev, dtype=torch.long),
        write_index=torch.tensor(write_index, device=dev, dtype=torch.long),
        new_tails=tails.clone(),
    )
    step_fn = IncrementalEstimator(est)

    t_span = cosine_time_grid(cfm.n_timesteps, dev, mu.dtype)
    mask_in = torch.cat([mask, mask]).to(dtype)
    mu_in = torch.cat([mu, torch.zeros_like(mu)]).to(dtype)
    spks_in = torch.cat([spks, torch.zeros_like(spks)])
    cond_in = torch.cat([cond, torch.zeros_like(cond)]).to(dtype)
    rate = cfm.inference_cfg_rate
    t = t_span[0]
    for step in range(1, len(t_span)):
        io.start_step(step - 1)
        dt = t_span[step] - t
        t_in = t.to(dtype).expand(ROWS * batch)
        velocity = step_fn(torch.cat([x, x]).to(dtype), mask_in, mu_in, t_in, spks_in, cond_in, io)
        v_cond, v_uncond = velocity.chunk(2)
        x = x + dt * ((1.0 + rate) * v_cond - rate * v_uncond)
        t = t + dt
    mel = x.float()

    results = []
    taken = 0
    for b, item in enumerate(items):
        cache = item.cache
        start = cache.frames
        results.append((mel[b, :, : news[b]], start))
        pages = fresh[taken : taken + new_pages[b]]
        taken += new_pages[b]
        if pages:
            cache.pages = cache.pages + pages
            cache.frames += keeps[b]
            cache.tails = io.new_tails[:, b::batch][:, :ROWS].clone()
    return results

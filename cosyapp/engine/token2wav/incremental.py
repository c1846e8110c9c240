"""The CFM over new frames only, against the keys/values and convolution tails kept in a page pool.

``CallInputs`` holds one call's inputs at fixed shapes (rows, new frames, past pages), so the ten
Euler steps can be replayed from one CUDA graph per shape bucket (incremental_graphs.py); the eager
path runs the same code. See flow_cache.py for what is kept and why it is exact.
"""

import logging
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyapp.engine.token2wav.writes import as_words, put_rows, put_tails
from cosyapp.models.flow import cosine_time_grid
from cosyapp.models.flow_estimator import (
    CausalBlock1D,
    CausalConditionalDecoder,
    CausalConv1d,
    CausalResnetBlock1D,
    autocast_dtype,
    time_embedding,
)

if TYPE_CHECKING:  # pages.py imports this module
    pass

log = logging.getLogger(__name__)

ROWS = 2  # CFG: the conditional row, then the unconditional one
TAIL = 2  # inputs a kernel-3 causal convolution reads before the current frame


@dataclass
class CallInputs:
    """One call at a bucket's shape: B rows (streams, dummies after the real ones), W new frames,
    Pp past pages of `page` frames each.

    The pool keeps each page's two CFG rows as two physical rows, ``page * ROWS + r``, and the
    estimator's batch is row-major (row r of stream b is batch entry ``r * B + b``); the row lists
    below are in that order, so one gather reads a call's past and one scatter writes its new pages.
    """

    x: Tensor  # (B, 80, W) the fixed noise at each stream's new frames
    mask: Tensor  # (B, 1, W) 1 at real new frames
    mu: Tensor  # (B, 80, W)
    spks: Tensor  # (B, 80)
    cond: Tensor  # (B, 80, W)
    read_rows: Tensor  # (ROWS*B*(Pp+Wp),) long: each batch entry's Pp past pages (trash after its
    # own), then its Wp = ceil(W / page) new pages (written first; trash where not committed)
    attn_mask: Tensor  # (ROWS*B, 1, W, (Pp+Wp)*page) additive: 0 where allowed, -inf where not
    tails: Tensor  # (steps, ROWS*B, channels, TAIL) inputs before each stream's first new frame
    keep: Tensor  # (B,) long: new frames each stream commits
    write_rows: Tensor  # (ROWS*B*ceil(W / page),) long: the pool row of each new page (trash: none)

    def copy_(self, other: "CallInputs") -> None:
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))

    def empty_like(self) -> "CallInputs":
        return CallInputs(**{f.name: torch.zeros_like(getattr(self, f.name)) for f in fields(self)})


class _StepIO:
    """What one estimator step reads from and writes to the caches, block by block."""

    def __init__(self, kv: Tensor, inputs: CallInputs, new_tails: Tensor):
        self.kv, self.inputs, self.new_tails = kv, inputs, new_tails
        self.step = self.block = self.channel = 0
        # The step as a tensor of one index too: a step compiled by torch.compile
        # (scripts/flow_compile_speed.py) indexes with it, as a Python int would make a graph per step.
        self._steps = torch.arange(inputs.tails.size(0), device=inputs.tails.device)
        self.step_t = self._steps[:1]
        # Each block's first row in the pool's rows of all blocks (first_row), made on the device as
        # the steps are (a CUDA graph's capture allows no copy from the host).
        self._offsets = torch.arange(kv.size(0), device=kv.device) * kv.size(1)
        # Where each batch entry's new tails start in a convolution's input: frames keep - 2 and
        # keep - 1 of the new ones, at columns keep and keep + 1 behind the TAIL old inputs.
        keep = inputs.keep.repeat(ROWS).view(-1, 1, 1)
        self.tail_at = keep + torch.arange(TAIL, device=keep.device)

    def start_step(self, step: int | Tensor) -> None:
        """``step``: an int, or a (1,) long tensor on the device that a CUDA graph of one Euler step
        reads at each replay (incremental_graphs.py), so that every index by the step is a tensor's.
        A tensor step reads the step's tails once, keeps the new ones until ``end_step``, and indexes
        the pool's rows and steps as one axis, so each read and write is a gather or scatter by one
        index, as the int's (its step a view)."""
        self.block, self.channel = 0, 0
        tails, new_tails = self.inputs.tails, self.new_tails
        if isinstance(step, Tensor):
            self.step, self.step_t = None, step
            steps = self.kv.size(2)
            self._read_at = self.inputs.read_rows * steps + step
            self._write_at = self.inputs.write_rows * steps + step
            self._tails_now = tails.index_select(0, step)[0]
            self._new_tails_now = new_tails.index_select(0, step)[0]
        else:
            self.step, self.step_t = step, self._steps[step : step + 1]
            self._tails_now, self._new_tails_now = tails[step], new_tails[step]

    def end_step(self) -> None:
        """A tensor step's new tails into ``new_tails`` (an int's went there as they came)."""
        if self.step is None and not torch.compiler.is_dynamo_compiling():
            self.new_tails.index_copy_(0, self.step_t, self._new_tails_now.unsqueeze(0))

    def first_row(self, block: int) -> Tensor:
        """(1,) long: ``block``'s first row where the pool's block and row axes are taken as one, as
        the compiled writes and reads index it (writes.put_rows)."""
        return self._offsets[block : block + 1]

    def _at_step(self) -> int | Tensor:
        """The step to index the caches' step axis with: the int, or (compiled, or given as a tensor)
        its (1,) tensor, which keeps that axis (a 0-d tensor index would be read back as an int)."""
        return self.step_t if self.step is None or torch.compiler.is_dynamo_compiling() else self.step

    def conv_input(self, x: Tensor) -> Tensor:
        """x (ROWS*B, C, W) -> (ROWS*B, C, TAIL + W) with the stream's earlier inputs in front; keeps
        the inputs before frame `keep` as the new tails."""
        c = x.size(1)
        lo, hi = self.channel, self.channel + c
        compiling = torch.compiler.is_dynamo_compiling()
        tails = self.inputs.tails[self.step_t, :, lo:hi][0] if compiling else self._tails_now[:, lo:hi]
        full = torch.cat([tails.to(x.dtype), x], dim=2)
        kept = full.gather(2, self.tail_at.expand(-1, c, -1))
        if compiling:
            put_tails(self.new_tails, self.step_t, lo, hi, kept)
        else:
            self._new_tails_now[:, lo:hi] = kept
        self.channel = hi
        return full

    def past_and_new(self, new: Tensor) -> Tensor:
        """What the pool keeps of the new frames (ROWS*B, W, *frame) -> the same of each stream's
        committed pages, then of its Wp = ceil(W / page) new pages, whose first W frames are the new
        ones (the rest are masked): (ROWS*B, (Pp + Wp) * page, *frame), in ``new``'s dtype. Writes
        the new frames' pages first (uncommitted ones go to the trash page), then reads all of them
        with one gather into the layout attention reads, and puts the new frames over the new pages'
        slots: one pass over the past instead of a gather and a concatenation."""
        layer, step = self.block, self._at_step()
        self.block += 1
        store = self.kv[layer]  # (pool rows, steps, page, *frame)
        rb, width = new.shape[:2]
        page = store.size(2)
        n_pages = -(-width // page)
        frame_dims = new.dim() - 2
        pad = (0, 0) * frame_dims + (0, n_pages * page - width)
        paged = new if width == n_pages * page else F.pad(new, pad)
        pages = paged.reshape(rb * n_pages, page, *new.shape[2:]).to(store.dtype)
        if torch.compiler.is_dynamo_compiling():
            put_rows(self.kv, self.first_row(layer) + self.inputs.write_rows, step, pages)
            both = self.kv[layer][self.inputs.read_rows, step]  # read after the write
        else:
            if self.step is None:  # a tensor step: rows and steps as one axis (start_step)
                at_step, write_at, read_at = store.flatten(0, 1), self._write_at, self._read_at
            else:
                at_step, write_at, read_at = store[:, step], self.inputs.write_rows, self.inputs.read_rows
            into, words = as_words(at_step), as_words(pages)
            if into.dtype != words.dtype:  # only one of them can be seen as words: write elements
                into, words = at_step, pages
            into[write_at] = words
            both = at_step[read_at]  # (ROWS*B*(Pp + Wp), page, *frame)
        both = both.view(rb, -1, *both.shape[2:]).to(new.dtype)
        start = both.size(1) - n_pages * page
        both[:, start : start + width] = new  # the trash page's slots hold other streams' frames
        return both

    def keys_values(self, new: Tensor) -> tuple[Tensor, Tensor]:
        """New keys and values (ROWS*B, W, 2, H, D) -> keys, values (ROWS*B, H, (Pp + Wp) * page, D)
        (``past_and_new``)."""
        both = self.past_and_new(new)
        return both[:, :, 0].transpose(1, 2), both[:, :, 1].transpose(1, 2)


class IncrementalEstimator:
    """One estimator step over new frames only.

    Runs the modules of a ``CausalConditionalDecoder`` in the order and with the operations of its
    forward, except that causal convolutions take their left context from the cache instead of
    zeros, attention also sees the committed keys and values, and each block's three projections
    run as one matrix product (their weights concatenated once, here: build it after the weights
    are loaded and cast). With ``inputs`` the pool keeps each attention's normalised input instead
    of its keys and values: the queries are projected from the new frames, the keys and values from
    past and new frames together.
    """

    def __init__(self, estimator: CausalConditionalDecoder, inputs: bool = False):
        self.est = estimator
        self.inputs = inputs
        self.attend_block = None  # where set, runs each transformer block (compiled_blocks.py)
        blocks = [block for stage in transformer_stages(estimator) for block in stage]
        projections = [
            [block.attn1.to_q.weight, block.attn1.to_k.weight, block.attn1.to_v.weight] for block in blocks
        ]
        if inputs:
            self.q_weights = [q.detach() for q, _, _ in projections]
            self.kv_weights = [torch.cat([k, v]).detach() for _, k, v in projections]
        else:
            self.qkv_weights = [torch.cat(weights).detach() for weights in projections]

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
        return block.finish(self._conv(block.block[0], x * mask, io), mask)

    def _resnet(self, r: CausalResnetBlock1D, x: Tensor, mask: Tensor, t_emb: Tensor, io: _StepIO) -> Tensor:
        h = self._block(r.block1, x, mask, io) + r.mlp(t_emb).unsqueeze(-1)
        return self._block(r.block2, h, mask, io) + r.res_conv(x * mask)

    def _attend(self, blocks: nn.ModuleList, h: Tensor, io: _StepIO) -> Tensor:
        h = h.transpose(1, 2)
        rb, width, _ = h.shape
        for block in blocks:
            attn = block.attn1
            if self.attend_block is not None:  # compiled_blocks.py
                h = self.attend_block(self, block, h, io)
                continue
            if self.inputs:
                q, k, v = self._from_inputs(block.norm1(h), attn.heads, io)
            else:
                qkv = F.linear(block.norm1(h), self.qkv_weights[io.block]).view(rb, width, 3, attn.heads, -1)
                k, v = io.keys_values(qkv[:, :, 1:])
                q = qkv[:, :, 0].transpose(1, 2)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=io.inputs.attn_mask)
            h = block.after_attention(h, attended)
        return h.transpose(1, 2)

    def _from_inputs(self, normed: Tensor, heads: int, io: _StepIO) -> tuple[Tensor, Tensor, Tensor]:
        """Queries of the new frames, keys and values of past and new frames, from the attention's
        normalised input (ROWS*B, W, C). The input is cast first to the dtype the projections compute
        in (autocast's, which is the pool's when serving), as an autocast projection casts it anyway,
        so a frame's keys and values come out as they did when it was new."""
        index = io.block
        weights = self.q_weights[index]
        normed = normed.to(autocast_dtype(normed.device) or weights.dtype)
        rb, width, _ = normed.shape
        q = F.linear(normed, weights).view(rb, width, heads, -1).transpose(1, 2)
        seen = io.past_and_new(normed)  # (ROWS*B, (Pp + Wp) * page, C)
        kv = F.linear(seen, self.kv_weights[index]).view(rb, seen.size(1), 2, heads, -1)
        return q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)


def transformer_stages(estimator: CausalConditionalDecoder) -> list[nn.ModuleList]:
    """The estimator's transformer blocks, stage by stage, in the order one step runs them."""
    return [
        estimator.down_blocks[0][1],
        *(blocks for _, blocks in estimator.mid_blocks),
        estimator.up_blocks[0][1],
    ]


def euler_times(steps: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Each Euler step's time and time step (steps,), as the CFM's loop makes them: the time adds up
    its steps (upstream's solver), which can differ from the grid's own point in the last bit."""
    t_span = cosine_time_grid(steps, device, dtype)
    times, deltas = [], []
    t = t_span[0]
    for step in range(1, len(t_span)):
        dt = t_span[step] - t
        times.append(t)
        deltas.append(dt)
        t = t + dt
    return torch.stack(times), torch.stack(deltas)


class EulerSteps:
    """The CFM's Euler steps with guidance over a call's new frames, one at a time: ``step(k, x)``
    is step ``k``'s x, its tails and pages written. ``k`` is an int, or a (1,) long tensor on the
    device, so that one CUDA graph of a step serves every step (incremental_graphs.py)."""

    def __init__(
        self,
        step_fn: IncrementalEstimator,
        kv: Tensor,
        inputs: CallInputs,
        cfg_rate: float,
        new_tails: Tensor,
        times: tuple[Tensor, Tensor],
    ):
        self.step_fn, self.cfg_rate, self.times = step_fn, cfg_rate, times
        self.io = _StepIO(kv, inputs, new_tails)
        dtype = self.dtype = inputs.spks.dtype
        self.mask = torch.cat([inputs.mask, inputs.mask]).to(dtype)
        self.mu = torch.cat([inputs.mu, torch.zeros_like(inputs.mu)]).to(dtype)
        self.spks = torch.cat([inputs.spks, torch.zeros_like(inputs.spks)])
        self.cond = torch.cat([inputs.cond, torch.zeros_like(inputs.cond)]).to(dtype)

    def step(self, k: int | Tensor, x: Tensor) -> Tensor:
        self.io.start_step(k)
        t, dt = self.times[0][k], self.times[1][k]
        t_in = t.to(self.dtype).expand(ROWS * x.size(0))
        both = torch.cat([x, x]).to(self.dtype)
        velocity = self.step_fn(both, self.mask, self.mu, t_in, self.spks, self.cond, self.io)
        self.io.end_step()
        v_cond, v_uncond = velocity.chunk(2)
        return x + dt * ((1.0 + self.cfg_rate) * v_cond - self.cfg_rate * v_uncond)


def run_cfm(
    step_fn: IncrementalEstimator, kv: Tensor, inputs: CallInputs, cfg_rate: float, tensor_steps: bool = False
) -> tuple[Tensor, Tensor]:
    """The CFM's Euler steps with guidance over the new frames: (x (B, 80, W), new tails).
    tensor_steps: each step given as a tensor, as a graph of one step reads it (on a CPU, where
    no graph runs, this checks that way of indexing)."""
    steps = inputs.tails.size(0)
    new_tails = inputs.tails.clone()
    dev = inputs.x.device
    euler = EulerSteps(step_fn, kv, inputs, cfg_rate, new_tails, euler_times(steps, dev, inputs.mu.dtype))
    x = inputs.x
    for step in range(steps):
        x = euler.step(torch.full((1,), step, dtype=torch.long, device=dev) if tensor_steps else step, x)
    return x, new_tails

"""The CFM over new frames only, against the keys/values and convolution tails kept in a page pool.

``CallInputs`` holds one call's inputs at fixed shapes (rows, new frames, past pages), so the ten
Euler steps can be replayed from one CUDA graph per shape bucket (``IncrementalGraphs``); the eager
path runs the same code. See flow_cache.py for what is kept and why it is exact.
"""

import logging
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyapp.models.flow import cosine_time_grid
from cosyapp.models.flow_estimator import (
    CausalBlock1D,
    CausalConditionalDecoder,
    CausalConv1d,
    CausalResnetBlock1D,
    time_embedding,
)

log = logging.getLogger(__name__)

ROWS = 2  # CFG: the conditional row, then the unconditional one
TAIL = 2  # inputs a kernel-3 causal convolution reads before the current frame


@dataclass
class CallInputs:
    """One call at a bucket's shape: B rows (streams, dummies after the real ones), W new frames,
    Pp past pages of `page` frames each."""

    x: Tensor  # (B, 80, W) the fixed noise at each stream's new frames
    mask: Tensor  # (B, 1, W) 1 at real new frames
    mu: Tensor  # (B, 80, W)
    spks: Tensor  # (B, 80)
    cond: Tensor  # (B, 80, W)
    table: Tensor  # (B, Pp) long: each stream's pages, then the trash page
    attn_mask: Tensor  # (ROWS*B, 1, W, Pp*page + W) bool
    tails: Tensor  # (steps, ROWS*B, channels, TAIL) inputs before each stream's first new frame
    keep: Tensor  # (B,) long: new frames each stream commits
    write_pages: Tensor  # (B * ceil(W / page),) long: the page each new page goes to (trash: none)

    def copy_(self, other: "CallInputs") -> None:
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))

    def empty_like(self) -> "CallInputs":
        return CallInputs(**{f.name: torch.zeros_like(getattr(self, f.name)) for f in fields(self)})


class _StepIO:
    """What one estimator step reads from and writes to the caches, block by block."""

    def __init__(self, k: Tensor, v: Tensor, inputs: CallInputs, new_tails: Tensor):
        self.k, self.v, self.inputs, self.new_tails = k, v, inputs, new_tails
        self.step = self.block = self.channel = 0

    def start_step(self, step: int) -> None:
        self.step, self.block, self.channel = step, 0, 0

    def conv_input(self, x: Tensor) -> Tensor:
        """x (ROWS*B, C, W) -> (ROWS*B, C, TAIL + W) with the stream's earlier inputs in front; keeps
        the inputs before frame `keep` as the new tails."""
        c = x.size(1)
        lo, hi = self.channel, self.channel + c
        full = torch.cat([self.inputs.tails[self.step, :, lo:hi].to(x.dtype), x], dim=2)
        # Inputs at new frames keep - 2 and keep - 1 sit at columns keep and keep + 1 of `full`.
        idx = self.inputs.keep.repeat(ROWS).view(-1, 1, 1) + torch.arange(TAIL, device=x.device)
        self.new_tails[self.step, :, lo:hi] = full.gather(2, idx.expand(-1, c, -1)).to(self.new_tails.dtype)
        self.channel = hi
        return full

    def keys_values(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """New keys/values (ROWS*B, H, W, D) -> the same with each stream's committed ones in front;
        writes the new frames' pages (uncommitted ones go to the trash page)."""
        layer, step = self.block, self.step
        self.block += 1
        rb, heads, width, dim = k.shape
        batch, table = rb // ROWS, self.inputs.table
        page = self.k.size(5)
        n_pages = -(-width // page)
        out = []
        for store, values in ((self.k, k), (self.v, v)):
            paged = F.pad(values, (0, 0, 0, n_pages * page - width)).view(
                ROWS, batch, heads, n_pages, page, dim
            )
            paged = paged.permute(1, 3, 0, 2, 4, 5).reshape(batch * n_pages, ROWS, heads, page, dim)
            past = store[layer][table, step]  # read before the write: (B, Pp, ROWS, H, page, D)
            past = past.permute(2, 0, 3, 1, 4, 5).reshape(rb, heads, -1, dim).to(values.dtype)
            store[layer, self.inputs.write_pages, step] = paged.to(store.dtype)
            out.append(torch.cat([past, values], dim=2))
        return out[0], out[1]


class IncrementalEstimator:
    """One estimator step over new frames only.

    Runs the modules of a ``CausalConditionalDecoder`` in the order and with the operations of its
    forward, except that causal convolutions take their left context from the cache instead of
    zeros and attention also sees the committed keys and values.
    """

    def __init__(self, estimator: CausalConditionalDecoder):
        self.est = estimator

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

    @staticmethod
    def _attend(blocks: nn.ModuleList, h: Tensor, io: _StepIO) -> Tensor:
        h = h.transpose(1, 2)
        for block in blocks:
            q, k, v = block.qkv(h)
            k, v = io.keys_values(k, v)
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=io.inputs.attn_mask)
            h = block.after_attention(h, attended)
        return h.transpose(1, 2)


def run_cfm(
    estimator: CausalConditionalDecoder, k: Tensor, v: Tensor, inputs: CallInputs, cfg_rate: float
) -> tuple[Tensor, Tensor]:
    """The CFM's Euler steps with guidance over the new frames: (x (B, 80, W), new tails)."""
    steps = inputs.tails.size(0)
    new_tails = inputs.tails.clone()
    io = _StepIO(k, v, inputs, new_tails)
    step_fn = IncrementalEstimator(estimator)
    dtype = inputs.spks.dtype
    x = inputs.x
    t_span = cosine_time_grid(steps, x.device, inputs.mu.dtype)
    mask_in = torch.cat([inputs.mask, inputs.mask]).to(dtype)
    mu_in = torch.cat([inputs.mu, torch.zeros_like(inputs.mu)]).to(dtype)
    spks_in = torch.cat([inputs.spks, torch.zeros_like(inputs.spks)])
    cond_in = torch.cat([inputs.cond, torch.zeros_like(inputs.cond)]).to(dtype)
    t = t_span[0]
    for step in range(1, len(t_span)):
        io.start_step(step - 1)
        dt = t_span[step] - t
        t_in = t.to(dtype).expand(ROWS * x.size(0))
        velocity = step_fn(torch.cat([x, x]).to(dtype), mask_in, mu_in, t_in, spks_in, cond_in, io)
        v_cond, v_uncond = velocity.chunk(2)
        x = x + dt * ((1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond)
        t = t + dt
    return x, new_tails


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: CallInputs
    x: Tensor
    tails: Tensor


class IncrementalGraphs:
    """``run_cfm`` replayed from one CUDA graph per (rows, new frames, past pages) bucket.

    Eager, a call is launch-bound at every batch size (docs/benchmarks/README.md); replayed, the
    kernels run back to back. The Pipeline's warm-up meets the common buckets
    (Pipeline.warm_up_token2wav). A capture runs the call eagerly three times, so with ``defer`` a
    bucket's first call runs eagerly once and keeps a copy of its inputs; the worker captures it when
    it has nothing queued (``capture_missed``), and a call that comes before that runs eagerly too.
    Without ``defer`` the first call captures and then replays, holding the worker meanwhile.
    """

    def __init__(
        self, estimator: CausalConditionalDecoder, k: Tensor, v: Tensor, cfg_rate: float, defer: bool = True
    ):
        self.estimator, self.k, self.v, self.cfg_rate = estimator, k, v, cfg_rate
        self.defer = defer
        self._graphs: dict[tuple, _Graph] = {}
        self._missed: dict[tuple, CallInputs] = {}  # buckets met but not captured: a call's inputs
        self._eager: set[tuple] = set()  # buckets whose capture failed
        self._pool = None

    @property
    def missed(self) -> int:
        """Buckets waiting for ``capture_missed``."""
        return len(self._missed)

    def run(self, inputs: CallInputs) -> tuple[Tensor, Tensor]:
        if not inputs.x.is_cuda:
            return run_cfm(self.estimator, self.k, self.v, inputs, self.cfg_rate)
        key = (*inputs.attn_mask.shape, inputs.x.dtype, inputs.tails.dtype, _autocast_dtype(inputs.x.device))
        graph = self._graphs.get(key)
        if graph is None and (self.defer or key in self._eager):
            if key not in self._missed and key not in self._eager:
                kept = inputs.empty_like()
                kept.copy_(inputs)
                self._missed[key] = kept
            return run_cfm(self.estimator, self.k, self.v, inputs, self.cfg_rate)
        graph = graph or self._capture(key, inputs)
        graph.inputs.copy_(inputs)
        graph.graph.replay()
        return graph.x.clone(), graph.tails.clone()

    def capture_missed(self) -> bool:
        """Capture one bucket a call met since (under the autocast it ran with); False when none was
        waiting. Call it from the thread that runs the calls, on its CUDA stream."""
        if not self._missed:
            return False
        key = next(iter(self._missed))
        like = self._missed.pop(key)
        dtype = key[-1]
        try:
            with torch.autocast("cuda", dtype=dtype or torch.float16, enabled=dtype is not None):
                self._capture(key, like)
        except Exception:  # out of memory, or any other failure: its calls stay eager, the worker serves on
            log.exception("capturing the incremental flow's graph for %s failed; it runs eagerly", key[:4])
            self._graphs.pop(key, None)
            self._eager.add(key)
        return True

    def _capture(self, key: tuple, like: CallInputs) -> _Graph:
        static = like.empty_like()
        static.copy_(like)
        dev = like.x.device
        # Warm-up and capture write to the trash page only, so the pool's real pages stay as they are.
        static.write_pages.zero_()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # lets lazy kernels and workspaces settle outside the capture
                run_cfm(self.estimator, self.k, self.v, static, self.cfg_rate)
        torch.cuda.current_stream(dev).wait_stream(side)
        self._pool = self._pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            x, tails = run_cfm(self.estimator, self.k, self.v, static, self.cfg_rate)
        captured = _Graph(graph, static, x, tails)
        self._graphs[key] = captured
        return captured


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None

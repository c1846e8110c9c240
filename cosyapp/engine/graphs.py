"""Replay the flow estimator from CUDA graphs, one per (batch, frames) bucket.

At the batch sizes a serving engine sees, one eager estimator step is launch-bound (on an H200 ~25 ms
eager against ~6 ms replayed, docs/benchmarks/2026-12-02-h200-flow-steps.json), and the CFM takes ten
steps per flow call. Inputs are padded up to a bucket: extra frames get mask 0 (the estimator is causal
and masks padded keys, so valid frames are unchanged) and extra batch rows are independent dummies.
"""

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor, nn

BATCH_BUCKETS = (2, 4, 8, 16, 32, 64, 128, 256)  # estimator rows: CFG doubles the items


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    inputs: tuple[Tensor, ...]  # x, mask, mu, t, spks, cond at the bucket's shape
    output: Tensor


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= value (values past the last bucket are their own bucket)."""
    return next((b for b in buckets if b >= value), value)


class GraphedEstimator(nn.Module):
    """Drop-in for ``CausalConditionalDecoder.forward`` that pads to buckets and replays CUDA graphs.

    ``frame_step``: frames are padded up to a multiple of it. ``max_graphs``: captured graphs kept
    (least recently used dropped). ``use_graphs`` False pads and runs eagerly (CPU, or to check the
    padding). Graph capture and replay must happen on one thread (the token2wav worker).
    """

    def __init__(
        self, estimator: nn.Module, frame_step: int = 64, max_graphs: int = 96, use_graphs: bool = True
    ):
        super().__init__()
        self.estimator = estimator
        self.frame_step = frame_step
        self.max_graphs = max_graphs
        self.use_graphs = use_graphs
        self._graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self._pool = None

    @property
    def out_channels(self) -> int:
        return self.estimator.out_channels

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
    ) -> Tensor:
        rows, _, frames = x.shape
        shape = (bucket(rows, BATCH_BUCKETS), -(-frames // self.frame_step) * self.frame_step)
        autocast = torch.is_autocast_enabled(x.device.type)
        key = (*shape, streaming, x.dtype, autocast and torch.get_autocast_dtype(x.device.type), x.device)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(key, (x, mask, mu, t, spks, cond), streaming)
        self._graphs.move_to_end(key)
        self._fill(captured.inputs, (x, mask, mu, t, spks, cond))
        if captured.graph is None:
            return self.estimator(*captured.inputs, streaming)[:rows, :, :frames]
        captured.graph.replay()
        return captured.output[:rows, :, :frames].clone()

    @staticmethod
    def _fill(static: tuple[Tensor, ...], given: tuple[Tensor, ...]) -> None:
        """Copy the call's tensors into the bucket's inputs; padded frames get mask 0, dummy rows mask 1."""
        x, mask, mu, t, spks, cond = given
        rows, _, frames = x.shape
        sx, smask, smu, st, sspks, scond = static
        for dst, src in ((sx, x), (smu, mu), (scond, cond)):
            dst[:rows, :, :frames].copy_(src)
            dst[:rows, :, frames:].zero_()
        smask[:rows].zero_()
        smask[:rows, :, :frames].copy_(mask)
        st[:rows].copy_(t)
        sspks[:rows].copy_(spks)

    def _capture(self, key: tuple, like: tuple[Tensor, ...], streaming: bool) -> _Captured:
        rows, frames = key[0], key[1]
        x, mask, mu, t, spks, cond = like

        def blank(src: Tensor, *shape: int) -> Tensor:
            return torch.zeros(shape, dtype=src.dtype, device=src.device)

        inputs = (
            blank(x, rows, x.size(1), frames),
            torch.ones((rows, 1, frames), dtype=mask.dtype, device=mask.device),  # dummy rows: all valid
            blank(mu, rows, mu.size(1), frames),
            blank(t, rows),
            blank(spks, rows, spks.size(1)),
            blank(cond, rows, cond.size(1), frames),
        )
        if not (self.use_graphs and x.is_cuda):
            captured = _Captured(None, inputs, inputs[0])
        else:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lets lazy kernels and workspaces settle outside the capture
                    self.estimator(*inputs, streaming)
            torch.cuda.current_stream(x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                output = self.estimator(*inputs, streaming)
            captured = _Captured(graph, inputs, output)
        self._graphs[key] = captured
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return captured

"""The RAS draw of one decode step replayed from a CUDA graph per batch bucket (``--lm-sampler-graphs``).

``ras_choice`` (the exact RAS distribution, the draw, the one-hot row; docs/model.md §4.6, §5.3) is
some forty small operations. vLLM's decode step is bound by its process's host work, and at one
request these launches were a third of it (py-spy, docs/benchmarks/README.md); replayed, they are
one launch plus the copies in and out. The rows are padded up to a bucket: every row of the draw is
computed from its own logits and packed data alone, so padding rows, whatever they hold, change
nothing in the real ones. A bucket is captured the first time it is met (the engine's warm-up meets
each power of two up to ``max_num_seqs``); a bucket whose capture fails runs eagerly from then on.
On by default on a GPU: on an H100, vLLM's decode alone went from 223 to 403 tokens/s at one request
and from 12,800 to 26,700 at 256 (docs/benchmarks/README.md). ``capture=False`` pads and copies
exactly as a replay does but runs the padded call eagerly, on any device (tests).
"""

import logging
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from cosyapp.engine.token2wav.graphs import bucket
from cosyapp.engine.token2wav.turns import capture_graph
from cosyapp.models.sampling import SamplingParams, draw_tokens, ras_distribution

log = logging.getLogger(__name__)

ENV = "COSYAPP_LM_SAMPLER_GRAPHS"  # how the option reaches the processor in vLLM's engine process
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def ras_choice(logits: Tensor, packed: Tensor, params: SamplingParams) -> Tensor:
    """(rows, vocab) logits and (rows, win_size + 2) packed data (window, EOS allowed, uniform bits)
    -> (rows, vocab) with each row's drawn token at 0 and every other id at -inf."""
    recent, eos_allowed, bits = packed[:, :-2], packed[:, -2].bool(), packed[:, -1]
    drawn = draw_tokens(ras_distribution(logits, recent, eos_allowed, params), bits)
    return torch.full_like(logits, float("-inf")).scatter_(1, drawn.unsqueeze(1), 0.0)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: padded and run eagerly (``capture=False``)
    logits: Tensor
    packed: Tensor
    out: Tensor


class RasGraphs:
    """``ras_choice`` through one static graph per (bucket, vocab, dtype, params)."""

    def __init__(self, capture: bool = True):
        self.capture = capture
        self._graphs: dict[tuple, _Graph] = {}
        self._eager: set[tuple] = set()  # buckets whose capture failed
        self._pool = None
        self.replays = 0

    @staticmethod
    def wanted() -> bool:
        """Whether the server asked for graphs (ServeOptions.lm_sampler_graphs, through ``ENV``)."""
        return os.environ.get(ENV) == "1"

    def __call__(self, logits: Tensor, packed: Tensor, params: SamplingParams) -> Tensor:
        rows = logits.size(0)
        size = bucket(rows, BUCKETS)
        key = (size, logits.size(1), logits.dtype, params)
        if size is None or key in self._eager or not (logits.is_cuda or not self.capture):
            return ras_choice(logits, packed, params)
        graph = self._graphs.get(key) or self._build(key, logits, packed)
        if graph is None:
            return ras_choice(logits, packed, params)
        graph.logits[:rows].copy_(logits)
        graph.packed[:rows].copy_(packed)
        if graph.graph is not None:
            graph.graph.replay()
        else:
            graph.out.copy_(ras_choice(graph.logits, graph.packed, params))
        self.replays += 1
        return graph.out[:rows].clone()

    def _build(self, key: tuple, logits: Tensor, packed: Tensor) -> _Graph | None:
        size, vocab, dtype, params = key
        dev = logits.device
        static_logits = torch.zeros(size, vocab, dtype=dtype, device=dev)
        static_packed = torch.zeros(size, packed.size(1), dtype=packed.dtype, device=dev)
        static_packed[:, :-2] = -1  # padding rows: an empty window, EOS masked, u = 0
        if not self.capture:
            graph = _Graph(None, static_logits, static_packed, torch.empty_like(static_logits))
            self._graphs[key] = graph
            return graph
        try:
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            cuda_graph, out = capture_graph(
                lambda: ras_choice(static_logits, static_packed, params), dev, self._pool
            )
        except Exception:  # out of memory, an uncapturable kernel: this bucket runs eagerly
            log.exception("capturing the RAS draw's graph for %s rows failed; it runs eagerly", size)
            self._eager.add(key)
            return None
        graph = _Graph(cuda_graph, static_logits, static_packed, out)
        self._graphs[key] = graph
        return graph

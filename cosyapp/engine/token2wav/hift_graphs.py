"""HiFT calls replayed from CUDA graphs, one per (batch bucket, mel frames, cached source samples).

A streaming HiFT call vocodes about a second per stream with several hundred kernels (counted from
the model's code, not profiled), launched from the HiFT thread, which shares the interpreter lock with
the flow thread and the event loop; replayed, the launches are one. Whether that pays is for the GPU
to measure (``--variant hiftg:hift_graphs=true``), which is why it is off by default.

What makes a call replayable (models/hift.py): its random draws are made ahead, per stream from the
stream's generator exactly as the call would make them (``draw_noise``), and copied into the graph's
inputs; its iSTFT has no host sync. The batch is padded up to a bucket: HiFT's rows are independent
(convolutions, STFTs and iSTFTs per item), so the padding rows, whatever they hold, change nothing in
the real ones. The length is never padded: HiFT looks both ways, so padding would change the end of
the audio; each length gets its own graph, up to ``max_cells`` rows x frames. A shape is captured the
second time it is met (three runs and the capture, well under a second; a capture also synchronises
the device): the first chunk's and the hops' shapes recur with every stream, while a last chunk's
length is mostly its own. At most ``max_graphs`` shapes are held; calls of other shapes run eagerly,
as do all calls off CUDA.

With ``defer`` (as the worker runs it) that call does not capture: it keeps a copy of its inputs and
runs eagerly, and the worker's capture thread captures the shape (``capture_missed``,
capturing.py), the calls meanwhile eager. A capture synchronises the device as it begins, so on the
HiFT thread under load it held that call for the GPU's whole queue: on an H100 at 64 streams the
HiFT thread's longest CUDA calls were a capture's (a 346 ms allocation, a 122 ms device sync) in a
level whose first chunks' HiFT took 646 ms to launch (docs/benchmarks/README.md, tenth round).
"""

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from cosyapp.engine.token2wav.capturing import MissedCalls
from cosyapp.engine.token2wav.compiling import noting_eager_kinds
from cosyapp.engine.token2wav.graph_table import Captured, GraphTable
from cosyapp.engine.token2wav.graphs import bucket
from cosyapp.engine.token2wav.turns import capture_graph
from cosyapp.models.hift import HiFTGenerator, SourceNoise

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_GRAPHS = 48  # shapes held; streaming at one speed meets a handful (first chunk, hops, last chunks)
CAPTURE_AT = 2  # the call of a shape that captures it
# Rows x mel frames of the largest graph: 64 chunks of the longest hop (4 s, 200 frames) fit, and a
# graph's static output stays under ~60 MB. Larger calls (whole clips) are bound by the GPU, not by
# their launches, and run eagerly.
MAX_CELLS = 16384


@dataclass
class _Graph(Captured):
    graph: torch.cuda.CUDAGraph | None  # None: padded and run eagerly (``capture=False``)
    mel: Tensor  # (bucket, 80, frames)
    cache: Tensor | None  # (bucket, 1, cached samples)
    noise: SourceNoise  # at the bucket's batch
    speech: Tensor
    source: Tensor


class HiFTRunner:
    """HiFT as the worker calls it: ``(mel, cache_source, generators) -> (speech, source)``, eagerly,
    or with ``graphs`` on CUDA replayed from a graph per shape (module docstring). Its calls come from
    one thread (the worker's HiFT stage). ``capture`` False pads and copies exactly as a replay does
    but runs the padded call eagerly, on any device (tests, and a check of the padding)."""

    def __init__(
        self,
        hift: HiFTGenerator,
        graphs: bool,
        max_graphs: int = MAX_GRAPHS,
        max_cells: int = MAX_CELLS,
        capture: bool = True,
        defer: bool = False,
    ):
        self.hift = hift
        self.graphs = graphs
        self.max_cells = max_cells
        self.capture = capture
        self.defer = defer
        self.max_graphs = max_graphs
        self._graphs: GraphTable[_Graph] = GraphTable()
        self._met: Counter[tuple] = Counter()  # calls per shape not captured yet
        # Shapes due to be captured by the capture thread (defer), and those whose capture failed.
        self._missed: MissedCalls[tuple[Tensor, Tensor | None]] = MissedCalls()
        self._pool = None
        self.captures = 0
        self.capture_seconds = 0.0
        self.replays = 0

    def __call__(
        self, mel: Tensor, cache: Tensor | None, generators: Sequence[torch.Generator]
    ) -> tuple[Tensor, Tensor]:
        key = self._key(mel, cache)
        graph = None if key is None else self._graphs.lookup(key)
        due = key is not None and key not in self._missed.failed and self._due(key, graph)
        if due and self.defer:  # a stale graph serves until the capture thread has captured anew
            self._miss(key, mel, cache)
        elif due and self._capture(key, mel, cache):  # then found by a lookup (GraphTable)
            graph = self._graphs.lookup(key)
        if graph is None:
            return self.hift(mel, cache, generators=generators)
        batch = mel.size(0)
        noise = self.hift.draw_noise(mel, generators)
        graph.mel[:batch].copy_(mel)
        if graph.cache is not None:
            graph.cache[:batch].copy_(cache)
        for name in ("phases", "sines", "spare"):
            getattr(graph.noise, name)[:batch].copy_(getattr(noise, name))
        if graph.graph is not None:
            graph.replay()
        else:
            speech, source = self.hift(graph.mel, graph.cache, noise=graph.noise)
            graph.speech.copy_(speech)
            graph.source.copy_(source)
        self.replays += 1
        return graph.speech[:batch].clone(), graph.source[:batch].clone()

    def _due(self, key: tuple, graph: _Graph | None) -> bool:
        """Whether this call captures ``key``: its graph was captured before a compile, or it has
        none and this is its CAPTURE_AT-th call (while fewer than max_graphs are held)."""
        if graph is not None:
            return graph.stale
        if len(self._graphs) + len(self._missed) >= self.max_graphs:
            return False
        self._met[key] += 1
        if self._met[key] < CAPTURE_AT:
            return False
        del self._met[key]
        return True

    @property
    def missed(self) -> int:
        """Shapes waiting for ``capture_missed`` (the one being captured included)."""
        return len(self._missed)

    def _miss(self, key: tuple, mel: Tensor, cache: Tensor | None) -> None:
        """Keep a copy of the call's inputs for the capture thread, unless ``key`` has one waiting."""

        def copy() -> tuple[Tensor, Tensor | None]:
            return mel.clone(), None if cache is None else cache.clone()

        if self._missed.keep(key, copy, mel.device):
            log.info("HiFT shape %s to capture: its calls run eagerly meanwhile", key[:4])

    def capture_missed(self) -> bool:
        """Capture one shape a call missed (``defer``); False when none waits. The worker's capture
        thread calls it, on a CUDA stream of its own; the shape counts as missed until it ends."""
        with self._missed.oldest() as missed:
            if missed is None:
                return False
            key, (mel, cache) = missed
            self._capture(key, mel, cache)  # a failure leaves the shape eager (it logs why)
        return True

    def _key(self, mel: Tensor, cache: Tensor | None) -> tuple | None:
        """The graph a call replays: None for calls that run eagerly (off CUDA, or too many rows)."""
        if not (self.graphs and (mel.is_cuda or not self.capture)):
            return None
        rows = bucket(mel.size(0), BATCH_BUCKETS)
        if rows is None or rows * mel.size(2) > self.max_cells:
            return None
        cached = 0 if cache is None or cache.size(2) == 0 else cache.size(2)
        return rows, mel.size(1), mel.size(2), cached, mel.dtype

    def _capture(self, key: tuple, mel: Tensor, cache: Tensor | None) -> bool:
        """Capture ``key``'s graph, in place of any it has; False where that failed (it runs eagerly)."""
        rows, channels, frames, cached, dtype = key
        dev = mel.device
        started = time.perf_counter()
        try:
            static_mel = torch.zeros(rows, channels, frames, device=dev, dtype=dtype)
            static_mel[: mel.size(0)].copy_(mel)  # warm-up on real values
            static_cache = None
            if cached:
                static_cache = torch.zeros(rows, 1, cached, device=dev, dtype=dtype)
                static_cache[: mel.size(0)].copy_(cache)
            # The warm-up's draws come from a generator of its own: the streams' stay untouched.
            own = torch.Generator(dev).manual_seed(0)
            noise = self.hift.draw_noise(static_mel, [own] * rows)
            with noting_eager_kinds() as eager:  # a compile ending during the capture makes it stale
                if not self.capture:
                    speech, source = self.hift(static_mel, static_cache, noise=noise)
                    graph = None
                else:
                    # cuDNN and cuFFT pick and cache their plans in the runs before the capture
                    self._pool = self._pool or torch.cuda.graph_pool_handle()
                    graph, (speech, source) = capture_graph(
                        lambda: self.hift(static_mel, static_cache, noise=noise), dev, self._pool
                    )
                    torch.cuda.current_stream(dev).synchronize()
        except Exception:  # out of memory, an uncapturable kernel: this shape runs eagerly
            log.exception("capturing HiFT's graph for %s failed; it runs eagerly", key[:4])
            self._missed.fail(key)
            return False
        finally:
            self.capture_seconds += time.perf_counter() - started
        captured = _Graph(graph, static_mel, static_cache, noise, speech, source, eager=frozenset(eager))
        self._graphs.put(key, captured)  # after a compile: in place of the old (compiling.py)
        if graph is not None:
            self.captures += 1
            log.info("HiFT shape %s captured in %.2f s", key[:4], time.perf_counter() - started)
        return True

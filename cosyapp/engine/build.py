"""Assemble the one Pipeline of a process from a loaded model and its ServeOptions."""

import contextlib
import importlib.util
import logging
from collections.abc import Iterator

import torch

from cosyapp.engine.budget import AudioBudget
from cosyapp.engine.lm.base import SpeechTokenLM
from cosyapp.engine.pipeline import Pipeline
from cosyapp.engine.token2wav.worker import Token2Wav
from cosyapp.frontend.text import TextFrontend
from cosyapp.models.checkpoint import BACKBONE_DIR
from cosyapp.models.cosyvoice2 import CosyVoice2
from cosyapp.models.flow import CausalMaskedDiffWithXvec
from cosyapp.options import ENGINES, ServeOptions

log = logging.getLogger(__name__)


def choose_engine(requested: str, device: torch.device) -> str:
    """The LM engine to use: ``requested`` unless "auto"; raises ValueError for an unknown name."""
    if requested not in ENGINES:
        raise ValueError(f"unknown engine {requested!r}; choose one of {', '.join(ENGINES)}")
    if requested != "auto":
        return requested
    has_vllm = importlib.util.find_spec("vllm") is not None
    return "vllm" if has_vllm and device.type == "cuda" else "torch"


def build_lm_engine(model: CosyVoice2, options: ServeOptions) -> SpeechTokenLM:
    """The speech-token LM engine over ``model.lm`` (vLLM gets an exported copy of its weights)."""
    name = choose_engine(options.engine, model.device)
    log.info("speech-token LM engine: %s", name)
    if name == "torch":
        from cosyapp.engine.lm.torch_engine import TorchSpeechLM

        return TorchSpeechLM(model.lm, max_batch=options.max_batch)
    from cosyapp.engine.lm.vllm_engine import VllmSpeechLM, export_for_vllm

    on_gpu = model.device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    folder = export_for_vllm(model.lm, model.model_dir, options.cache_dir / "vllm", dtype=dtype)
    if on_gpu:
        # vLLM serves from its exported copy. The PyTorch LM is left only the prompt's embeddings
        # (row lookups, the same values on the host) and the bench's baselines (lm_beside): its 2 GB
        # go back to the GPU for the flow cache, and no request thread waits on the GPU for them.
        model.lm.to("cpu")
        torch.cuda.empty_cache()
    return VllmSpeechLM(
        folder,
        model.lm.sampling,
        dtype=dtype,
        gpu_memory_utilization=options.gpu_memory_utilization,
        # Every admitted stream decodes in the same step: vLLM's throughput keeps growing well past
        # the token2wav batch (18.6k tokens/s at 256 sequences on an H200 against 11.5k at 64).
        max_num_seqs=options.max_streams,
        enforce_eager=not on_gpu,  # compiling and CUDA graphs pay off only on a GPU
        kv_cache_memory_bytes=options.kv_cache_memory_bytes if not on_gpu else None,
        in_process=options.lm_in_process,
        stream_interval=options.lm_stream_interval,
        sampler_graphs=options.lm_sampler_graphs and on_gpu,
    )


@contextlib.contextmanager
def lm_beside(model: CosyVoice2) -> Iterator[None]:
    """The PyTorch LM on the model's device for the block, wherever it waited (build_lm_engine moves it
    to the host while vLLM serves); for what runs the PyTorch LM itself (the bench's baselines)."""
    home = model.lm.llm_embedding.weight.device
    model.lm.to(model.device)
    try:
        yield
    finally:
        model.lm.to(home)
        if model.device.type == "cuda":
            torch.cuda.empty_cache()


def build_pipeline(model: CosyVoice2, options: ServeOptions) -> Pipeline:
    """The Pipeline of this process: text frontend, LM engine, token2wav worker, admission limits."""
    if model.device.type == "cuda":
        # Launch-bound there; serving never reloads weights (see HiFTGenerator.fuse_weight_norm).
        model.hift.fuse_weight_norm()
    if compiles_hift(model.device, options):
        from cosyapp.engine.token2wav.fused import fuse_hift

        # On the compile thread, HiFT running eagerly meanwhile; its graphs (--hift-graphs) are
        # captured again once it is compiled (engine/token2wav/compiling.py).
        fuse_hift(model.hift, options.cache_dir / "inductor", background=True)
    prepare_flow(model.flow, model.device, options)
    return Pipeline(
        model,
        TextFrontend(model.model_dir / BACKBONE_DIR, max_chars=options.max_text_chars),
        build_lm_engine(model, options),
        build_token2wav(model, options),
        max_streams=options.max_streams,
        max_waiting=options.max_waiting,
        budget=AudioBudget(options.slowest_speech_rate, options.max_request_audio_s),
        text_lanes=options.text_lanes,
    )


def prepare_flow(flow: CausalMaskedDiffWithXvec, device: torch.device, options: ServeOptions) -> None:
    """``flow`` made ready to serve on ``device``, in place: its matrix weights stored in the autocast
    dtype, compiled with ``compile_flow``, its estimator replayed from CUDA graphs on a GPU (captured
    later, by the token2wav worker's start). scripts/flow_precompile.py runs it too, and the benchmark
    again on a flow that served eagerly, to compile it (its compile_flow variant)."""
    flow_dtype = flow_autocast_dtype(device, options)
    if flow_dtype is not None and device.type == "cuda" and flow.matmul_dtype is None:
        from cosyapp.engine.token2wav.precision import cast_matmul_weights

        # Before graphs are captured and before the incremental flow concatenates its projections.
        cast_matmul_weights(flow, flow_dtype)
    if compiles_flow(device, options):
        from cosyapp.engine.token2wav.flow_cache import raw_estimator
        from cosyapp.engine.token2wav.fused import fuse_estimator, is_compiled

        estimator = raw_estimator(flow)
        if not is_compiled(estimator):
            # A flow that served eagerly first (the benchmark's compile_flow variant): its graphs
            # replay eager kernels and never learn of the compiles; new ones are made below.
            flow.decoder.estimator = estimator
            # Compiled on a thread of its own while the flow serves eagerly; its CUDA graphs are
            # captured again once the compiles are done (engine/token2wav/compiling.py).
            fuse_estimator(estimator, options.cache_dir / "inductor", background=True)
    if options.cuda_graphs and device.type == "cuda":
        from cosyapp.engine.token2wav.graphs import GraphedEstimator

        decoder = flow.decoder
        if not isinstance(decoder.estimator, GraphedEstimator):
            decoder.estimator = GraphedEstimator(decoder.estimator)


def compiles_flow(device: torch.device, options: ServeOptions) -> bool:
    """Whether the flow estimator is compiled (``--compile-flow``): as chosen, or where nothing was
    chosen (None, the default) on a GPU only, where the engine measured 1.2x the whole-clip audio."""
    return device.type == "cuda" if options.compile_flow is None else options.compile_flow


def compiles_hift(device: torch.device, options: ServeOptions) -> bool:
    """Whether HiFT's Snakes run compiled (``--compile-hift``): as chosen, or where nothing was chosen
    (None, the default) on a GPU only, where it measured 1.2-1.5x from batch 16 on."""
    return device.type == "cuda" if options.compile_hift is None else options.compile_hift


def flow_autocast_dtype(device: torch.device, options: ServeOptions) -> torch.dtype | None:
    """The dtype the flow runs in under autocast, or None for none (its own float32)."""
    if options.flow_dtype:
        return None if options.flow_dtype == "float32" else getattr(torch, options.flow_dtype)
    # upstream's fp16 mode runs the flow under fp16 autocast too
    return torch.float16 if device.type == "cuda" else None


def build_token2wav(model: CosyVoice2, options: ServeOptions) -> Token2Wav:
    """The token2wav worker over ``model`` (prepared by build_pipeline), not started."""
    flow_dtype, stored = flow_autocast_dtype(model.device, options), model.flow.matmul_dtype
    if stored is not None and stored != flow_dtype:
        raise ValueError(
            f"the flow's matrix weights are stored in {stored} (build_pipeline); a token2wav worker in "
            f"{options.flow_dtype or 'float32'} needs a model loaded again"
        )
    return Token2Wav(model, **token2wav_settings(model.device, options))


def token2wav_settings(device: torch.device, options: ServeOptions) -> dict:
    """The token2wav worker's arguments for ``options`` on ``device``: what only a GPU gains from
    (graphs, threads and CUDA streams of its own, the LM's holds) is off elsewhere."""
    on_gpu = device.type == "cuda"
    return dict(
        max_batch=options.max_batch,
        first_hop=options.first_hop,
        autocast_dtype=flow_autocast_dtype(device, options),
        flow_cache_bytes=None if options.flow_cache_gb is None else int(options.flow_cache_gb * 2**30),
        flow_cache_graphs=options.cuda_graphs and on_gpu,
        flow_step_graphs=options.flow_step_graphs,
        chunked_final=options.chunked_final,
        flow_cache_inputs=options.flow_cache_inputs,
        gather_ms=options.gather_ms,
        expect_ms=options.expect_ms,
        fill_ms=options.fill_ms,
        step_frames=options.max_batch * options.step_frames_per_row,
        whole_step_frames=options.max_batch * options.whole_step_frames_per_row,
        late_step_frames=options.max_batch * options.late_step_frames_per_row or None,
        max_batch_per_call=options.max_batch_per_call,
        overlap_hift=options.overlap_hift and on_gpu,  # on a CPU both stages share the same cores
        flow_overlap=options.flow_overlap and on_gpu,
        stream_priority=options.token2wav_priority,
        hift_first=options.hift_first and on_gpu and options.overlap_hift,  # its own stream only then
        hift_graphs=options.hift_graphs and on_gpu,
        lm_yield_ms=options.lm_yield_ms if on_gpu else 0.0,  # the LM and the flow take turns on a GPU only
    )

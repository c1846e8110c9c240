"""Benchmark the Pipeline in-process: latency and throughput against the number of concurrent streams.

    python -m cosyapp.bench --smoke                       # tiny model on CPU, a few seconds
    python -m cosyapp.bench --full-size --engine vllm     # CosyVoice2-0.5B sizes, random weights (GPU)

Load is reproducible: random weights whose stop tokens are unreachable, so every request decodes
exactly ``--tokens`` speech tokens (``--tokens / 25`` seconds of audio), a fixed prompt voice and
fixed seeds. Prints a table and writes JSON.
"""

import argparse
import asyncio
import json
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from cosyapp.engine.build import EngineOptions, build_pipeline
from cosyapp.engine.metrics import percentile
from cosyapp.engine.pipeline import Pipeline, SynthesisRequest
from cosyapp.frontend.features import VoiceFeatures
from cosyapp.models.checkpoint import load_model, pick_device
from cosyapp.models.tiny import write_full_size_model, write_random_model
from cosyapp.voices import Voice, VoiceInfo

TOKENS_PER_TEXT_TOKEN = 20  # the LM's max ratio: an endless model decodes exactly this many
PROMPT_TOKENS = 75  # a 3 s prompt voice


def bench_voice(seed: int = 0) -> Voice:
    """A fixed prompt voice of 3 s (random features: speed does not depend on their values)."""
    g = torch.Generator().manual_seed(seed)
    features = VoiceFeatures(
        speech_tokens=torch.randint(0, 6561, (PROMPT_TOKENS,), generator=g),
        speech_feat=torch.randn(2 * PROMPT_TOKENS, 80, generator=g) - 5.0,
        embedding=torch.randn(192, generator=g),
    )
    return Voice(
        VoiceInfo("bench", "bench", "builtin"), features, prompt_text="A fixed prompt for the benchmark."
    )


def text_for_tokens(pipeline: Pipeline, tokens: int) -> str:
    """A one-sentence text that makes the endless model decode exactly ``tokens`` speech tokens."""
    assert tokens % TOKENS_PER_TEXT_TOKEN == 0, f"--tokens must be a multiple of {TOKENS_PER_TEXT_TOKEN}"
    target = tokens // TOKENS_PER_TEXT_TOKEN
    for repeats in range(1, target + 1):
        for word in ("go", "the", "a", "I", "yes", "hello"):
            text = " ".join([word] * repeats) + "."
            sentences = pipeline.text.prepare(text)
            if len(sentences) == 1 and len(sentences[0].ids) == target:
                return text
    raise ValueError(f"found no one-sentence text of exactly {target} text tokens")


async def one_request(pipeline: Pipeline, text: str, voice: Voice, seed: int, streaming: bool) -> dict:
    start = time.perf_counter()
    first = None
    samples = 0
    async for chunk in pipeline.stream(SynthesisRequest(text, voice, seed=seed, streaming=streaming)):
        first = first or time.perf_counter() - start
        samples += len(chunk.samples)
    total = time.perf_counter() - start
    return {"ttfa": first, "total": total, "audio": samples / pipeline.sample_rate}


async def sample_batches(pipeline: Pipeline, seen: dict[str, list[int]], period: float = 0.002) -> None:
    """Record the engines' batch sizes every ``period`` seconds until cancelled.

    A size counts only once its engine has made progress since the level began, so the last batch of
    an earlier level is never reported.
    """
    lm0, t2w0 = pipeline.lm.stats(), pipeline.token2wav.stats()
    while True:
        lm, t2w = pipeline.lm.stats(), pipeline.token2wav.stats()
        if lm.tokens_generated > lm0.tokens_generated:
            # A step's batch cannot exceed the requests running now; this also drops a size left over
            # from before the level until the engine's first step in it.
            seen["lm"].append(min(lm.last_batch_size, lm.running))
        if t2w.flow_calls > t2w0.flow_calls:
            seen["flow"].append(t2w.last_flow_batch)
        if t2w.hift_calls > t2w0.hift_calls:
            seen["hift"].append(t2w.last_hift_batch)
        await asyncio.sleep(period)


async def run_level(pipeline: Pipeline, text: str, voice: Voice, clients: int, streaming: bool) -> dict:
    """``clients`` requests at once; latency percentiles, aggregate throughput, batch sizes, stage times."""
    seen: dict[str, list[int]] = {"lm": [], "flow": [], "hift": []}
    sampler = asyncio.create_task(sample_batches(pipeline, seen))
    stages_before = pipeline.token2wav.stats()
    start = time.perf_counter()
    try:
        results = await asyncio.gather(
            *(one_request(pipeline, text, voice, seed=1000 + i, streaming=streaming) for i in range(clients))
        )
    finally:
        sampler.cancel()
    wall = time.perf_counter() - start
    stages = pipeline.token2wav.stats()
    ttfa = [r["ttfa"] for r in results]
    audio = sum(r["audio"] for r in results)
    flow_calls = stages.flow_calls - stages_before.flow_calls
    hift_calls = stages.hift_calls - stages_before.hift_calls
    return {
        "clients": clients,
        "streaming": streaming,
        "ttfa_p50": percentile(ttfa, 0.5),
        "ttfa_p90": percentile(ttfa, 0.9),
        "ttfa_p99": percentile(ttfa, 0.99),
        "total_p50": percentile([r["total"] for r in results], 0.5),
        "wall_s": wall,
        "audio_s": audio,
        "audio_per_wall_s": audio / wall,
        "rtf_aggregate": wall / audio,
        "lm_max_batch": max(seen["lm"], default=0),
        "token2wav_max_flow_batch": max(seen["flow"], default=0),
        "token2wav_max_hift_batch": max(seen["hift"], default=0),
        "flow_calls": flow_calls,
        "flow_s_total": stages.flow_seconds - stages_before.flow_seconds,
        "flow_ms_per_call": 1000 * (stages.flow_seconds - stages_before.flow_seconds) / max(flow_calls, 1),
        "hift_calls": hift_calls,
        "hift_s_total": stages.hift_seconds - stages_before.hift_seconds,
        "hift_ms_per_call": 1000 * (stages.hift_seconds - stages_before.hift_seconds) / max(hift_calls, 1),
        "gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
    }


async def sequential_reference(pipeline: Pipeline, text: str, voice: Voice, clients: int) -> dict:
    """Baseline (a): requests served one after another on the plain PyTorch reference path, as a
    simple web demo does; every client waits for those before it. Whole clips (TTFA = completion)."""
    model = pipeline.model
    prompt = voice.prompt(pipeline.text)
    ids = torch.tensor(pipeline.text.prepare(text)[0].ids, dtype=torch.long)
    start = time.perf_counter()
    done, audio = [], 0.0
    for i in range(clients):
        wave = await asyncio.to_thread(
            model.synthesize, ids, prompt, 1.0, torch.Generator(model.device).manual_seed(i)
        )
        done.append(time.perf_counter() - start)
        audio += len(wave) / model.sample_rate
    wall = time.perf_counter() - start
    return {
        "clients": clients,
        "ttfa_p50": percentile(done, 0.5),
        "ttfa_p99": percentile(done, 0.99),
        "wall_s": wall,
        "audio_s": audio,
        "audio_per_wall_s": audio / wall,
        "rtf_aggregate": wall / audio,
    }


async def run_baselines(pipeline: Pipeline, text: str, voice: Voice, clients: int) -> dict[str, dict]:
    """The alternatives on the same model and load: (a) sequential reference path, (b) this LM engine
    with token2wav one request at a time, (c) the PyTorch LM engine with the batched token2wav."""
    from cosyapp.engine.lm_torch import TorchSpeechLM
    from cosyapp.engine.token2wav import Token2Wav

    baselines = {"a_sequential_reference": await sequential_reference(pipeline, text, voice, clients)}
    serial = Pipeline(pipeline.model, pipeline.text, pipeline.lm, Token2Wav(pipeline.model, max_batch=1))
    await serial.start()  # the shared LM engine is already started; this starts the serial worker
    try:
        baselines["b_engine_lm_serial_token2wav"] = await run_level(
            serial, text, voice, clients, streaming=True
        )
    finally:
        serial.token2wav.stop()
    if isinstance(pipeline.lm, TorchSpeechLM):
        baselines["c_torch_engine"] = {"same_as": "main run (its LM engine is the PyTorch one)"}
    else:
        torch_pipeline = Pipeline(
            pipeline.model, pipeline.text, TorchSpeechLM(pipeline.model.lm), pipeline.token2wav
        )
        await torch_pipeline.start()  # starts the PyTorch engine; the token2wav worker already runs
        try:
            baselines["c_torch_engine"] = await run_level(
                torch_pipeline, text, voice, clients, streaming=True
            )
        finally:
            await torch_pipeline.lm.shutdown()
    return baselines


async def run(args: argparse.Namespace) -> dict:
    device = pick_device(args.device)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cosyapp-bench-"))
    folder = workdir / ("full-size" if args.full_size else "tiny")
    if not (folder / "hift.pt").is_file():
        if args.full_size:
            write_full_size_model(folder, seed=0, endless=True, device=device.type)
        else:
            write_random_model(folder, seed=0, endless=True)
    model = load_model(folder, device=str(device))
    options = EngineOptions(
        engine=args.engine,
        cache_dir=workdir / "cache",
        max_streams=max(args.clients),
        max_batch=args.max_batch,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=device.type == "cpu",
        cuda_graphs=args.cuda_graphs,
    )
    pipeline = build_pipeline(model, options)
    voice = bench_voice()
    text = text_for_tokens(pipeline, args.tokens)
    started = time.perf_counter()
    await pipeline.start()
    startup = time.perf_counter() - started
    await run_level(pipeline, text, voice, min(max(args.clients), args.max_batch), streaming=True)  # warm-up
    levels = []
    try:
        for streaming in args.modes:
            for clients in args.clients:
                level = await run_level(pipeline, text, voice, clients, streaming)
                levels.append(level)
                print(_row(level), flush=True)
        baselines = await run_baselines(pipeline, text, voice, max(args.clients)) if args.baselines else {}
    finally:
        await pipeline.shutdown()
    main = next(lv for lv in reversed(levels) if lv["clients"] == max(args.clients))
    for name, base in baselines.items():
        if "audio_per_wall_s" in base:
            base["cosyapp_throughput_ratio"] = main["audio_per_wall_s"] / base["audio_per_wall_s"]
            ratio = base["cosyapp_throughput_ratio"]
            print(f"{name}: {base['audio_per_wall_s']:.1f} audio s/s; cosyapp is {ratio:.1f}x", flush=True)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "engine": type(pipeline.lm).__name__,
        "model": "CosyVoice2-0.5B sizes, random weights" if args.full_size else "tiny random model",
        "tokens_per_request": args.tokens,
        "audio_s_per_request": args.tokens / 25,
        "startup_s": startup,
        "options": {k: str(v) for k, v in asdict(options).items()},
        "levels": levels,
        "baselines": baselines,
    }


def _row(level: dict) -> str:
    mode = "stream" if level["streaming"] else "whole"
    return (
        f"{mode:6} clients {level['clients']:4}  TTFA p50 {level['ttfa_p50'] * 1000:7.0f} ms  "
        f"p99 {level['ttfa_p99'] * 1000:7.0f} ms  RTF {level['rtf_aggregate']:.4f}  "
        f"{level['audio_per_wall_s']:7.1f} audio s/s  LM batch<={level['lm_max_batch']}  "
        f"flow batch<={level['token2wav_max_flow_batch']} ({level['flow_ms_per_call']:.0f} ms/call, "
        f"{level['flow_calls']} calls)  HiFT {level['hift_ms_per_call']:.0f} ms/call ({level['hift_calls']})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny model, 1 and 4 clients, 40 tokens")
    parser.add_argument("--full-size", action="store_true", help="CosyVoice2-0.5B sizes with random weights")
    parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "torch"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--clients", default="1,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--tokens", type=int, default=250, help="speech tokens per request (25 per second)")
    parser.add_argument("--modes", default="stream", help="stream, whole or stream,whole")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="replay the flow estimator from CUDA graphs"
    )
    parser.add_argument("--workdir", default=None, help="where the random model and caches go")
    parser.add_argument("--out", type=Path, default=Path("bench.json"))
    args = parser.parse_args(argv)
    if args.smoke:
        args.clients, args.tokens, args.full_size, args.baselines = "1,4", 40, False, True
    args.clients = [int(c) for c in args.clients.split(",")]
    args.modes = [m == "stream" for m in args.modes.split(",")]
    result = asyncio.run(run(args))
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

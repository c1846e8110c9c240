"""A whole benchmark run: model, engines, server, every level, the baselines; returns the result."""

import argparse
import asyncio
import gc
import itertools
import json
import tempfile
import time
from contextlib import AsyncExitStack
from dataclasses import asdict, replace
from pathlib import Path

from tqdm import tqdm

from cosyapp.bench import baselines as base
from cosyapp.bench import stall
from cosyapp.bench.browser import BrowserDriver
from cosyapp.bench.drivers import GradioDriver, OpenAIDriver, PipelineDriver
from cosyapp.bench.levels import Driver, measure
from cosyapp.bench.load import (
    VOICE_ID,
    TextSet,
    bench_voice,
    decoding_ratio,
    prepare_model,
    text_sets,
    write_speaker,
)
from cosyapp.bench.report import hardware, now, row, versions
from cosyapp.bench.serving import check_external, own_server
from cosyapp.bench.timeline import Timeline
from cosyapp.engine.build import (
    build_pipeline,
    build_token2wav,
    choose_engine,
    compiles_flow,
    lm_beside,
    prepare_flow,
)
from cosyapp.engine.pipeline import Pipeline
from cosyapp.engine.text_workers import TextWorkers
from cosyapp.engine.token2wav.compiling import epoch
from cosyapp.engine.token2wav.turns import empty_cache_in_turn
from cosyapp.models.checkpoint import load_model, pick_device
from cosyapp.options import ServeOptions


async def run(args: argparse.Namespace) -> dict:
    """Measure every (text, driver, mode, clients) setting of ``args``, then the baselines; returns
    the result (everything but the plots)."""
    device = pick_device(args.device)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="cosyapp-bench-"))
    folder = prepare_model(workdir / ("full-size" if args.full_size else "tiny"), args.full_size, device)
    options = replace(args.serve, cache_dir=workdir / "cache")
    pipeline = build_pipeline(load_model(folder, device=str(device)), options)
    write_speaker(folder, pipeline.text)
    # Another process's model cannot be told a decoding ratio: against --url every text decodes at the
    # model's own.
    texts = text_sets(args.texts, pipeline.text, args.tokens, realistic_ratio=not args.url)
    http = [name for name in args.drivers if name != "pipeline"]
    if http and args.url:
        check_external(args.url, VOICE_ID)
    # An external server serves with its own engines: start ours only where something uses them.
    local = "pipeline" in args.drivers or args.baselines or bool(http and not args.url)
    startup = compile_wait = None
    async with AsyncExitStack() as stack:
        if local:
            started = time.perf_counter()
            await pipeline.start(warm_up=device.type != "cpu")
            startup = time.perf_counter() - started
            stall.progress()
            stack.push_async_callback(pipeline.shutdown)
            if compiles_flow(device, options):
                started = time.perf_counter()
                await _compiled(pipeline, warm_up=device.type != "cpu")
                compile_wait = time.perf_counter() - started
        url = args.url
        if http and not url:
            engine = choose_engine(args.engine, device)
            url = await stack.enter_async_context(own_server(pipeline, folder, workdir, engine))
        drivers = _drivers(args.drivers, pipeline, url)
        for driver in drivers:
            stack.push_async_callback(driver.close)
        levels, baselines = await _measure_all(args, pipeline, local, drivers, texts)
        for name, changes in args.variants.items():
            levels += await _measure_variant(args, pipeline, replace(options, **changes), name, texts)
    reference = None
    if baselines:
        reference = _reference(levels, texts[0].name, max(args.clients))
        base.add_ratios(baselines, reference)
        for name, result in baselines.items():
            if "cosyapp_throughput_ratio" in result:
                print(
                    f"{name}: {result['audio_per_wall_s']:.1f} audio s/s at {result['clients']} clients; "
                    f"cosyapp is {result['cosyapp_throughput_ratio']:.1f}x",
                    flush=True,
                )
    return {
        "date": now(),
        "hardware": hardware(device),
        "versions": versions(),
        "command": args.command,
        "options": {
            key: value for key, value in vars(args).items() if key not in ("command", "serve", "variants")
        },
        "engine_options": {key: str(value) for key, value in asdict(options).items()},
        "engine": type(pipeline.lm).__name__,
        "model": "CosyVoice2-0.5B sizes, random weights" if args.full_size else "tiny random model",
        "server": args.url or ("own server, this process" if http else None),
        "voice": VOICE_ID,
        "startup_s": startup,
        "startup_phases_s": pipeline.startup_s if local else None,
        "compile_wait_s": compile_wait,
        "variants": args.variants,
        "texts": {text.name: text.describe(pipeline.text) for text in texts},
        "levels": levels,
        "baselines_text": texts[0].name if baselines else None,
        "baselines_reference": reference
        and {k: reference[k] for k in ("driver", "text", "streaming", "clients")},
        "baselines": baselines,
    }


async def _measure_all(
    args: argparse.Namespace, pipeline: Pipeline, local: bool, drivers: list[Driver], texts: list[TextSet]
) -> tuple[list[dict], dict[str, dict]]:
    """Warm up, then every level in order, then the baselines; prints a row per level.

    ``local``: whether ``pipeline`` serves (the pipeline driver, the own server) rather than a server
    in another process.
    """
    settings = [
        setting
        for setting in itertools.product(texts, drivers, args.modes, args.clients)
        if _measures(setting[1], setting[2])
    ]
    total = sum(clients for *_, clients in settings)
    if args.baselines:
        total += base.requests(pipeline, args.baseline_clients, max(args.clients))
    levels, baselines = [], {}
    with tqdm(total=total, unit="req", desc="warm-up", disable=None) as progress:
        with decoding_ratio(pipeline.model, texts[0].ratio):
            await _warm_up(drivers, texts[0], args, pipeline if local else None)
        for text, driver, mode, clients in settings:
            progress.set_description(f"{driver.name} {text.name} {mode} x{clients}")
            served_here = pipeline if driver.name == "pipeline" or not args.url else None
            with decoding_ratio(pipeline.model, text.ratio):
                traced = level_timeline(args, mode, clients) if served_here is not None else None
                level = await measure(
                    driver, text, mode == "stream", clients, served_here, progress.update, traced
                )
            levels.append(level)
            _keep(args, level)
            progress.write(row(level))
        if args.baselines:
            progress.set_description("baselines")
            baselines = await _baselines(pipeline, texts[0], args, progress.update)
    return levels, baselines


async def _measure_variant(
    args: argparse.Namespace, pipeline: Pipeline, options: ServeOptions, name: str, texts: list[TextSet]
) -> list[dict]:
    """The pipeline driver's levels again with a token2wav worker and text lanes built from
    ``options``, on the same LM engine: the old worker is stopped and its memory freed, the new one
    captures its graphs and warms up as at start-up. Each level is marked with the variant's
    ``name``."""
    pipeline.text_workers.close()
    pipeline.text_workers = TextWorkers(pipeline.text, options.text_lanes)
    await pipeline.text_workers.start()
    old = pipeline.token2wav
    await asyncio.to_thread(old.stop)
    if old.cached is not None:
        # On a GPU the old pool stayed allocated after the collection below (an H100 run sized the
        # next pool from what was left and then ran out of memory): free it outright.
        old.cached.free()
    device = pipeline.model.device
    compiles = compiles_flow(device, options) and not compiles_flow(device, args.serve)
    if compiles:  # the last variant (parse_args): the flow compiled in place, its graphs made anew
        prepare_flow(pipeline.model.flow, pipeline.model.device, options)
    pipeline.token2wav = build_token2wav(pipeline.model, options)
    del old
    gc.collect()  # the incremental flow's page pool goes before the new worker sizes its own
    empty_cache_in_turn()  # in its turn: the new worker's captures may have begun (turns.py)
    await asyncio.to_thread(pipeline.token2wav.capture_graphs)
    pipeline.token2wav.start()
    driver = PipelineDriver(pipeline, bench_voice(pipeline.text))
    levels = []
    with tqdm(total=None, unit="req", desc=f"variant {name}", disable=None) as progress:
        with decoding_ratio(pipeline.model, texts[0].ratio):
            await pipeline.warm_up_token2wav()
            stall.progress()
            await measure(driver, texts[0], True, warm_clients(args), None)
            await pipeline.token2wav.graphs_settled()
            stall.progress()
            waited = {}
            if compiles:  # the wait, and what the compile thread had compiled when the levels began
                started = time.perf_counter()
                await _compiled(pipeline, warm_up=pipeline.model.device.type != "cpu")
                compiled = pipeline.token2wav.stats().flow_compiles
                waited = {"compile_wait_s": time.perf_counter() - started, "compiled_before": compiled}
        for text, mode, clients in itertools.product(texts, args.modes, args.clients):
            with decoding_ratio(pipeline.model, text.ratio):
                traced = level_timeline(args, mode, clients)
                level = await measure(
                    driver, text, mode == "stream", clients, pipeline, progress.update, traced
                )
            levels.append(level | {"variant": name} | waited)
            _keep(args, levels[-1])
            progress.write(row(levels[-1]))
    await driver.close()
    return levels


def warm_clients(args: argparse.Namespace) -> int:
    """The streams of the warm-up level before the levels: the most any level sends. Streams at
    different stages share a step there, which makes incremental-flow buckets (rows, new frames, past
    pages) that fewer streams in lockstep never meet; each new bucket runs eagerly and is captured
    beside the serving (3 eager runs). A warm-up of max_batch streams left 2-4 such buckets to every
    256-stream level on an H100, whose captures took 6.2-14.9 s of a 17.6-23.4 s level where the
    flow was the limit, and the level's audio per second fell as they grew: 150.9 at 6.2 s, 113.8-125.4
    at 10.6-14.9 s (docs/benchmarks/README.md, tenth round)."""
    return max(args.clients)


def level_timeline(args: argparse.Namespace, mode: str, clients: int) -> Timeline | None:
    """A window of GPU trace for a level that --timeline lists (its mode and clients, or its clients)."""
    listed = (mode, clients) in args.timeline or (None, clients) in args.timeline
    return Timeline(*args.timeline_window) if listed else None


def levels_file(out: Path) -> Path:
    """Where a run keeps each level as one JSON line as soon as it is measured (emptied at its start),
    so a run stopped part way (a time limit, a crash at a later level) keeps the levels it finished."""
    return out.with_name(f"{out.stem}-levels.jsonl")


def _keep(args: argparse.Namespace, level: dict) -> None:
    stall.progress()  # a level finished
    with levels_file(args.out).open("a") as file:
        file.write(json.dumps(level) + "\n")


def _drivers(names: list[str], pipeline: Pipeline, url: str | None) -> list[Driver]:
    made = {
        "pipeline": lambda: PipelineDriver(pipeline, bench_voice(pipeline.text)),
        "openai": lambda: OpenAIDriver(url, VOICE_ID, pipeline.sample_rate),
        "gradio": lambda: GradioDriver(url, VOICE_ID),
        "browser": lambda: BrowserDriver(url, VOICE_ID, pipeline.sample_rate),
    }
    return [made[name]() for name in names]


async def _compiled(pipeline: Pipeline, warm_up: bool) -> None:
    """--compile-flow compiles on a thread of its own while the engine serves eagerly
    (engine/token2wav/compiling.py): wait until what the warm-up met is compiled and its graphs are
    captured again, warming up again until that meets nothing new, so the levels measure the
    compiled flow. The time this takes is the result's ``compile_wait_s``."""
    while True:
        await pipeline.token2wav.compiles_settled()
        before = epoch()
        if warm_up:
            await pipeline.warm_up_token2wav()
        await pipeline.token2wav.compiles_settled()
        if epoch() == before:
            return


async def _warm_up(
    drivers: list[Driver], text: TextSet, args: argparse.Namespace, local: Pipeline | None
) -> None:
    """Not measured: a streaming level of the local engines at the largest concurrency (warm_clients),
    then one request of each HTTP driver and mode (first calls pay for connections, ffmpeg, queue
    set-up)."""
    if local is not None:
        warm = PipelineDriver(local, bench_voice(local.text))
        await measure(warm, text, True, warm_clients(args), None)
        await local.token2wav.graphs_settled()  # captures of buckets this voice met: not in a level
        await local.token2wav.compiles_settled()  # --compile-flow: what it met compiled, not in a level
    for driver in drivers:
        if driver.name != "pipeline":
            for mode in filter(lambda mode: _measures(driver, mode), args.modes):
                await measure(driver, text, mode == "stream", 1, None)


def _measures(driver: Driver, mode: str) -> bool:
    """Whether ``driver`` measures ``mode``: the browser driver plays streams only."""
    return driver.name != "browser" or mode == "stream"


async def _baselines(pipeline: Pipeline, text: TextSet, args: argparse.Namespace, on_done) -> dict[str, dict]:
    voice = bench_voice(pipeline.text)
    top = max(args.clients)
    with decoding_ratio(pipeline.model, text.ratio), lm_beside(pipeline.model):
        return {
            "a_sequential_reference": await base.sequential_reference(
                pipeline, voice, text, args.baseline_clients, on_done
            ),
            "b_engine_lm_serial_token2wav": await base.serial_token2wav(pipeline, voice, text, top, on_done),
            "c_torch_engine": await base.torch_engine(pipeline, voice, text, top, args.max_batch, on_done),
        }


def _reference(levels: list[dict], text: str, clients: int) -> dict:
    """(d): the pipeline driver's level of ``text`` at ``clients``, streaming when measured."""
    candidates = [
        lv for lv in levels if (lv["driver"], lv["text"], lv["clients"]) == ("pipeline", text, clients)
    ]
    return max(candidates, key=lambda lv: lv["streaming"])

"""Benchmark cosyapp: latency and throughput against concurrency, through each way clients reach it,
beside baselines on the same model, in one run.

    python -m cosyapp.bench --smoke                     # tiny model on CPU, well under a minute
    python -m cosyapp.bench --full-size --engine vllm --drivers pipeline --texts tokens,short --baselines

Load is reproducible: random weights whose stop tokens are unreachable, so every request decodes a
known number of speech tokens (see cosyapp/bench/load.py), a fixed prompt voice and fixed seeds.
Drivers: ``pipeline`` (in-process), ``openai`` (POST /v1/audio/speech), ``gradio`` (the page's
endpoints through gradio_client) and ``browser`` (the page in headless Chromium through Playwright:
click-to-sound beside server TTFA, streaming only); the others talk to the benchmark's own server on
a loopback port unless --url names a running one. Prints a row per level and writes JSON plus PNG plots
(``--out x.json`` -> ``x-latency.png``, ``x-throughput.png``, ``x-stages.png``).
"""

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import shlex
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from cosyapp.bench.drivers import DRIVERS
from cosyapp.bench.load import MODEL_RATIO, TEXT_SETS
from cosyapp.bench.report import plot_paths, write_plots
from cosyapp.bench.stall import stall_dumps
from cosyapp.engine.build import compiles_flow
from cosyapp.models.checkpoint import pick_device
from cosyapp.options import DEFAULTS, ENGINES, OptionError, ServeOptions

MODES = ("stream", "whole")
# The ServeOptions a --variant may change: the token2wav worker's (engine/build.py build_token2wav)
# and the text lanes; and compile_flow=true, which compiles an eagerly served flow in place, so only
# as the last variant of a run without --compile-flow. compile_hift and flow_dtype are not among
# them: they change the model's HiFT or flow in place, with no way back or forth.
VARIANT_FIELDS = (
    "first_hop",
    "flow_cache_gb",
    "chunked_final",
    "flow_cache_inputs",
    "flow_step_graphs",
    "gather_ms",
    "expect_ms",
    "fill_ms",
    "overlap_hift",
    "flow_overlap",
    "max_batch",
    "token2wav_priority",
    "hift_first",
    "hift_graphs",
    "lm_yield_ms",
    "step_frames_per_row",
    "whole_step_frames_per_row",
    "late_step_frames_per_row",
    "max_batch_per_call",
    "text_lanes",
    "compile_flow",
)
SMOKE = {
    "clients": "1,2",
    "texts": "short",
    "modes": "stream,whole",
    "drivers": "pipeline,openai,gradio",
    "baselines": True,
    "baseline_clients": 2,
    "full_size": False,
    "device": "cpu",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cosyapp.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    smoke = " ".join(
        f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}")
        for key, value in SMOKE.items()
        if value is not False
    )
    add("--smoke", action="store_true", help=f"the CI check, a tiny model with: {smoke} (overriding those)")
    add("--full-size", action="store_true", help="CosyVoice2-0.5B sizes with random weights")
    add("--engine", default=DEFAULTS.engine, choices=ENGINES)
    add("--device", default=None, help="torch device (default: cuda when available)")
    add(
        "--clients", default="1,4,16,64,256", help="comma-separated concurrency levels (default: %(default)s)"
    )
    add("--modes", default="stream,whole", help="stream, whole or both (default: %(default)s)")
    add(
        "--texts",
        default=",".join(TEXT_SETS),
        help="text sets: tokens (exactly --tokens speech tokens), short, medium, long (~20, ~100, ~400 "
        "characters) (default: %(default)s)",
    )
    add(
        "--tokens",
        type=int,
        default=260,
        help="speech tokens of the 'tokens' text, 25 per second (default: %(default)s)",
    )
    add(
        "--drivers",
        default="pipeline,openai,gradio",
        help="pipeline (in-process), openai (HTTP API), gradio (gradio_client), browser (the page in "
        "headless Chromium, streaming only) (default: %(default)s)",
    )
    add(
        "--url",
        default=None,
        help="a running server for the HTTP drivers, serving this run's model folder (WORKDIR/full-size "
        "or WORKDIR/tiny); there every text decodes at the model's ratio and engine statistics are "
        "not available (default: start one in this process)",
    )
    add(
        "--baselines",
        action="store_true",
        help="also measure (a) sequential reference serving, (b) token2wav one request at a time, (c) the "
        "PyTorch LM engine, on the first text, against the pipeline driver at the top concurrency",
    )
    add(
        "--baseline-clients",
        type=int,
        default=4,
        help="clients of baseline (a), which serves one request at a time: its throughput does not depend "
        "on this, only how long it takes (default: %(default)s)",
    )
    add(
        "--max-batch",
        type=int,
        default=DEFAULTS.max_batch,
        help="largest LM and token2wav batch (default: %(default)s)",
    )
    add(
        "--first-hop",
        type=int,
        default=DEFAULTS.first_hop,
        help="speech tokens of a stream's first chunk (default: %(default)s)",
    )
    add(
        "--stall-dump-s",
        type=float,
        default=300.0,
        help="print every thread's stack to stderr whenever this long passes without a level or a "
        "warm-up finishing (cosyapp/bench/stall.py; 0: never; default: %(default)s)",
    )
    add("--gpu-memory-utilization", type=float, default=DEFAULTS.gpu_memory_utilization)
    add(
        "--no-cuda-graphs",
        dest="cuda_graphs",
        action="store_false",
        help="run the flow estimator eagerly (default: replayed from CUDA graphs on a GPU)",
    )
    add(
        "--flow-cache-gb",
        type=float,
        default=DEFAULTS.flow_cache_gb,
        help="memory for the incremental streaming flow; 0 = recompute (default: %(default)s)",
    )
    add("--chunked-final", action="store_true", help="with --flow-cache-gb: incremental last chunk")
    add(
        "--text-lanes",
        type=int,
        default=DEFAULTS.text_lanes,
        help="texts prepared at once (as serve's flag; 0 = one per 4 cores; default: %(default)s)",
    )
    add(
        "--flow-cache-inputs",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.flow_cache_inputs,
        help="the flow cache keeps attention inputs, not keys and values (as serve's flag; "
        "default: %(default)s)",
    )
    add(
        "--compile-flow",
        action=argparse.BooleanOptionalAction,
        help="the flow estimator compiled by torch.compile (as serve's flag; default: on a GPU)",
    )
    add(
        "--compile-hift",
        action=argparse.BooleanOptionalAction,
        help="HiFT's Snake activations as kernels compiled by torch.compile (as serve's flag; "
        "default: on a GPU)",
    )
    add(
        "--lm-in-process",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.lm_in_process,
        help="vLLM's engine core on a thread of this process (as serve's flag; default: %(default)s)",
    )
    add(
        "--lm-stream-interval",
        type=int,
        default=DEFAULTS.lm_stream_interval,
        help="speech tokens per vLLM output to this process (as serve's flag; default: %(default)s)",
    )
    add(
        "--lm-sampler-graphs",
        action=argparse.BooleanOptionalAction,
        default=DEFAULTS.lm_sampler_graphs,
        help="the LM's RAS draw replayed from CUDA graphs (as serve's flag; default: %(default)s)",
    )
    add(
        "--variant",
        dest="variants",
        action="append",
        default=[],
        metavar="NAME:FIELD=VALUE[,FIELD=VALUE]",
        help="after the levels, swap in a token2wav worker and text lanes with these options (fields: "
        f"{', '.join(VARIANT_FIELDS)}) and measure the pipeline driver's levels again on the same LM "
        "engine; repeatable, e.g. --variant serial-hift:overlap_hift=false --variant hop15:first_hop=15",
    )
    add(
        "--timeline",
        default="",
        metavar="[MODE:]CLIENTS",
        help="comma-separated concurrency levels whose GPU work is traced for a window (torch.profiler, "
        "this process's kernels by CUDA stream and launching thread: cosyapp/bench/timeline.py), "
        "variants' levels too; stream:64 traces only the streaming level of 64 (default: none)",
    )
    add(
        "--timeline-window",
        default="3,3",
        metavar="START,SECONDS",
        help="when the traced window starts in its level and how long it lasts (default: %(default)s)",
    )
    add("--workdir", default=None, help="where the random model and caches go (default: a new temp folder)")
    add("--out", type=Path, default=Path("bench.json"), help="result JSON; plots go beside it")
    return parser


def _traced(entry: str) -> tuple[str | None, int]:
    """A --timeline entry as (mode or None for every mode, clients); ValueError if malformed."""
    mode, _, clients = entry.rpartition(":")
    if mode and mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}")
    return mode or None, int(clients)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parsed and checked options; exits with a message for a bad combination."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    args.command = shlex.join(["python", "-m", "cosyapp.bench", *argv])
    try:
        args.clients = [int(c) for c in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients takes whole numbers separated by commas, got {args.clients!r}")
    try:
        args.timeline = [_traced(entry) for entry in args.timeline.split(",") if entry]
        args.timeline_window = tuple(float(x) for x in args.timeline_window.split(","))
    except ValueError:
        parser.error(
            "--timeline takes [MODE:]CLIENTS entries (a mode of --modes) and --timeline-window two numbers, "
            "comma-separated"
        )
    if len(args.timeline_window) != 2 or min(args.timeline_window) < 0:
        parser.error(f"--timeline-window takes START,SECONDS, got {args.timeline_window}")
    args.modes = [_choice(parser, "--modes", m, MODES) for m in args.modes.split(",")]
    args.texts = [_choice(parser, "--texts", t, TEXT_SETS) for t in args.texts.split(",")]
    args.drivers = [_choice(parser, "--drivers", d, DRIVERS) for d in args.drivers.split(",")]
    if min(args.clients) < 1 or args.baseline_clients < 1:
        parser.error("client counts must be at least 1")
    if "tokens" in args.texts and (args.tokens <= 0 or args.tokens % MODEL_RATIO):
        parser.error(f"--tokens must be a positive multiple of {MODEL_RATIO:g}, got {args.tokens}")
    if args.baselines and "pipeline" not in args.drivers:
        parser.error("--baselines compares against the pipeline driver: add pipeline to --drivers")
    try:  # the run puts the cache in its work folder
        args.serve = ServeOptions(
            engine=args.engine,
            max_streams=max(args.clients),
            max_batch=args.max_batch,
            gpu_memory_utilization=args.gpu_memory_utilization,
            first_hop=args.first_hop,
            cuda_graphs=args.cuda_graphs,
            flow_cache_gb=args.flow_cache_gb,
            chunked_final=args.chunked_final,
            flow_cache_inputs=args.flow_cache_inputs,
            compile_flow=args.compile_flow,
            compile_hift=args.compile_hift,
            lm_in_process=args.lm_in_process,
            lm_stream_interval=args.lm_stream_interval,
            lm_sampler_graphs=args.lm_sampler_graphs,
            text_lanes=args.text_lanes,
            slowest_speech_rate=0,  # the load decodes its set token counts, far past a spoken pace
        )
    except OptionError as e:
        parser.error(e.flag())
    args.variants = dict(_variant(parser, text, args.serve) for text in args.variants)
    for name, changes in list(args.variants.items())[:-1]:
        if changes.get("compile_flow"):
            parser.error(f"--variant {name}: compile_flow compiles the flow for good: the last variant only")
    compiling = [name for name, changes in args.variants.items() if "compile_flow" in changes]
    eager = not compiling or not compiles_flow(pick_device(args.device), args.serve)
    for name in compiling:
        if not (eager and args.variants[name]["compile_flow"]):
            parser.error(
                f"--variant {name}: compile_flow=true compiles an eagerly served flow "
                "(on a GPU: add --no-compile-flow)"
            )
    if args.variants and "pipeline" not in args.drivers:
        parser.error("--variant measures the pipeline driver: add pipeline to --drivers")
    http = [d for d in args.drivers if d != "pipeline"]
    needed = (["gradio"] if http and not args.url else []) + (["gradio_client"] if "gradio" in http else [])
    needed += ["playwright"] if "browser" in http else []
    for package in needed + (["httpx"] if http else []):
        if importlib.util.find_spec(package) is None:
            parser.error(
                f"the {', '.join(http)} driver(s) need {package}: install it, or use --drivers pipeline"
            )
    return args


def _variant(parser: argparse.ArgumentParser, text: str, base: ServeOptions) -> tuple[str, dict]:
    """NAME:FIELD=VALUE,... -> (NAME, {field: value}), each value read as its field's type and the
    whole checked as ServeOptions."""
    name, _, spec = text.partition(":")
    changes = {}
    for item in filter(None, spec.split(",")):
        field, _, value = item.partition("=")
        if field not in VARIANT_FIELDS:
            parser.error(f"--variant {text!r}: {field!r} is not one of {', '.join(VARIANT_FIELDS)}")
        current = getattr(base, field)
        if value.lower() == "none":
            changes[field] = None
        elif isinstance(current, bool) or (current is None and value.lower() in ("true", "false")):
            if value.lower() not in ("true", "false"):  # None: a choice left open (compile_flow)
                parser.error(f"--variant {text!r}: {field} takes true or false")
            changes[field] = value.lower() == "true"
        else:
            try:
                changes[field] = int(value) if isinstance(current, int) else float(value)
            except ValueError:
                parser.error(f"--variant {text!r}: {field} takes a number, got {value!r}")
    if not name or not changes:
        parser.error(f"--variant takes NAME:FIELD=VALUE[,FIELD=VALUE], got {text!r}")
    try:
        replace(base, **changes)
    except OptionError as e:
        parser.error(f"--variant {text!r}: {e}")
    return name, changes


def _choice(parser: argparse.ArgumentParser, flag: str, value: str, allowed) -> str:
    if value not in allowed:
        parser.error(f"{flag}: unknown {value!r}; choose from {', '.join(allowed)}")
    return value


@contextlib.contextmanager
def _engine_log(out: Path) -> Iterator[None]:
    """The engine's own log at INFO (graph buckets met and captured, fallbacks, ...) in OUT-engine.log
    beside the JSON, for reading a level's outliers afterwards; the console stays as it was."""
    handler = logging.FileHandler(out.with_name(f"{out.stem}-engine.log"), mode="w")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    engine = logging.getLogger("cosyapp")
    level = engine.level
    engine.setLevel(logging.INFO)
    engine.addHandler(handler)
    try:
        yield
    finally:
        engine.removeHandler(handler)
        engine.setLevel(level)
        handler.close()


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark of the command line ``argv`` and write its JSON and plots."""
    from cosyapp.bench.run import levels_file, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    levels_file(args.out).unlink(missing_ok=True)
    with _engine_log(args.out), stall_dumps(args.stall_dump_s, sys.stderr):
        result = asyncio.run(run(args))
    result["options"] = {k: str(v) if isinstance(v, Path) else v for k, v in result["options"].items()}
    result["plots"] = {name: str(path) for name, path in plot_paths(args.out).items()}
    args.out.write_text(json.dumps(result, indent=2))  # first, so a failing plot loses no numbers
    write_plots(result, args.out)
    print(f"wrote {args.out} and {', '.join(Path(p).name for p in result['plots'].values())}")


if __name__ == "__main__":
    main()

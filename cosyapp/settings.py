"""Every knob of cosyapp in one place: command-line flags, each with a COSYAPP_* environment default.

The serving flags' defaults and ranges are those of ``cosyapp.options``.
"""

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from cosyapp.options import DEFAULT_HOME, DEFAULTS, ENGINES, OptionError, ServeOptions

if TYPE_CHECKING:
    from cosyapp.deploy.sizing import CardSizing

DEFAULT_REPO = "FunAudioLLM/CosyVoice2-0.5B"
DEFAULT_ASR_REPO = "openai/whisper-large-v3-turbo"  # prompt transcription (cosyapp/asr/)
# Left unset (no flag, no COSYAPP_* variable), these are sized to the GPU's memory at start
# (cosyapp/deploy/sizing.py); until then they hold the defaults of ServeOptions.
CARD_SIZED = ("gpu_memory_utilization", "max_streams")


@dataclass(frozen=True)
class Settings:
    """Validated settings of one cosyapp process."""

    model: str = DEFAULT_REPO
    demo: bool = False
    asr_model: str | None = DEFAULT_ASR_REPO  # None: --no-asr
    device: str | None = None
    engine: str = DEFAULTS.engine
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    gpu_memory_utilization: float = DEFAULTS.gpu_memory_utilization
    max_streams: int = DEFAULTS.max_streams
    first_hop: int = DEFAULTS.first_hop
    flow_cache_gb: float | None = DEFAULTS.flow_cache_gb
    chunked_final: bool = DEFAULTS.chunked_final
    flow_cache_inputs: bool = DEFAULTS.flow_cache_inputs
    gather_ms: float = DEFAULTS.gather_ms
    expect_ms: float = DEFAULTS.expect_ms
    text_lanes: int = DEFAULTS.text_lanes
    compile_flow: bool | None = DEFAULTS.compile_flow
    compile_hift: bool | None = DEFAULTS.compile_hift
    hift_graphs: bool = DEFAULTS.hift_graphs
    lm_in_process: bool = DEFAULTS.lm_in_process
    lm_stream_interval: int = DEFAULTS.lm_stream_interval
    lm_sampler_graphs: bool = DEFAULTS.lm_sampler_graphs
    lm_yield_ms: float = DEFAULTS.lm_yield_ms
    token2wav_priority: int = DEFAULTS.token2wav_priority
    hift_first: bool = DEFAULTS.hift_first
    max_text_chars: int = DEFAULTS.max_text_chars
    slowest_speech_rate: float = DEFAULTS.slowest_speech_rate
    max_request_audio_s: float = DEFAULTS.max_request_audio_s
    max_upload_mb: int = 20
    auth: tuple[str, str] | None = field(default=None, repr=False)  # secrets stay out of logs
    api_key: str | None = field(default=None, repr=False)
    cors_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 10.0
    cache_dir: Path = DEFAULTS.cache_dir
    data_dir: Path = DEFAULT_HOME / "data"
    replicas: int = 1  # more: one Pipeline per replica through Ray Serve (cosyapp/cluster/)
    gpus_per_replica: float | None = None  # None: 1 where Ray sees GPUs, else 0
    card_sized: tuple[str, ...] = ()  # the CARD_SIZED options the user left unset
    card: "CardSizing | None" = None  # what the GPU sizing chose (app.py sets it at start)

    def serve_options(self) -> ServeOptions:
        """The engine's options: those these settings choose, every other at its default.

        Raises OptionError for a chosen value outside its range.
        """
        chosen = {f.name for f in fields(self)} & {f.name for f in fields(ServeOptions)}
        values = {name: getattr(self, name) for name in chosen}
        # A batch never holds more than the admitted streams; the cap also keeps the start-up warm-up
        # (every batch size up to max_batch) within the memory a small card was sized for.
        values["max_batch"] = min(DEFAULTS.max_batch, self.max_streams)
        return ServeOptions(**values)


def _env(name: str, default: object) -> str | None:
    value = os.environ.get(f"COSYAPP_{name}")
    return value if value is not None else (None if default is None else str(default))


def _flag(name: str, default: bool = False) -> bool:
    return os.environ.get(f"COSYAPP_{name}", "1" if default else "0").lower() in ("1", "true", "yes")


def build_parser() -> argparse.ArgumentParser:
    defaults = Settings()
    parser = argparse.ArgumentParser(
        prog="app.py",
        description="cosyapp: CosyVoice 2 text-to-speech for many sessions from one shared pipeline.",
    )
    add = parser.add_argument
    add(
        "--model",
        default=_env("MODEL", defaults.model),
        help="model folder in the official CosyVoice2 layout, or a hub repo id to download "
        "(default: %(default)s; env COSYAPP_MODEL)",
    )
    add(
        "--demo",
        action="store_true",
        default=_flag("DEMO"),
        help="use a tiny random-weight model written locally instead of real weights: for trying the "
        "interface without a download; it speaks noise (env COSYAPP_DEMO=1)",
    )
    add(
        "--asr-model",
        default=_env("ASR_MODEL", defaults.asr_model),
        help="Whisper model that transcribes voice prompts (hub repo id or folder); the default falls back "
        "to a tiny random one when it cannot be downloaded (default: %(default)s; env COSYAPP_ASR_MODEL)",
    )
    add(
        "--no-asr",
        action="store_true",
        default=_flag("NO_ASR"),
        help="do not transcribe voice prompts: users type the transcript (env COSYAPP_NO_ASR=1)",
    )
    add(
        "--device",
        default=_env("DEVICE", None),
        help="torch device, e.g. cuda, cuda:1 or cpu (default: cuda when available; env COSYAPP_DEVICE)",
    )
    add(
        "--engine",
        choices=ENGINES,
        default=_env("ENGINE", defaults.engine),
        help="speech-token LM engine: vllm, torch, or auto = vllm when installed and on a GPU "
        "(default: %(default)s; env COSYAPP_ENGINE)",
    )
    add(
        "--host", default=_env("HOST", defaults.host), help="address (default: %(default)s; env COSYAPP_HOST)"
    )
    add(
        "--port",
        type=int,
        default=int(_env("PORT", defaults.port)),
        help="port (default: %(default)s; env COSYAPP_PORT)",
    )
    add(
        "--share",
        action="store_true",
        default=_flag("SHARE"),
        help="also publish a temporary public share link: anyone with it can use the app "
        "(env COSYAPP_SHARE=1)",
    )
    add(
        "--gpu-memory-utilization",
        type=float,
        default=_env("GPU_MEMORY_UTILIZATION", None),
        help="fraction of the GPU's memory vLLM may take for the LM (default: sized to the card, "
        f"{defaults.gpu_memory_utilization} from 20 GiB up; env COSYAPP_GPU_MEMORY_UTILIZATION)",
    )
    add(
        "--max-streams",
        type=int,
        default=_env("MAX_STREAMS", None),
        help="requests synthesised at once; more wait in a queue (default: sized to the GPU's memory, "
        f"see the README; {defaults.max_streams} on a CPU; env COSYAPP_MAX_STREAMS)",
    )
    add(
        "--first-hop",
        type=int,
        default=int(_env("FIRST_HOP", defaults.first_hop)),
        help="speech tokens in a stream's first audio chunk: fewer reach the first audio sooner, at some "
        "throughput; 25 is upstream's (default: %(default)s; env COSYAPP_FIRST_HOP)",
    )
    add(
        "--flow-cache-gb",
        type=float,
        default=_env("FLOW_CACHE_GB", defaults.flow_cache_gb),
        help="GPU memory for the incremental streaming flow, which computes only each chunk's new frames "
        "(about 29 MB per 50 frames of a stream at full size, 115 MB with --no-flow-cache-inputs); 0 "
        "recomputes every chunk's prefix as upstream (default: 70%% of the GPU memory free once the LM "
        "engine has started; off on a CPU; env COSYAPP_FLOW_CACHE_GB)",
    )
    add(
        "--chunked-final",
        action="store_true",
        default=_flag("CHUNKED_FINAL"),
        help="compute a stream's last chunk incrementally with streaming masks, not as upstream's full "
        "attention recompute: faster, different last-chunk audio (env COSYAPP_CHUNKED_FINAL=1)",
    )
    add(
        "--flow-cache-inputs",
        action=argparse.BooleanOptionalAction,
        default=_flag("FLOW_CACHE_INPUTS", defaults.flow_cache_inputs),
        help="the incremental flow keeps each attention's input instead of its keys and values: four times "
        "the streams per GB, the same audio (default: %(default)s; env COSYAPP_FLOW_CACHE_INPUTS)",
    )
    add(
        "--text-lanes",
        type=int,
        default=int(_env("TEXT_LANES", defaults.text_lanes)),
        help="texts prepared at once, each in a thread and a wetext process of its own; 0 = one per 4 CPU "
        "cores, up to 4 (default: %(default)s; env COSYAPP_TEXT_LANES)",
    )
    add(
        "--gather-ms",
        type=float,
        default=float(_env("GATHER_MS", defaults.gather_ms)),
        help="how long the idle token2wav worker waits for more chunks before its step (at most 20 ms); "
        "0 = none (default: %(default)s; env COSYAPP_GATHER_MS)",
    )
    add(
        "--expect-ms",
        type=float,
        default=float(_env("EXPECT_MS", defaults.expect_ms)),
        help="how long a token2wav step waits, at most, for the chunks of streams a token or two short "
        "of theirs; 0 = none (default: %(default)s; env COSYAPP_EXPECT_MS)",
    )
    add(
        "--compile-flow",
        action=argparse.BooleanOptionalAction,
        default=None if _env("COMPILE_FLOW", None) is None else _flag("COMPILE_FLOW"),
        help="compile the flow estimator with torch.compile, minutes on a first start while serving eagerly "
        "(kept under --cache-dir); the same audio within float rounding (default: on a GPU; env "
        "COSYAPP_COMPILE_FLOW=1 or 0)",
    )
    add(
        "--compile-hift",
        action=argparse.BooleanOptionalAction,
        default=None if _env("COMPILE_HIFT", None) is None else _flag("COMPILE_HIFT"),
        help="run each of HiFT's Snake activations as one kernel compiled by torch.compile instead of "
        "five (kept under --cache-dir); the same audio within float rounding (default: on a GPU; env "
        "COSYAPP_COMPILE_HIFT=1 or 0)",
    )
    add(
        "--hift-graphs",
        action=argparse.BooleanOptionalAction,
        default=_flag("HIFT_GRAPHS"),
        help="on a GPU, replay HiFT calls from CUDA graphs (one per batch bucket and length) instead of "
        "launching their kernels one by one; the same audio (default: %(default)s; env COSYAPP_HIFT_GRAPHS)",
    )
    add(
        "--lm-in-process",
        action=argparse.BooleanOptionalAction,
        default=_flag("LM_IN_PROCESS"),
        help="step vLLM's engine core on a thread of this process, so the LM's and the flow's GPU "
        "kernels overlap instead of taking turns (default: %(default)s; env COSYAPP_LM_IN_PROCESS)",
    )
    add(
        "--lm-stream-interval",
        type=int,
        default=int(_env("LM_STREAM_INTERVAL", defaults.lm_stream_interval)),
        help="speech tokens vLLM gathers into each output to this process: more cuts the host work per "
        "token, a chunk waits up to that many - 1 steps more (default: %(default)s; env "
        "COSYAPP_LM_STREAM_INTERVAL)",
    )
    add(
        "--lm-sampler-graphs",
        action=argparse.BooleanOptionalAction,
        default=_flag("LM_SAMPLER_GRAPHS", defaults.lm_sampler_graphs),
        help="on a GPU, replay the LM's RAS draw of each decode step from a CUDA graph per batch size: the "
        "same tokens, one launch instead of ~40 (default: %(default)s; env COSYAPP_LM_SAMPLER_GRAPHS)",
    )
    add(
        "--lm-yield-ms",
        type=float,
        default=float(_env("LM_YIELD_MS", defaults.lm_yield_ms)),
        help="on a GPU, the longest the LM waits while a stream's first audio is made, within what playing "
        "streams can spare; 0 = never (default: %(default)s; env COSYAPP_LM_YIELD_MS)",
    )
    add(
        "--token2wav-priority",
        type=int,
        choices=(0, -1),
        default=int(_env("TOKEN2WAV_PRIORITY", defaults.token2wav_priority)),
        help="CUDA stream priority of the flow and HiFT: -1 runs their kernels before the LM's when both "
        "wait, only with --lm-in-process (default: %(default)s; env COSYAPP_TOKEN2WAV_PRIORITY)",
    )
    add(
        "--hift-first",
        action=argparse.BooleanOptionalAction,
        default=_flag("HIFT_FIRST", defaults.hift_first),
        help="on a GPU, HiFT's CUDA stream one priority above the flow's, so a step's audio is not held "
        "behind the next flow call's kernels (default: %(default)s; env COSYAPP_HIFT_FIRST)",
    )
    add(
        "--max-text-chars",
        type=int,
        default=int(_env("MAX_TEXT_CHARS", defaults.max_text_chars)),
        help="longest text accepted per request (default: %(default)s; env COSYAPP_MAX_TEXT_CHARS)",
    )
    add(
        "--slowest-speech-rate",
        type=float,
        default=float(_env("SLOWEST_SPEECH_RATE", defaults.slowest_speech_rate)),
        help="syllables per second: a sentence may make at most its syllables at this rate in seconds "
        "of audio (at least 2 s); one that runs longer is cut with a note; 0: no such limit "
        "(default: %(default)s; env COSYAPP_SLOWEST_SPEECH_RATE)",
    )
    add(
        "--max-request-audio-s",
        type=float,
        default=float(_env("MAX_REQUEST_AUDIO_S", defaults.max_request_audio_s)),
        help="seconds of audio one request may make in all; a request that reaches it ends with a note "
        "(default: %(default)s; env COSYAPP_MAX_REQUEST_AUDIO_S)",
    )
    add(
        "--max-upload-mb",
        type=int,
        default=int(_env("MAX_UPLOAD_MB", defaults.max_upload_mb)),
        help="largest voice recording accepted, in MB; larger uploads are refused before they are read "
        "(default: %(default)s; env COSYAPP_MAX_UPLOAD_MB)",
    )
    add(
        "--auth",
        default=_env("AUTH", None),
        metavar="USER:PASSWORD",
        help="require this login for the web UI and its Gradio API (default: none; env COSYAPP_AUTH)",
    )
    add(
        "--api-key",
        default=_env("API_KEY", None),
        help="require 'Authorization: Bearer KEY' on /v1/* (default: none; prefer env COSYAPP_API_KEY, "
        "which other users of the machine cannot read from the process list)",
    )
    add(
        "--cors-origins",
        default=_env("CORS_ORIGINS", ""),
        metavar="ORIGIN,...",
        help="browser origins allowed to call the API, comma-separated, e.g. https://app.example.com, or * "
        "for any (default: none, CORS off; env COSYAPP_CORS_ORIGINS)",
    )
    add(
        "--shutdown-timeout",
        type=float,
        default=float(_env("SHUTDOWN_TIMEOUT", defaults.shutdown_timeout)),
        help="on SIGTERM, seconds running requests may take to finish before they are cancelled "
        "(default: %(default)s; env COSYAPP_SHUTDOWN_TIMEOUT)",
    )
    add(
        "--cache-dir",
        type=Path,
        default=Path(_env("CACHE_DIR", defaults.cache_dir)),
        help="generated files: the demo model, the vLLM export (default: %(default)s; env COSYAPP_CACHE_DIR)",
    )
    add(
        "--data-dir",
        type=Path,
        default=Path(_env("DATA_DIR", defaults.data_dir)),
        help="saved voices and their features (default: %(default)s; env COSYAPP_DATA_DIR)",
    )
    add(
        "--replicas",
        type=int,
        default=int(_env("REPLICAS", defaults.replicas)),
        help="pipelines to serve from, each with its own engines, through Ray Serve (pip install "
        "'cosyapp[cluster]'); the page and the API stay one, in this process; RAY_ADDRESS joins a "
        "running Ray cluster (default: %(default)s, no Ray; env COSYAPP_REPLICAS; docs/cluster.md)",
    )
    add(
        "--gpus-per-replica",
        type=float,
        default=_env("GPUS_PER_REPLICA", None),
        help="with --replicas: GPUs each replica holds, e.g. 0.5 puts two on a card (default: 1 where "
        "Ray sees GPUs, else 0; env COSYAPP_GPUS_PER_REPLICA)",
    )
    return parser


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from ``argv`` (default: sys.argv) and the environment; exits with a message when invalid."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 1 <= args.port <= 65535:
        parser.error("--port must be between 1 and 65535")
    if args.max_upload_mb < 1:
        parser.error("--max-upload-mb must be at least 1")
    if args.auth is not None:
        user, _, password = args.auth.partition(":")
        if not user or not password:
            parser.error("--auth must be USER:PASSWORD, both non-empty")
        args.auth = (user, password)
    if args.api_key is not None and not args.api_key.strip():
        parser.error("--api-key must not be empty")
    args.cors_origins = tuple(o.strip().rstrip("/") for o in args.cors_origins.split(",") if o.strip())
    if args.shutdown_timeout < 0:
        parser.error("--shutdown-timeout must be 0 or more")
    if args.replicas < 1:
        parser.error("--replicas must be at least 1")
    if args.gpus_per_replica is not None and args.gpus_per_replica < 0:
        parser.error("--gpus-per-replica must be 0 or more")
    if args.__dict__.pop("no_asr"):
        args.asr_model = None
    args.card_sized = tuple(name for name in CARD_SIZED if getattr(args, name) is None)
    for name in args.card_sized:
        setattr(args, name, getattr(DEFAULTS, name))
    settings = Settings(**vars(args))
    try:
        settings.serve_options()
    except OptionError as e:
        parser.error(e.flag())
    return settings

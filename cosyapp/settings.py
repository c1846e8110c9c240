"""Every knob of cosyapp in one place: command-line flags, each with a COSYAPP_* environment default."""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REPO = "FunAudioLLM/CosyVoice2-0.5B"
DEFAULT_HOME = Path.home() / ".cache" / "cosyapp"


@dataclass(frozen=True)
class Settings:
    """Validated settings of one cosyapp process."""

    model: str = DEFAULT_REPO
    demo: bool = False
    device: str | None = None
    engine: str = "auto"
    host: str = "127.0.0.1"
    port: int = 7860
    share: bool = False
    gpu_memory_utilization: float = 0.3
    max_streams: int = 64
    max_text_chars: int = 5000
    cache_dir: Path = DEFAULT_HOME
    data_dir: Path = DEFAULT_HOME / "data"


def _env(name: str, default: object) -> str | None:
    value = os.environ.get(f"COSYAPP_{name}")
    return value if value is not None else (None if default is None else str(default))


def _flag(name: str) -> bool:
    return os.environ.get(f"COSYAPP_{name}", "0").lower() in ("1", "true", "yes")


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
        "--device",
        default=_env("DEVICE", None),
        help="torch device, e.g. cuda, cuda:1 or cpu (default: cuda when available; env COSYAPP_DEVICE)",
    )
    add(
        "--engine",
        choices=["auto", "vllm", "torch"],
        default=_env("ENGINE", defaults.engine),
        help="speech-token LM engine: vllm, torch, or auto = vllm when installed and on a GPU "
        "(default: %(default)s; env COSYAPP_ENGINE)",
    )
    add(
        "--host",
        default=_env("HOST", defaults.host),
        help="address to serve on (default: %(default)s; env COSYAPP_HOST)",
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
        default=float(_env("GPU_MEMORY_UTILIZATION", defaults.gpu_memory_utilization)),
        help="fraction of the GPU's memory vLLM may take for the LM (default: %(default)s; "
        "env COSYAPP_GPU_MEMORY_UTILIZATION)",
    )
    add(
        "--max-streams",
        type=int,
        default=int(_env("MAX_STREAMS", defaults.max_streams)),
        help="requests synthesised at once; more wait in a queue "
        "(default: %(default)s; env COSYAPP_MAX_STREAMS)",
    )
    add(
        "--max-text-chars",
        type=int,
        default=int(_env("MAX_TEXT_CHARS", defaults.max_text_chars)),
        help="longest text accepted per request (default: %(default)s; env COSYAPP_MAX_TEXT_CHARS)",
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
    return parser


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from ``argv`` (default: sys.argv) and the environment; exits with a message when invalid."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0.05 <= args.gpu_memory_utilization <= 0.95:
        parser.error("--gpu-memory-utilization must be between 0.05 and 0.95")
    if args.max_streams < 1:
        parser.error("--max-streams must be at least 1")
    if not 1 <= args.port <= 65535:
        parser.error("--port must be between 1 and 65535")
    if args.max_text_chars < 1:
        parser.error("--max-text-chars must be at least 1")
    return Settings(**{k: v for k, v in vars(args).items()})

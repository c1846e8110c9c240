"""Every knob of cosyapp in one place: command-line flags, each with a COSYAPP_* environment default."""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_REPO = "FunAudioLLM/CosyVoice2-0.5B"


@dataclass(frozen=True)
class Settings:
    """Validated settings of one cosyapp process."""

    model: str = DEFAULT_REPO
    demo: bool = False
    device: str | None = None
    cache_dir: Path = Path.home() / ".cache" / "cosyapp"


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(f"COSYAPP_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="app.py",
        description="cosyapp: CosyVoice 2 text-to-speech for many sessions from one shared pipeline.",
    )
    parser.add_argument(
        "--model",
        default=_env("MODEL", DEFAULT_REPO),
        help="model folder in the official CosyVoice2 layout, or a hub repo id to download "
        "(default: %(default)s; env COSYAPP_MODEL)",
    )
    parser.add_argument(
        "--demo",
        action="store_true",
        default=_env("DEMO", "0") == "1",
        help="use a tiny random-weight model written locally instead of real weights: for trying the "
        "interface without a download; it speaks noise (env COSYAPP_DEMO=1)",
    )
    parser.add_argument(
        "--device",
        default=_env("DEVICE", None),
        help="torch device, e.g. cuda, cuda:1 or cpu (default: cuda when available; env COSYAPP_DEVICE)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(_env("CACHE_DIR", str(Settings.cache_dir))),
        help="where cosyapp keeps generated files such as the demo model (default: %(default)s; "
        "env COSYAPP_CACHE_DIR)",
    )
    return parser


def parse_settings(argv: list[str] | None = None) -> Settings:
    """Settings from ``argv`` (default: sys.argv) and the environment."""
    args = build_parser().parse_args(argv)
    return Settings(model=args.model, demo=args.demo, device=args.device, cache_dir=args.cache_dir)

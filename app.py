"""cosyapp entry point: flags and environment -> Settings -> model -> (web app)."""

import sys

from cosyapp.settings import Settings, parse_settings


def model_source(settings: Settings) -> str:
    """The model folder or repo id to load; in demo mode, a tiny model written once to the cache."""
    if not settings.demo:
        return settings.model
    from cosyapp.models.tiny import write_tiny_model

    folder = settings.cache_dir / "tiny-model"
    if not (folder / "hift.pt").is_file():
        write_tiny_model(folder)
    return str(folder)


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    from cosyapp.models.checkpoint import load_model

    model = load_model(model_source(settings), device=settings.device)
    print(f"loaded {model.model_dir} on {model.device}")
    print("the web interface is not part of this build yet; the model loaded and is ready", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

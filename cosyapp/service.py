"""Everything one cosyapp process serves with, built once from Settings: the Pipeline and the voices.

The UI and the HTTP API both take a ``Service``; neither touches torch.
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cosyapp.asr.transcriber import Transcriber
from cosyapp.engine.build import build_pipeline
from cosyapp.engine.pipeline import Pipeline
from cosyapp.frontend.voices import VoiceLibrary
from cosyapp.models.checkpoint import ModelFolderError, load_model, resolve_model_dir
from cosyapp.previews import VoicePreviews
from cosyapp.settings import DEFAULT_REPO, Settings

if TYPE_CHECKING:
    from cosyapp.cluster.ingress import ClusterPipeline

log = logging.getLogger(__name__)


@dataclass
class Service:
    """The shared state of the process. ``demo_reason`` is set (and shown in the page) when the
    model has random weights, saying why. ``asr`` transcribes voice prompts (None: ``--no-asr``).
    ``previews`` makes and keeps each voice's preview through the same Pipeline. With ``--replicas``
    above 1 the pipeline is a ``ClusterPipeline``: the same interface, served by Ray Serve replicas."""

    settings: Settings
    pipeline: "Pipeline | ClusterPipeline"
    voices: VoiceLibrary
    model_dir: Path
    demo_reason: str | None = None
    asr: Transcriber | None = None
    previews: VoicePreviews = field(init=False)

    def __post_init__(self):
        self.previews = VoicePreviews(self.pipeline, self.voices, self.model_dir, self.settings.data_dir)


def demo_model(settings: Settings) -> Path:
    """The tiny random-weight model, written once under the cache folder."""
    from cosyapp.modelgen.tiny import write_tiny_model

    folder = settings.cache_dir / "tiny-model-paced"  # a new name: older caches hold an unpaced one
    if not (folder / "speech_tokenizer_v2.onnx").is_file():
        write_tiny_model(folder)
    return folder


def choose_model(settings: Settings) -> tuple[Path, str | None]:
    """(model folder, demo reason). Falls back to the demo model only when the default model cannot be
    had (e.g. offline); a model the user named explicitly must load, or this raises ModelFolderError."""
    if settings.demo:
        return demo_model(settings), "started with --demo"
    try:
        return resolve_model_dir(settings.model), None
    except ModelFolderError as e:
        if settings.model != DEFAULT_REPO:
            raise
        log.warning("%s; starting with the demo model instead", e)
        return demo_model(settings), f"{DEFAULT_REPO} could not be downloaded ({type(e).__name__})"


def build_service(settings: Settings, demo_reason: str | None = None) -> Service:
    """Load the model, build the Pipeline and the voice library (engines are started by the caller).

    ``demo_reason`` given: serve the demo model, saying why (e.g. a Space without a GPU)."""
    from cosyapp.frontend.voice import VoiceFrontend

    folder, demo_reason = (demo_model(settings), demo_reason) if demo_reason else choose_model(settings)
    if settings.replicas > 1:  # each replica loads the model; voices are made here, on the CPU
        from cosyapp.cluster.ingress import launch

        pipeline, voice_device = launch(settings, folder), "cpu"
    else:
        model = load_model(folder, device=settings.device)
        pipeline, voice_device = build_pipeline(model, settings.serve_options()), model.device
    voices = VoiceLibrary(
        settings.data_dir, VoiceFrontend(folder, voice_device), spk2info=folder / "spk2info.pt"
    )
    # Loaded on first use; with a demo TTS model, the demo ASR model too (no download for either).
    asr = None
    if settings.asr_model is not None:
        asr = Transcriber(settings.asr_model, settings.device, settings.cache_dir, demo_reason is not None)
    return Service(settings, pipeline, voices, folder, demo_reason, asr)

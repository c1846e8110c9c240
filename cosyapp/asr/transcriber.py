"""The process's one speech recogniser: loaded on first use, shared by every session and API call,
batched, in its own thread.

``Transcriber.transcribe`` (blocking; call it off the event loop) and ``transcribe_async`` hand a
recording to the ASR thread. The thread loads the model the first time, then takes every recording
waiting when it is free as one batch, so uploads that arrive together are transcribed together.

The model is a hub repo id or a folder in the hub's layout. The default repo, when it cannot be had
(offline, not cached), is replaced by the tiny random-weight model of ``modelgen/tiny_asr.py``, as the
TTS model is by the demo model, and its transcripts are marked as demo output; so is every transcript
in demo mode. A model named explicitly that cannot be loaded makes every transcription fail with
``TranscriptionUnavailableError``, whose message says why and what to do; a later request tries again.
"""

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from cosyapp.asr.whisper import LANGUAGES, Transcript, WhisperASR
from cosyapp.errors import UserError
from cosyapp.frontend.audio import MAX_PROMPT_SECONDS, PromptAudio
from cosyapp.settings import DEFAULT_ASR_REPO

log = logging.getLogger(__name__)

MAX_BATCH = 16
TINY_FOLDER = "tiny-asr"


class TranscriptionUnavailableError(UserError):
    """No speech recogniser: switched off, or its model cannot be loaded."""

    param = "transcript"


@dataclass
class _Job:
    audio: PromptAudio
    language: str | None
    result: Future


class Transcriber:
    """Transcribes prompt recordings with Whisper (``asr/whisper.py``) in one background thread.

    Args:
        model: hub repo id or folder in the hub's layout.
        device: torch device for the model ("cuda" when one is present, else "cpu" if None).
        cache_dir: where the tiny demo model is written.
        demo: use the tiny random-weight model (demo mode).
        max_batch: most recordings transcribed in one batch.
    """

    def __init__(
        self,
        model: str,
        device: str | None,
        cache_dir: Path,
        demo: bool = False,
        max_batch: int = MAX_BATCH,
    ):
        self.source, self.device, self.cache_dir = model, device, cache_dir
        self.demo, self.max_batch = demo, max_batch
        self.batches: list[int] = []  # sizes of the batches run, oldest first (the last 100)
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._asr: WhisperASR | None = None
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None

    def transcribe(self, audio: PromptAudio, language: str | None = None) -> Transcript:
        """The transcript of ``audio`` (at most MAX_PROMPT_SECONDS), blocking until it is done.

        ``language`` (one of LANGUAGES) skips detection. Raises ``TranscriptionUnavailableError``
        when transcription is off or its model cannot be loaded.
        """
        return self.submit(audio, language).result()

    async def transcribe_async(self, audio: PromptAudio, language: str | None = None) -> Transcript:
        """``transcribe`` for the event loop: it waits without blocking the loop."""
        return await asyncio.wrap_future(self.submit(audio, language))

    def submit(self, audio: PromptAudio, language: str | None = None) -> Future:
        """Queue ``audio`` for the ASR thread; the future resolves to its ``Transcript``."""
        assert audio.seconds <= MAX_PROMPT_SECONDS, "Whisper hears at most 30 s at once"
        assert language is None or language in LANGUAGES, language
        job = _Job(audio, language, Future())
        self._jobs.put(job)
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="asr", daemon=True)
                self._thread.start()
        return job.result

    def _run(self) -> None:
        while True:
            batch = [self._jobs.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            self._serve(batch)

    def _serve(self, batch: list[_Job]) -> None:
        """Transcribe one batch, loading the model first if needed; every job gets its result or
        the error (a load failure is the user's to read, anything else is a bug to log). Jobs whose
        caller cancelled them are dropped; the others' futures report running from here on."""
        batch = [job for job in batch if job.result.set_running_or_notify_cancel()]
        if not batch:
            return
        try:
            asr = self._model()
            transcripts = asr.transcribe([job.audio for job in batch], [job.language for job in batch])
        except TranscriptionUnavailableError as error:
            for job in batch:
                job.result.set_exception(error)
            return
        except Exception as error:
            log.exception("transcribing a batch of %d failed", len(batch))
            for job in batch:
                job.result.set_exception(error)
            return
        self.batches = [*self.batches[-99:], len(batch)]
        for job, transcript in zip(batch, transcripts, strict=True):
            job.result.set_result(transcript)

    def _model(self) -> WhisperASR:
        """The loaded model; loads it on first use (in the ASR thread only)."""
        if self._asr is None:
            import torch

            folder, demo = self._folder()
            device = torch.device(self.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            log.info("loading the speech recogniser %s on %s", folder, device)
            self._asr = WhisperASR(folder, device, demo=demo)
        return self._asr

    def _folder(self) -> tuple[Path, bool]:
        """(model folder, whether it is the demo model)."""
        from cosyapp.models.checkpoint import ModelFolderError

        if self.demo:
            return self._tiny(), True
        try:
            return resolve_asr_model(self.source), False
        except ModelFolderError as error:
            if self.source != DEFAULT_ASR_REPO:
                raise TranscriptionUnavailableError(
                    f"Automatic transcription is unavailable: {error}. Type what is said in the recording."
                ) from error
            log.warning("%s; transcribing with the demo ASR model (random weights) instead", error)
            return self._tiny(), True

    def _tiny(self) -> Path:
        from cosyapp.modelgen.tiny_asr import write_tiny_asr_model

        folder = self.cache_dir / TINY_FOLDER
        if not (folder / "model.safetensors").is_file():
            write_tiny_asr_model(folder)
        return folder


def available(asr: Transcriber | None) -> Transcriber:
    """``asr``, or for None (``--no-asr``) raise ``TranscriptionUnavailableError`` saying it is off."""
    if asr is None:
        raise TranscriptionUnavailableError(
            "Automatic transcription is off on this server: type what is said in the recording."
        )
    return asr


def resolve_asr_model(source: str) -> Path:
    """The folder of ``source``: a folder path, or a hub repo id (the cached snapshot, else downloaded).

    Raises ``ModelFolderError`` naming the source when it is neither, or cannot be downloaded.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from cosyapp.models.checkpoint import ModelFolderError

    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelFolderError(f"{source} holds no config.json: it is not a Whisper model folder")
        return path
    if path.exists() or source.count("/") != 1:
        raise ModelFolderError(f"{source} is neither a model folder nor a hub repo id")
    try:
        return Path(snapshot_download(source, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached yet: download it
    try:
        return Path(snapshot_download(source))
    except Exception as error:
        raise ModelFolderError(
            f"the ASR model {source} is not cached and could not be downloaded ({type(error).__name__}); "
            "start with --asr-model FOLDER (a copy of it) or --no-asr"
        ) from error

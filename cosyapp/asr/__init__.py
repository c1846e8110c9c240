"""Speech recognition of prompt recordings (Whisper through transformers): ``Transcriber``."""

from cosyapp.asr.transcriber import DEFAULT_ASR_REPO, Transcriber, TranscriptionUnavailableError
from cosyapp.asr.whisper import LANGUAGES, Transcript

__all__ = ["DEFAULT_ASR_REPO", "LANGUAGES", "Transcriber", "Transcript", "TranscriptionUnavailableError"]

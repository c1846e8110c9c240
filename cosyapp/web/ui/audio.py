"""The whole clips of the web UI as WAV files to download (the streaming player's chunks are in
``player.py``)."""

import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from cosyapp.codec import wav


class ClipFolder:
    """Whole clips as WAV files for the download button, in a temporary folder of this process.

    Gradio copies each returned file into its own cache, so ours only needs to outlive that copy:
    files older than ``max_age_s`` are removed whenever a new one is written.
    """

    def __init__(self, max_age_s: float = 600.0):
        self.folder = Path(tempfile.mkdtemp(prefix="cosyapp-clips-"))
        self.max_age_s = max_age_s

    def write(self, samples: np.ndarray, sample_rate: int) -> Path:
        """Write ``samples`` as ``speech-<id>.wav`` and return its path."""
        self._prune()
        path = self.folder / f"speech-{uuid.uuid4().hex[:10]}.wav"
        path.write_bytes(wav(samples, sample_rate))
        return path

    def _prune(self) -> None:
        cutoff = time.time() - self.max_age_s
        for old in self.folder.glob("*.wav"):
            if old.stat().st_mtime < cutoff:
                old.unlink(missing_ok=True)

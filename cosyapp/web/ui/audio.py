"""Audio plumbing of the web UI: WAV files to download, and the ffmpeg Gradio's streaming needs.

Gradio's streaming player re-encodes every chunk with an ffmpeg binary found on PATH, and it treats
numpy chunks badly (peak-normalised one at a time, cached by content hash), so chunks go out as
16-bit WAV bytes (``cosyapp.codec.wav``).
"""

import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from cosyapp.codec import wav

log = logging.getLogger(__name__)


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


def ensure_ffmpeg(bin_dir: Path) -> str:
    """Path of the ``ffmpeg`` that streaming will use.

    When none is on PATH, links the static binary of the ``imageio-ffmpeg`` package as
    ``bin_dir/ffmpeg`` and puts ``bin_dir`` first on PATH (of this process, which Gradio searches
    for every stream).
    """
    found = shutil.which("ffmpeg")
    if found:
        return found
    import imageio_ffmpeg

    bin_dir.mkdir(parents=True, exist_ok=True)
    link = bin_dir / "ffmpeg"
    target = imageio_ffmpeg.get_ffmpeg_exe()
    if not link.exists() or link.resolve() != Path(target).resolve():
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    log.info("no ffmpeg on PATH; using imageio-ffmpeg's binary %s", target)
    return str(link)

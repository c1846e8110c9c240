"""Prepare an uploaded prompt as a careful user would before cloning a voice from it.

Upstream's web UI trims a prompt's leading and trailing silence (librosa, 60 dB below the peak),
lowers its peak to 0.8 and pads 0.2 s; CosyVoice 2 clones worse from long prompts and refuses more
than 30 s. Here, on the page's and the API's uploads (built-in voices are used as they are):

1. speech is told from silence by frame level, against the recording's own noise floor;
2. silence before the first and after the last speech is cut, keeping ``PAD_S`` around the speech;
3. a recording with more than ``MAX_SECONDS`` of it keeps its best part: the window between two
   pauses (never inside a word) with the most speech, no longer than ``MAX_SECONDS``;
4. the speech is brought to ``TARGET_DBFS`` RMS, its peak kept at or below ``MAX_PEAK``.

The result says what was done, so the page can show the clip that will be used and why.
"""

import bisect
from dataclasses import dataclass

import numpy as np

from cosyapp.frontend.audio import (
    MIN_PROMPT_SECONDS,
    AudioSource,
    AudioTooShortError,
    PromptAudio,
    load_prompt_audio,
)

MAX_UPLOAD_SECONDS = 300.0  # longer uploads are refused; shorter ones are cut to their best part
MAX_SECONDS = 15.0  # the longest prompt kept: enough of a voice, and a short LM and flow prompt
PAD_S = 0.2  # silence kept around the speech, as upstream's web UI pads
PAUSE_S = 0.15  # a gap in the speech this long is a pause a window may start or end in
MIN_BURST_S = 0.05  # louder runs shorter than this are clicks, not speech
TARGET_DBFS = -20.0  # RMS of the speech after preparation
MAX_PEAK = 0.8  # upstream's peak limit for prompts
FRAME_S, HOP_S = 0.02, 0.01
# Speech is at most SPEECH_RANGE_DB below the loudest frame, at least FLOOR_MARGIN_DB above the
# noise floor (the 10th percentile of the frames above DIGITAL_SILENCE_DBFS: a recording's noise,
# not the zeros an editor pads with), and anything within NEVER_CUT_DB of the peak is speech.
SPEECH_RANGE_DB, FLOOR_MARGIN_DB, NEVER_CUT_DB = 50.0, 10.0, 15.0
DIGITAL_SILENCE_DBFS = -90.0


@dataclass(frozen=True)
class PreparedPrompt:
    """The prompt that will be used: ``audio`` is ``original[start_s:end_s]`` times ``gain_db``;
    ``cut`` tells a long recording cut to its best part from one only trimmed of its silence."""

    audio: PromptAudio
    original_seconds: float
    start_s: float
    end_s: float
    gain_db: float
    cut: bool

    def summary(self) -> str:
        """One line for the user: the clip's length, which part of the recording it is, the gain."""
        part = f"{self.start_s:.1f}-{self.end_s:.1f} s of {self.original_seconds:.1f} s"
        used = f"{self.audio.seconds:.1f} s ({part})"
        if self.cut:
            what = f"the best part of a long recording (at most {MAX_SECONDS:g} s are used)"
        elif self.audio.seconds < self.original_seconds - 0.05:
            what = "silence trimmed"
        else:
            what = "nothing trimmed"
        return f"Using {used}: {what}; level {self.gain_db:+.0f} dB."


def read_upload(source: AudioSource, max_mb: float) -> PreparedPrompt:
    """Read an uploaded recording (any format ``load_prompt_audio`` takes, up to MAX_UPLOAD_SECONDS)
    and prepare it. Raises the ``VoiceError`` subclasses of ``load_prompt_audio`` and
    ``AudioTooShortError`` when too little speech is left once the silence is trimmed."""
    return prepare_prompt(load_prompt_audio(source, max_mb=max_mb, max_seconds=MAX_UPLOAD_SECONDS))


def prepare_prompt(audio: PromptAudio, max_seconds: float = MAX_SECONDS) -> PreparedPrompt:
    """Trim, cut to the best part and level ``audio`` (a validated recording); see the module's steps.

    Raises ``AudioTooShortError`` when less than MIN_PROMPT_SECONDS remain."""
    rate, hop = audio.sample_rate, round(HOP_S * audio.sample_rate)
    levels = frame_levels(audio.samples, rate)
    speech = speech_frames(levels)
    first, last = _span(speech)
    lo, hi = 0, len(levels)
    cut = last - first > (max_seconds - 2 * PAD_S) / HOP_S
    if cut:
        first, last, lo, hi = _best_window(speech, first, last, int((max_seconds - 2 * PAD_S) / HOP_S))
    pad = round(PAD_S / HOP_S)
    start = max(lo, first - pad) * hop
    end = min(len(audio.samples), min(hi, last + pad) * hop + round(FRAME_S * rate))
    clip = audio.samples[start:end]
    seconds = len(clip) / rate
    if seconds < MIN_PROMPT_SECONDS:
        raise AudioTooShortError(
            f"The recording holds only {seconds:.2f} s of speech once the silence around it is trimmed: "
            f"a voice prompt needs at least {MIN_PROMPT_SECONDS:g} s."
        )
    gain = _gain(levels[first:last][speech[first:last]], float(np.abs(clip).max()))
    leveled = np.ascontiguousarray(clip * np.float32(gain), dtype=np.float32)
    return PreparedPrompt(
        audio=PromptAudio(samples=leveled, sample_rate=rate),
        original_seconds=audio.seconds,
        start_s=start / rate,
        end_s=end / rate,
        gain_db=float(20 * np.log10(gain)),
        cut=cut,
    )


def frame_levels(samples: np.ndarray, rate: int) -> np.ndarray:
    """Mean-square level in dBFS of FRAME_S frames every HOP_S: (frames,)."""
    frame, hop = round(FRAME_S * rate), round(HOP_S * rate)
    count = max(1, 1 + (len(samples) - frame) // hop)
    windows = np.lib.stride_tricks.sliding_window_view(np.pad(samples, (0, frame)), frame)[::hop][:count]
    return 10 * np.log10(np.mean(windows.astype(np.float64) ** 2, axis=1) + 1e-12)


def speech_frames(levels: np.ndarray) -> np.ndarray:
    """Which frames hold speech: above a threshold set by the peak and the noise floor, in runs of
    at least MIN_BURST_S (a click alone is not speech). (frames,) bool."""
    peak = float(levels.max())
    heard = levels[levels > DIGITAL_SILENCE_DBFS]
    floor = float(np.percentile(heard, 10)) if len(heard) else peak
    threshold = min(peak - NEVER_CUT_DB, max(peak - SPEECH_RANGE_DB, floor + FLOOR_MARGIN_DB))
    loud = levels > threshold
    for start, end in _runs(loud):
        if end - start < MIN_BURST_S / HOP_S:
            loud[start:end] = False
    return loud


def _span(speech: np.ndarray) -> tuple[int, int]:
    """First and one-past-last speech frame; the whole recording when no run counts as speech."""
    found = np.flatnonzero(speech)
    return (int(found[0]), int(found[-1]) + 1) if len(found) else (0, len(speech))


def _best_window(speech: np.ndarray, first: int, last: int, max_frames: int) -> tuple[int, int, int, int]:
    """The frames [a, b) within [first, last) with the most speech, at most ``max_frames`` long, that
    start and end at the edge of the speech or at a pause; a plain cut when no pause allows one.

    Returns (a, b, lo, hi): the padding around [a, b) may reach back to ``lo`` and on to ``hi``, the
    middles of the pauses it lies between, never into the speech beyond them.
    """
    pauses = [(first + s, first + e) for s, e in _runs(~speech[first:last]) if e - s >= PAUSE_S / HOP_S]
    # A window starts where speech resumes after a pause and ends where speech stops before one.
    starts = [(first, 0)] + [(e, (s + e) // 2) for s, e in pauses]
    ends = [(s, (s + e) // 2) for s, e in pauses] + [(last, len(speech))]
    end_frames = [b for b, _ in ends]
    counts = np.concatenate([[0], np.cumsum(speech)])
    best, best_speech = (first, first + max_frames, 0, first + max_frames), -1
    for a, lo in starts:
        i = bisect.bisect_right(end_frames, a + max_frames) - 1  # the last end within reach
        b, hi = ends[i] if i >= 0 else (a, a)
        if b > a and (spoken := counts[b] - counts[a]) > best_speech:
            best, best_speech = (a, b, lo, hi), spoken
    return best


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in ``mask``."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist(), strict=True))


def _gain(speech_levels: np.ndarray, peak: float) -> float:
    """Linear gain bringing the speech's RMS to TARGET_DBFS, lowered so the peak stays at MAX_PEAK."""
    rms_db = 10 * np.log10(np.mean(10 ** (speech_levels / 10))) if len(speech_levels) else TARGET_DBFS
    return float(min(10 ** ((TARGET_DBFS - rms_db) / 20), MAX_PEAK / max(peak, 1e-9)))

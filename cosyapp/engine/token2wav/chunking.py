"""How one stream is cut into chunks: the token hop schedule, a chunk-consistent speed change, and
the HiFT overlap that joins consecutive chunks (docs/model.md §8.3-8.5).

All three are per-stream state. Upstream keeps the hop on the model object, so a second request
starts where the first one left off (docs/model.md §8.3); here every stream owns its schedule.
"""

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from cosyapp.models.cosyvoice2 import SAMPLES_PER_FRAME
from cosyapp.options import MAX_HOP

ENCODER_CHUNK = 25  # tokens per static chunk of the flow's streaming masks (50 mel frames)
PRE_LOOKAHEAD = 3  # tokens of right context a chunk call hands the flow beyond its hop
# A stream this many tokens short of its next chunk call tells the worker to expect it (scheduler.py).
SOON_TOKENS = 2
MEL_CACHE_FRAMES = 8
SOURCE_CACHE_SAMPLES = MEL_CACHE_FRAMES * SAMPLES_PER_FRAME  # 3840, also the cross-fade length
# Upstream cross-fades with numpy's symmetric Hamming window in float64 and casts the result back.
_FADE = torch.from_numpy(np.hamming(2 * SOURCE_CACHE_SAMPLES))
_FADE_IN, _FADE_OUT = _FADE[:SOURCE_CACHE_SAMPLES], _FADE[SOURCE_CACHE_SAMPLES:]


@dataclass
class ChunkSchedule:
    """Which tokens each streaming flow call covers (docs/model.md §8.3).

    Hops: first_hop + pad, then doubling up to MAX_HOP (25 + pad, 50, 100, 100, ... by default), where
    pad = ceil(P / 25) * 25 - P makes the first call end on an encoder chunk boundary. A chunk call
    hands the flow tokens[: offset + hop + PRE_LOOKAHEAD] and delivers the mel of tokens
    [offset, offset + hop); the final call (finalize, full attention) delivers the rest.

    Why alignment matters: the streaming masks cut prompt + tokens into 25-token (50-frame) chunks
    counted from position 0 of the prompt. A call whose main sequence ends on a multiple of 25
    (P + offset + hop) gives every frame it delivers its whole chunk, i.e. exactly the values of one
    streaming pass over the whole utterance. A first_hop that is not a multiple of 25 ends the first
    call inside a chunk: the frames of that partial chunk are computed without the chunk's later
    tokens, so they differ from the full-pass values (checked on the tiny model: P = 37, first call
    of 23 tokens -> its last 10 tokens' frames differ by up to 0.05; aligned calls agree to 1e-6).
    Every later hop is therefore stretched to end on the next multiple of 25, so the flow frames of
    all later chunks stay unchanged; only the start of chunk 2, where HiFT re-synthesises the 8 mel
    frames cached from chunk 1, inherits the difference. With the default first_hop = 25 the
    stretch is always 0 and the hops are upstream's.
    """

    prompt_len: int
    first_hop: int = ENCODER_CHUNK
    offset: int = 0  # tokens whose mel has already been scheduled
    base: int = field(init=False)  # the hop before alignment; doubles after every chunk

    def __post_init__(self) -> None:
        if not 1 <= self.first_hop <= MAX_HOP:
            raise ValueError(f"first_hop must be between 1 and {MAX_HOP}, got {self.first_hop}")
        self.base = self.first_hop

    def hop(self) -> int:
        """Tokens the next chunk call delivers."""
        if self.offset == 0:
            return self.base + (-self.prompt_len % ENCODER_CHUNK)
        return self.base + (-(self.prompt_len + self.offset + self.base) % ENCODER_CHUNK)

    def ready(self, available: int) -> bool:
        """Whether `available` tokens are enough for the next chunk call (its hop + lookahead)."""
        return self.due_in(available) <= 0

    def due_in(self, available: int) -> int:
        """Tokens still to come, beyond `available`, before the next chunk call is ready."""
        return self.hop() + PRE_LOOKAHEAD - (available - self.offset)

    def advance(self) -> tuple[int, int]:
        """Take the next chunk: returns (offset, end); the call hands the flow tokens[: end + 3]."""
        start, end = self.offset, self.offset + self.hop()
        self.offset = end
        self.base = min(MAX_HOP, 2 * self.base)
        return start, end


class StreamingSpeedChange:
    """Linear time-stretch (docs/model.md §6.8) of a mel that arrives chunk by chunk.

    Output frame j reads source position s_j = (j + 0.5) * speed - 0.5 (clamped at 0), PyTorch's
    linear rule with align_corners=False, on the global frame grid of the whole stream. Each push
    emits the frames whose two source frames have arrived and keeps the raw frames still needed, so
    the concatenated output does not depend on where the chunks were cut: it is one interpolation of
    the whole streamed mel at ratio `speed`, ending at floor(total / speed) frames. (Non-streaming
    synthesis keeps upstream's F.interpolate(size=int(F / speed)), whose ratio F / size differs from
    `speed` in the last digits.)
    """

    def __init__(self, speed: float):
        self.speed = speed
        self.pending: Tensor | None = None  # raw frames from global index `start` on, (C, n)
        self.start = 0
        self.received = 0
        self.emitted = 0

    def _source(self, first: int, last: int, device: torch.device) -> Tensor:
        j = torch.arange(first, last, device=device, dtype=torch.float64)
        return ((j + 0.5) * self.speed - 0.5).clamp(min=0)

    def push(self, frames: Tensor, final: bool) -> Tensor:
        """Take the next raw frames (C, n); return the stretched frames now complete (C, m)."""
        self.pending = frames if self.pending is None else torch.cat([self.pending, frames], dim=1)
        self.received += frames.shape[1]
        src = self._source(self.emitted, math.floor(self.received / self.speed), frames.device)
        if not final:
            # Hold back output frames whose right neighbour has not arrived yet.
            src = src[: int((src.floor() + 1 < self.received).sum())]
        lo = src.floor().long()
        hi = (lo + 1).clamp(max=self.received - 1)
        weight = (src - lo).to(frames.dtype)
        left, right = self.pending[:, lo - self.start], self.pending[:, hi - self.start]
        out = left * (1 - weight) + right * weight
        self.emitted += out.shape[1]
        keep_from = min(
            int(self._source(self.emitted, self.emitted + 1, frames.device).floor()), self.received
        )
        self.pending = self.pending[:, keep_from - self.start :]
        self.start = keep_from
        return out


@dataclass
class HiFTOverlap:
    """What one stream's HiFT call hands the next: 8 mel frames, 3840 source and speech samples.

    A chunk call holds back its last 3840 samples; the next call re-synthesises them from the cached
    8 mel frames with the cached source (continuous phase), and its first 3840 samples fade from the
    held-back tail into the new audio. Chunk 1 emits 480 F - 3840 samples, middle chunks 480 F, the
    final one 480 (F + 8), F being the new frames of each call.
    """

    mel: Tensor | None = None  # (C, 8) last mel frames given to HiFT
    source: Tensor | None = None  # (1, 3840) last source samples HiFT returned
    speech: Tensor | None = None  # (3840,) held-back speech tail on CPU

    def mel_input(self, new: Tensor) -> Tensor:
        """HiFT's mel for the next call: the cached frames, then the new ones (C, n)."""
        return new if self.mel is None else torch.cat([self.mel, new], dim=1)

    def finish(self, mel: Tensor, speech: Tensor, source: Tensor, final: bool) -> Tensor:
        """Cross-fade HiFT's output for `mel` (speech (L,) on CPU, source (1, L)) with the held-back
        tail and, unless final, keep the new caches; returns the samples to emit."""
        if self.speech is not None:
            faded = speech[:SOURCE_CACHE_SAMPLES].double() * _FADE_IN + self.speech.double() * _FADE_OUT
            speech = torch.cat([faded.to(speech.dtype), speech[SOURCE_CACHE_SAMPLES:]])
        if final:
            return speech
        # Copies, so the stream does not keep a whole batch's tensors alive.
        self.mel = mel[:, -MEL_CACHE_FRAMES:].clone()
        self.source = source[:, -SOURCE_CACHE_SAMPLES:].clone()
        self.speech = speech[-SOURCE_CACHE_SAMPLES:].clone()
        return speech[:-SOURCE_CACHE_SAMPLES]

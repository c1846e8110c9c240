"""The page pool of the incremental streaming flow (flow_cache.py) and what lives in it: each
stream's committed pages and convolution tails, and the prompt pages each voice shares.

A page holds one chunk of frames (50 at full size) for every transformer block, Euler step and CFG
row: their keys and values, or with ``inputs`` the attention's normalised input they are projected
from (a quarter of the bytes at full size, docs/model.md §8.7).
"""

import hashlib
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from cosyapp.engine.token2wav.incremental import ROWS, transformer_stages
from cosyapp.models.flow_estimator import CausalConditionalDecoder

TRASH = 0  # a page no stream owns: padding in page tables, and where uncommitted frames are written


def transformer_count(estimator: CausalConditionalDecoder) -> int:
    return sum(len(blocks) for blocks in transformer_stages(estimator))


def frame_shape(estimator: CausalConditionalDecoder, inputs: bool) -> tuple[int, ...]:
    """What the pool keeps per frame, block, step and CFG row: keys and values (2, heads, head_dim),
    or with ``inputs`` the attention's normalised input (channels,)."""
    attn = estimator.down_blocks[0][1][0].attn1
    return (attn.to_k.in_features,) if inputs else (2, attn.heads, attn.head_dim)


class KVPool:
    """Keys and values of committed frames (or the attention inputs they come from), in pages of one
    chunk, shared by every stream.

    ``kv`` is (blocks, (1 + pages) * ROWS, steps, page, *frame_shape): page p's CFG row r is pool row
    ``p * ROWS + r``, and its frames hold their keys and values side by side (or their attention
    input), so per block and step a call writes its new pages and then reads past and new pages with
    one gather, in the layout the attention (or the key/value projection) reads as it is; page 0 is
    the trash page.
    Pages are reference-counted: a voice's prompt pages are held by the voice cache and by every
    stream that started from them.
    """

    def __init__(
        self,
        estimator: CausalConditionalDecoder,
        pages: int,
        steps: int,
        device: torch.device,
        dtype: torch.dtype,
        inputs: bool = False,
    ):
        self.page = estimator.static_chunk_size
        self.blocks = transformer_count(estimator)
        self.steps = steps
        self.inputs = inputs
        shape = (self.blocks, (pages + 1) * ROWS, steps, self.page, *frame_shape(estimator, inputs))
        self.kv = torch.zeros(shape, device=device, dtype=dtype)
        self.pages = pages  # besides the trash page
        self._refs = [0] * (pages + 1)
        self._free = list(range(pages, TRASH, -1))
        self.least_free = pages  # the fewest pages ever free at once
        self._lock = threading.Lock()  # pages are released from the event loop's side too

    def free(self) -> None:
        """Give the pool's memory back now, for good (its worker is stopped): no page is left."""
        with self._lock:
            self.kv = self.kv.new_empty(0)
            self._free.clear()

    @staticmethod
    def page_bytes(
        estimator: CausalConditionalDecoder, steps: int, dtype: torch.dtype, inputs: bool = False
    ) -> int:
        per_frame = transformer_count(estimator) * steps * ROWS * math.prod(frame_shape(estimator, inputs))
        return per_frame * estimator.static_chunk_size * torch.finfo(dtype).bits // 8

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages (reference count 1), or None when the pool has fewer free."""
        with self._lock:
            if n > len(self._free):
                return None
            pages = [self._free.pop() for _ in range(n)]
            self.least_free = min(self.least_free, len(self._free))
            for p in pages:
                self._refs[p] = 1
            return pages

    def retain(self, pages: list[int]) -> None:
        with self._lock:
            for p in pages:
                assert self._refs[p] > 0
                self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        with self._lock:
            for p in pages:
                self._refs[p] -= 1
                assert self._refs[p] >= 0
                if self._refs[p] == 0:
                    self._free.append(p)


@dataclass
class FlowCache:
    """What one stream keeps of its committed frames: pages in the pool and the convolution tails."""

    pages: list[int] = field(default_factory=list)
    tails: Tensor | None = None  # (steps, ROWS, sum of conv input channels, TAIL); None = zeros
    frames: int = 0  # committed frames, a whole number of pages


@dataclass
class VoiceEntry:
    pages: list[int]
    tails: Tensor
    frames: int


class VoicePages:
    """Prompt pages per voice, least recently used out; at most ``max_pages`` held in all."""

    def __init__(self, pool: KVPool, max_pages: int):
        self.pool = pool
        self.max_pages = max_pages
        self._entries: OrderedDict[str, VoiceEntry] = OrderedDict()
        self._held = 0

    def get(self, key: str) -> VoiceEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: VoiceEntry) -> None:
        """Keep ``entry`` under ``key``, taking over one reference to its pages (given back at once
        when the entry alone is over the limit)."""
        if len(entry.pages) > self.max_pages:
            self.pool.release(entry.pages)
            return
        while self._entries and self._held + len(entry.pages) > self.max_pages:
            _, old = self._entries.popitem(last=False)
            self._held -= len(old.pages)
            self.pool.release(old.pages)
        self._entries[key] = entry
        self._held += len(entry.pages)

    @property
    def held_pages(self) -> int:
        """Pages the cache holds for voices (shared with the streams that started from them)."""
        return self._held


def voice_key(speech_tokens: Tensor, speech_feat: Tensor, embedding: Tensor) -> str:
    """A digest of everything the prompt frames depend on."""
    digest = hashlib.blake2b(digest_size=16)
    for tensor in (speech_tokens, speech_feat, embedding):
        digest.update(tensor.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def voice_frames(prompt_tokens: int, chunk_tokens: int, lookahead: int, ratio: int) -> int:
    """Mel frames of the prompt chunks whose encoder output no generated token can reach."""
    chunks = max(0, (prompt_tokens - lookahead) // chunk_tokens)
    return chunks * chunk_tokens * ratio

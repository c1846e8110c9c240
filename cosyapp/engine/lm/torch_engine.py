"""The speech-token LM in plain PyTorch, for machines without vLLM: many requests, shared decode steps.

One worker thread owns all torch work. Each loop it admits new requests (prefilled together as one
padded batch), then runs ONE forward pass for every running request, each at its own position, over a
KV cache padded to the batch. ``BatchedDecoder`` reuses the weights of the HF ``Qwen2Model`` module by
module but keeps its own cache, so it does not depend on transformers' cache classes.
"""

import asyncio
import dataclasses
import logging
import queue
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from cosyapp.engine.lm.base import LMRequest, LMStats
from cosyapp.models.lm import Qwen2LM
from cosyapp.models.sampling import STOP_TOKENS, draw_tokens, ras_distribution, recent_window, uniform_bits
from cosyapp.options import DEFAULTS

log = logging.getLogger(__name__)

CACHE_CHUNK = 256  # the cache grows by this many positions, so growing (a copy) is rare


@dataclass
class KVCache:
    """Keys and values of every layer, (B, kv_heads, capacity, head_dim) each; row b is one sequence.

    Row b's entries past its current length are garbage that the position mask hides.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    def reserve(self, length: int) -> None:
        """Grow every buffer to hold at least ``length`` positions."""
        if length > self.capacity:
            pad = -(-length // CACHE_CHUNK) * CACHE_CHUNK - self.capacity
            self.keys = [F.pad(k, (0, 0, 0, pad)) for k in self.keys]
            self.values = [F.pad(v, (0, 0, 0, pad)) for v in self.values]

    def keep(self, rows: list[int]) -> None:
        """Keep only these batch rows, in this order."""
        index = torch.tensor(rows, dtype=torch.long, device=self.keys[0].device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]

    def extend(self, other: "KVCache") -> None:
        """Append the rows of ``other`` after this cache's rows."""
        self.reserve(other.capacity)
        other.reserve(self.capacity)
        self.keys = [torch.cat(pair) for pair in zip(self.keys, other.keys, strict=True)]
        self.values = [torch.cat(pair) for pair in zip(self.values, other.values, strict=True)]


class BatchedDecoder:
    """The Qwen2 backbone of a ``Qwen2LM`` run over a padded batch with a ``KVCache``.

    Calls the HF modules (norms, projections, MLP, rotary embedding) and replaces only the attention
    bookkeeping: each token attends to the cache entries of its own row at positions <= its own.
    """

    def __init__(self, lm: Qwen2LM):
        self.backbone = lm.llm.model.model
        config = lm.llm.model.config
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.dtype = lm.llm_decoder.weight.dtype
        self.device = lm.llm_decoder.weight.device

    def new_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache for ``batch`` rows with room for ``length`` positions."""
        capacity = -(-max(length, 1) // CACHE_CHUNK) * CACHE_CHUNK
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        layers = range(len(self.backbone.layers))
        return KVCache(
            keys=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers],
            values=[torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in layers],
        )

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Hidden states after the final norm, (B, S, D), writing each token's keys/values to the cache.

        Takes embeds (B, S, D) and positions (B, S) long on CPU: where each token sits in its row.
        Rows shorter than S are right-padded; padded tokens only ever influence padded outputs.
        """
        length = int(positions.max()) + 1
        cache.reserve(length)
        positions = positions.to(self.device)
        x = embeds.to(self.device, self.dtype)
        cos, sin = self.backbone.rotary_emb(x, positions)
        # (B, 1, S, T): a token sees its row's keys up to its own position.
        mask = torch.arange(length, device=self.device) <= positions[:, None, :, None]
        rows = torch.arange(x.shape[0], device=self.device)[:, None].expand_as(positions)
        for i, layer in enumerate(self.backbone.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q, k, v = (self._heads(proj(h)) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache.keys[i][rows, :, positions] = k.transpose(1, 2)
            cache.values[i][rows, :, positions] = v.transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q,
                cache.keys[i][:, :, :length],
                cache.values[i][:, :, :length],
                attn_mask=mask,
                enable_gqa=True,
            )
            x = x + attn.o_proj(out.transpose(1, 2).flatten(2))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.backbone.norm(x)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, heads * head_dim) -> (B, heads, S, head_dim)."""
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)


_END = object()  # sent after a sequence's last tokens


@dataclass(eq=False)  # identity: two requests are never "equal"
class Sequence:
    """One request inside the engine; ``length`` counts its positions in the cache."""

    request: LMRequest
    loop: asyncio.AbstractEventLoop
    outbox: asyncio.Queue
    seed: int  # its draws: the n-th token's uniform comes from (seed, n) (models/sampling.py)
    aborted: threading.Event = field(default_factory=threading.Event)
    generated: list[int] = field(default_factory=list)
    length: int = 0

    def deliver(self, item: object) -> None:
        """Hand tokens, ``_END`` or an exception to the consumer's event loop (from the worker thread)."""
        try:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody will read this sequence again
            self.aborted.set()


class TorchSpeechLM:
    """``SpeechTokenLM`` in plain PyTorch: continuous batching of up to ``max_batch`` requests."""

    def __init__(self, lm: Qwen2LM, max_batch: int = DEFAULTS.max_batch):
        assert max_batch >= 1
        self.lm = lm
        self.max_batch = max_batch
        self.decoder = BatchedDecoder(lm)
        self._inbox: queue.Queue[Sequence | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats = LMStats()
        # Worker-thread state: the running batch (row b of the cache is running[b]) and the queue.
        self._running: list[Sequence] = []
        self._waiting: deque[Sequence] = deque()
        self._cache: KVCache | None = None

    async def start(self) -> None:
        """Start the worker thread; idempotent."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._work, name="torch-speech-lm", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the worker (requests still in it fail with RuntimeError) and free the cache; idempotent."""
        thread, self._thread = self._thread, None  # from here on generate() refuses new requests
        if thread is not None:
            self._stopping = True
            self._inbox.put(None)
            await asyncio.to_thread(thread.join)
            for seq in self._drain_inbox():  # submitted while the worker was finishing
                seq.deliver(RuntimeError("the speech LM engine shut down"))

    def stats(self) -> LMStats:
        """A snapshot of the counters."""
        return dataclasses.replace(self._stats)

    async def generate(self, request: LMRequest) -> AsyncIterator[list[int]]:
        """Yield the request's speech tokens as they are decoded; see ``SpeechTokenLM.generate``.

        Raises RuntimeError if the engine is not started or shuts down meanwhile.
        """
        if self._thread is None:
            raise RuntimeError("TorchSpeechLM is not started; await start() first")
        assert request.prompt_embeds.ndim == 2 and len(request.prompt_embeds) > 0
        seed = secrets.randbits(63) if request.seed is None else request.seed
        seq = Sequence(request, asyncio.get_running_loop(), asyncio.Queue(), seed)
        self._inbox.put(seq)
        try:
            while True:
                items = [await seq.outbox.get()]
                while not seq.outbox.empty():
                    items.append(seq.outbox.get_nowait())
                tokens: list[int] = []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                    if item is not _END:
                        tokens.extend(item)
                if tokens:
                    yield tokens
                if items[-1] is _END:
                    return
        finally:
            seq.aborted.set()  # no-op when it already finished; otherwise the worker drops it

    # Everything below runs on the worker thread.

    def _work(self) -> None:
        with torch.inference_mode():
            while True:
                self._collect(block=not self._running and not self._waiting)
                if self._stopping:
                    break
                try:
                    self._step()
                except Exception as error:  # handed to every consumer it concerns, and logged
                    log.exception("speech LM step failed; failing the running requests")
                    for seq in self._running:
                        failure = RuntimeError(f"the speech LM step failed: {error!r}")
                        failure.__cause__ = error
                        seq.deliver(failure)
                    self._running, self._cache = [], None
                    self._stats.running = 0
        for seq in [*self._running, *self._waiting, *self._drain_inbox()]:
            seq.deliver(RuntimeError("the speech LM engine shut down"))
        self._running, self._waiting, self._cache = [], deque(), None
        self._stats.running = 0

    def _collect(self, block: bool) -> None:
        """Move submitted requests to the waiting queue, blocking for one if ``block``."""
        if block:
            seq = self._inbox.get()
            if seq is not None:
                self._waiting.append(seq)
        self._waiting.extend(self._drain_inbox())

    def _drain_inbox(self) -> list[Sequence]:
        items = []
        while True:
            try:
                seq = self._inbox.get_nowait()
            except queue.Empty:
                return items
            if seq is not None:
                items.append(seq)

    def _step(self) -> None:
        """Drop aborted requests, prefill newcomers, then one decode step for the whole batch."""
        self._keep([b for b, seq in enumerate(self._running) if not seq.aborted.is_set()])
        newcomers: list[Sequence] = []
        while self._waiting and len(self._running) + len(newcomers) < self.max_batch:
            seq = self._waiting.popleft()
            if seq.aborted.is_set():
                continue
            if seq.request.max_tokens <= 0:
                seq.deliver(_END)
                continue
            newcomers.append(seq)
        if newcomers:
            self._prefill(newcomers)
        if self._running:
            self._decode()
        self._stats.running = len(self._running)

    def _prefill(self, newcomers: list[Sequence]) -> None:
        """Run the prompts as one right-padded batch, sample each first token, join the batch."""
        self._running.extend(newcomers)  # first, so that a failure below reaches them too
        prompts = [seq.request.prompt_embeds for seq in newcomers]
        lengths = [len(p) for p in prompts]
        embeds = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)
        positions = torch.arange(embeds.shape[1]).expand(len(prompts), -1)
        cache = self.decoder.new_cache(len(prompts), embeds.shape[1])
        hidden = self.decoder.forward(embeds, positions, cache)
        for seq, length in zip(newcomers, lengths, strict=True):
            seq.length = length
        if self._cache is None:
            self._cache = cache
        else:
            self._cache.extend(cache)
        last = hidden[torch.arange(len(prompts)), torch.tensor(lengths) - 1]
        first = len(self._running) - len(newcomers)
        self._sample(list(range(first, len(self._running))), last)

    def _decode(self) -> None:
        """One forward pass for every running sequence: feed each its last token, sample the next."""
        assert self._cache is not None
        tokens = torch.tensor([seq.generated[-1] for seq in self._running], device=self.decoder.device)
        embeds = self.lm.speech_embedding.weight[tokens][:, None]
        positions = torch.tensor([[seq.length] for seq in self._running])
        hidden = self.decoder.forward(embeds, positions, self._cache)[:, 0]
        for seq in self._running:
            seq.length += 1
        self._stats.last_batch_size = len(self._running)
        self._stats.max_batch_size = max(self._stats.max_batch_size, len(self._running))
        self._sample(list(range(len(self._running))), hidden)

    def _sample(self, rows: list[int], hidden: torch.Tensor) -> None:
        """Draw the next token of ``self._running[rows]`` from their hidden states; emit or finish each."""
        seqs = [self._running[b] for b in rows]
        logits = self.lm.llm_decoder(hidden)
        params = self.lm.sampling
        recent = recent_window([seq.generated for seq in seqs], params.win_size, logits.device)
        eos_allowed = torch.tensor([len(seq.generated) >= seq.request.min_tokens for seq in seqs])
        probs = ras_distribution(logits, recent, eos_allowed.to(logits.device), params)
        # Both engines' draw (models/sampling.py): a row's token depends on its seed, its index and its row.
        bits = uniform_bits([seq.seed for seq in seqs], [len(seq.generated) for seq in seqs])
        drawn = draw_tokens(probs, torch.from_numpy(bits).to(logits.device)).tolist()
        finished = set()
        for b, seq, token in zip(rows, seqs, drawn, strict=True):
            if token in STOP_TOKENS:
                finished.add(b)
                seq.deliver(_END)
                continue
            seq.generated.append(token)
            seq.deliver([token])
            self._stats.tokens_generated += 1
            if len(seq.generated) >= seq.request.max_tokens:
                finished.add(b)
                seq.deliver(_END)
        if finished:
            self._keep([b for b in range(len(self._running)) if b not in finished])

    def _keep(self, rows: list[int]) -> None:
        """Keep only these rows of the running batch (and of its cache)."""
        if len(rows) == len(self._running):
            return
        self._running = [self._running[b] for b in rows]
        if not rows:
            self._cache = None
        else:
            assert self._cache is not None
            self._cache.keep(rows)

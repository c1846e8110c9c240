"""What every speech-token LM engine offers the pipeline (vLLM in ``lm_vllm``, PyTorch in ``lm_torch``)."""

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import torch

from cosyapp.models.sampling import STOP_TOKENS


@dataclass(frozen=True)
class LMRequest:
    """One sentence to decode.

    prompt_embeds (L0, D) float on CPU: the zero-shot prefix built by ``Qwen2LM.prompt_embeds``.
    min_tokens / max_tokens: upstream's length limits (EOS 6561 is masked before min_tokens; decoding
    stops after max_tokens). seed: per-request sampling seed (None: nondeterministic); a request's
    tokens depend only on its own seed and inputs, never on other requests in the batch.
    """

    request_id: str
    prompt_embeds: torch.Tensor
    min_tokens: int
    max_tokens: int
    seed: int | None = None


@dataclass
class LMStats:
    """Engine-wide counters, read without blocking the engine."""

    running: int = 0  # requests being decoded now
    last_batch_size: int = 0  # sequences in the most recent decode step
    max_batch_size: int = 0  # largest decode step so far
    tokens_generated: int = 0  # total speech tokens emitted
    state: str = "serving"  # serving, or restarting after the engine failed (see lm_vllm)
    restarts: int = 0  # times the engine was restarted after a failure
    last_fault: str | None = None  # what the latest failure was, and when (UTC)


class SpeechTokenLM(Protocol):
    """An engine that decodes many requests at once in shared batched steps."""

    async def start(self) -> None:
        """Load and warm up; idempotent."""

    def generate(self, request: LMRequest) -> AsyncIterator[list[int]]:
        """Yield the request's new speech tokens (ids 0-6560) as they are decoded, in order.

        Ends after a stop token (6561-6563, not yielded) or ``max_tokens`` tokens. Closing the
        iterator early (``aclose`` or cancelling the consuming task) aborts the request in the engine.
        """

    def stats(self) -> LMStats:
        """Current counters."""

    async def shutdown(self) -> None:
        """Stop the engine and free its memory; idempotent."""


__all__ = ["STOP_TOKENS", "LMRequest", "LMStats", "SpeechTokenLM"]

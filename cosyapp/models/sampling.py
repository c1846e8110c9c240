"""Speech-token sampling of CosyVoice 2: nucleus + top-k draw with repetition-aware fallback (RAS).

Upstream's rule (docs/model.md §4.5, upstream's current behaviour):

1. before ``min_len`` generated tokens, the EOS logit (6561) is masked; 6562/6563 stay allowed;
2. draw from the shortest prefix of the probability-sorted vocabulary whose mass reaches ``top_p``
   (the token that crosses it is kept), capped at ``top_k`` tokens;
3. if the drawn token occurs at least ``win_size * tau_r`` times among the last ``win_size``
   generated tokens, mask it and redraw from the full distribution.

``ras_sample`` runs this procedure literally (the reference path). ``ras_distribution`` gives the exact
distribution of its outcome, so an engine samples it in one draw at temperature 1: every serving
engine (vLLM through a logits processor, and the batched PyTorch engine) uses that one function.
``draw_tokens`` is both serving engines' draw from it: one uniform per row from the request's seed
and the token's position, so a batch draws with a few kernels, a request's tokens never depend on
the batch it ran in, and the two engines agree for one seed wherever their logits do.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

SPEECH_TOKEN_SIZE = 6561
EOS_TOKEN = 6561
STOP_TOKENS = (6561, 6562, 6563)


@dataclass(frozen=True)
class SamplingParams:
    """The yaml's ``ras_sampling`` arguments plus the LM's length ratios (docs/model.md §4.3)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    def length_limits(self, num_text_tokens: int) -> tuple[int, int]:
        """(min_len, max_len) of generated speech tokens for a sentence of ``num_text_tokens``."""
        return (
            int(num_text_tokens * self.min_token_text_ratio),
            int(num_text_tokens * self.max_token_text_ratio),
        )


def nucleus_keep_mask(probs: torch.Tensor, top_p: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sorted entries the nucleus keeps.

    Takes probs (B, V). Returns (sorted_probs, sorted_ids, keep) where keep (B, V) is True for the
    shortest sorted prefix whose cumulative mass reaches ``top_p``, capped at ``top_k`` entries.
    """
    sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    rank = torch.arange(probs.shape[-1], device=probs.device)
    keep = (mass_before < top_p) & (rank < top_k)
    keep[:, 0] = True
    return sorted_probs, sorted_ids, keep


def ras_sample(
    logits: torch.Tensor,
    recent_tokens: torch.Tensor,
    eos_allowed: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Draw one speech token per row with upstream's RAS rule.

    Takes logits (B, 6564) of ``llm_decoder``; ``recent_tokens`` (B, W) long, the last generated
    tokens of each row (prompt tokens excluded), left-padded with -1 where a row has fewer than W
    (see ``recent_window``);
    ``eos_allowed`` (B,) bool, False while a row has generated fewer than ``min_len`` tokens.
    Returns token ids (B,) long. Temperature is 1.
    """
    logp = logits.float().log_softmax(dim=-1)
    logp[:, EOS_TOKEN] = torch.where(eos_allowed, logp[:, EOS_TOKEN], float("-inf"))

    sorted_probs, sorted_ids, keep = nucleus_keep_mask(logp.softmax(dim=-1), params.top_p, params.top_k)
    kept = torch.where(keep, sorted_probs, 0.0)
    choice = torch.multinomial(kept, 1, generator=generator)
    tokens = sorted_ids.gather(1, choice).squeeze(1)

    window = recent_tokens[:, -params.win_size :]
    repeats = (window == tokens[:, None]).sum(dim=1)
    repeated = repeats >= params.win_size * params.tau_r
    if repeated.any():
        rows = repeated.nonzero().squeeze(1)
        fallback = logp[rows].clone()
        fallback[torch.arange(len(rows), device=logp.device), tokens[rows]] = float("-inf")
        redraw = torch.multinomial(fallback.softmax(dim=-1), 1, generator=generator).squeeze(1)
        tokens = tokens.index_put((rows,), redraw)
    return tokens


def recent_window(
    histories: list[list[int]], win_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The last ``win_size`` tokens of each history as a (B, win_size) long tensor, left-padded with -1."""
    rows = [window_row(h, win_size) for h in histories]
    return torch.tensor(rows, dtype=torch.long, device=device).reshape(len(histories), win_size)


def window_row(history: list[int], win_size: int) -> list[int]:
    """One row of ``recent_window``: the last ``win_size`` tokens, left-padded with -1."""
    return ([-1] * win_size + history[-win_size:])[-win_size:]


def ras_distribution(
    logits: torch.Tensor, recent_tokens: torch.Tensor, eos_allowed: torch.Tensor, params: SamplingParams
) -> torch.Tensor:
    """The exact distribution of ``ras_sample``'s outcome, (B, V) float32 probabilities.

    Same arguments as ``ras_sample``. With p the full softmax (EOS masked while not allowed), K the
    nucleus, p_nuc its renormalised probabilities and W the tokens that would trigger the fallback:
        q(x) = p_nuc(x)[x not in W] + sum_{y in W and K} p_nuc(y) p(x)[x != y] / (1 - p(y)).
    """
    logp = logits.float().log_softmax(dim=-1)
    logp[:, EOS_TOKEN] = torch.where(eos_allowed, logp[:, EOS_TOKEN], float("-inf"))
    p = logp.softmax(dim=-1)  # renormalised after the EOS mask, as upstream's softmax of the scores
    sorted_probs, sorted_ids, keep = nucleus_keep_mask(p, params.top_p, params.top_k)
    kept = torch.where(keep, sorted_probs, 0.0)
    p_nuc = torch.zeros_like(p).scatter_(1, sorted_ids, kept / kept.sum(dim=1, keepdim=True))

    window = recent_tokens[:, -params.win_size :]
    counts = torch.zeros_like(p).scatter_add_(1, window.clamp(min=0), (window >= 0).float())
    triggers = counts >= params.win_size * params.tau_r
    # Mass the nucleus sends to the fallback through y, spread over p without y: p(x) / (1 - p(y)).
    through = torch.where(triggers, p_nuc, 0.0) / (1.0 - p).clamp(min=1e-12)
    q = torch.where(triggers, 0.0, p_nuc) + p * (through.sum(dim=1, keepdim=True) - through)
    return q


_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 words (wrapping arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


def uniform_bits(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """52 random bits (int64, < 2**52) per (seed, position): a counter-based generator, so the
    uniform of a request's n-th token is fixed by its seed and n alone (module docstring)."""
    seed = np.array([s % 2**64 for s in seeds], dtype=np.uint64)
    position = np.array(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):
        words = _mix64(_mix64(seed) + (position + np.uint64(1)) * _GOLDEN)
    return (words >> np.uint64(12)).astype(np.int64)


def draw_tokens(probs: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Token ids (B,) drawn from probs (B, V) by inverse transform with ``uniform_bits`` (B,) int64:
    the first id whose cumulative mass exceeds u * total mass, u = bits / 2**52 in [0, 1); every
    id with zero probability is skipped, since the cumulative mass does not rise there. (With 52
    bits u * total stays below the total in float64, so an id past the last is never asked for.)"""
    cumulative = probs.double().cumsum(dim=-1)
    target = bits.double().mul(2.0**-52).mul(cumulative[:, -1]).unsqueeze(1)
    return torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp_(max=probs.size(1) - 1)

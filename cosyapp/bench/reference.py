"""Text + voice -> 24 kHz speech on the reference path (plain PyTorch, one sentence at a time).

The serving engine batches the same networks across requests; this path is what it is compared with.
"""

import secrets

import numpy as np
import torch

from cosyapp.frontend.text import TextFrontend, log_short_sentences
from cosyapp.frontend.voices import Voice
from cosyapp.models.cosyvoice2 import CosyVoice2


class ReferenceSynthesizer:
    """Zero-shot synthesis as upstream's non-streaming ``inference_zero_shot`` (docs/model.md §8.1)."""

    def __init__(self, model: CosyVoice2, text: TextFrontend):
        self.model = model
        self.text = text

    def synthesize(
        self, text: str, voice: Voice, speed: float = 1.0, seed: int | None = None
    ) -> tuple[int, np.ndarray]:
        """Speak ``text`` in ``voice``; returns (sample rate, float32 samples in [-0.99, 0.99]).

        Sentences are synthesised one after another with the same prompt and concatenated. The same
        ``seed`` gives the same samples; None draws a fresh one. Raises ``TextError`` for unusable text.
        """
        sentences = self.text.prepare(text)
        if voice.prompt_ids is None:
            log_short_sentences(sentences, self.text.normalize_prompt(voice.prompt_text))
        prompt = voice.prompt(self.text)
        seed = secrets.randbits(63) if seed is None else seed
        torch.manual_seed(seed)  # HiFT draws its source noise from the default generator, as upstream
        generator = torch.Generator(self.model.device).manual_seed(seed)
        pieces = [
            self.model.synthesize(torch.tensor(s.ids, dtype=torch.long), prompt, speed, generator)
            for s in sentences
        ]
        wave = torch.cat(pieces) if pieces else torch.zeros(0)
        return self.model.sample_rate, wave.numpy().astype(np.float32)

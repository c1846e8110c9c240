"""Whisper through transformers: batches of prompt recordings -> transcripts and their language.

A model folder in the hub's layout (``openai/whisper-large-v3-turbo``, or the tiny random-weight
one of ``modelgen/tiny_asr.py``) is loaded by ``WhisperProcessor`` and
``WhisperForConditionalGeneration``, in float16 on a GPU. The language is detected among the ones
CosyVoice 2 speaks only (Whisper's own detection picks among 100 and takes Cantonese for Mandarin
or Japanese kanji for Chinese more often), then the batch is decoded greedily in one ``generate``.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from cosyapp.frontend.audio import PromptAudio

# CosyVoice 2's languages, as Whisper's language codes (Cantonese is yue).
LANGUAGES = ("zh", "yue", "en", "ja", "ko")
SAMPLE_RATE = 16_000
# Decoding stops at the end token, or at this many tokens per second of audio (+ a few): fast
# Mandarin reads ~6 characters a second, ~8 Whisper tokens; a looping decode stops here instead.
TOKENS_PER_SECOND, EXTRA_TOKENS = 12, 16


@dataclass(frozen=True)
class Transcript:
    """What Whisper heard: ``text`` in ``language`` (one of LANGUAGES); ``demo`` marks the
    meaningless text of the random-weight demo model."""

    text: str
    language: str
    demo: bool = False


class WhisperASR:
    """A Whisper model on ``device``, loaded from ``folder``; ``transcribe`` runs one batch."""

    def __init__(self, folder: Path, device: torch.device, demo: bool = False):
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        self.device, self.demo = device, demo
        self.processor = WhisperProcessor.from_pretrained(folder)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=dtype)
        self.model = model.to(device).eval()
        self.model.generation_config.max_length = None  # each clip's budget bounds it instead
        self.dtype = dtype
        lang_to_id = self.model.generation_config.lang_to_id
        self.language_ids = torch.tensor([lang_to_id[f"<|{code}|>"] for code in LANGUAGES], device=device)
        self.start_id = self.model.generation_config.decoder_start_token_id
        self.text_vocab = self.processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")

    @torch.inference_mode()
    def transcribe(
        self, clips: list[PromptAudio], languages: list[str | None] | None = None
    ) -> list[Transcript]:
        """Transcripts of ``clips`` (each at most 30 s, any rate), in one batch.

        ``languages`` gives a clip's language (one of LANGUAGES) or None to detect it.
        """
        from cosyapp.frontend.voice import resample

        waves = [resample(torch.from_numpy(c.samples), c.sample_rate, SAMPLE_RATE).numpy() for c in clips]
        features = self.processor.feature_extractor(waves, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        features = features.input_features.to(self.device, self.dtype)
        encoded = self.model.model.encoder(features)
        detected = self._languages(encoded.last_hidden_state)
        chosen = [
            given or found for given, found in zip(languages or [None] * len(clips), detected, strict=True)
        ]
        budgets = [math.ceil(TOKENS_PER_SECOND * c.seconds) + EXTRA_TOKENS for c in clips]
        ids = self.model.generate(
            encoder_outputs=encoded, language=chosen, task="transcribe", max_new_tokens=max(budgets)
        )
        # Text tokens come before <|endoftext|> in Whisper's vocabulary, every special token after it.
        # Each clip keeps its own budget of them, whatever the longest clip of its batch allowed.
        texts = [
            self.processor.tokenizer.decode([t for t in row.tolist() if t < self.text_vocab][:budget])
            for row, budget in zip(ids, budgets, strict=True)
        ]
        return [
            Transcript(" ".join(t.split()), lang, self.demo) for t, lang in zip(texts, chosen, strict=True)
        ]

    def _languages(self, encoded: torch.Tensor) -> list[str]:
        """The most likely of LANGUAGES for each clip: the decoder's first step after
        <|startoftranscript|>, restricted to their language tokens."""
        start = torch.full((len(encoded), 1), self.start_id, device=self.device)
        logits = self.model(encoder_outputs=(encoded,), decoder_input_ids=start).logits[:, -1]
        best = logits[:, self.language_ids].argmax(dim=-1)
        return [LANGUAGES[i] for i in best.tolist()]

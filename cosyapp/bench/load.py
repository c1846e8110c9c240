"""The benchmark's reproducible load: a random-weight model folder, a fixed prompt voice, fixed texts.

The model's stop tokens are unreachable ("endless" random weights), so every sentence decodes exactly
its maximum length, ``int(text tokens * max_token_text_ratio)`` speech tokens
(``SamplingParams.length_limits``), at 25 tokens per second of audio. The text sets:

- ``tokens``: one sentence that decodes exactly ``--tokens`` speech tokens at the model's own ratio
  of 20 speech tokens per text token;
- ``short``, ``medium``, ``long``: English texts of about 20, 100 and 400 characters (the long one of
  three sentences), decoded at 3 speech tokens per text token. The random models' small tokenizer
  spends about 0.6 tokens per character, so this is about 14 characters per second of audio, the
  pace of spoken English, and the audio of each text has a realistic length.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cosyapp.frontend.features import VoiceFeatures
from cosyapp.frontend.text import TextFrontend
from cosyapp.frontend.voices import Voice, VoiceInfo
from cosyapp.modelgen.tiny import write_full_size_model, write_random_model
from cosyapp.models.cosyvoice2 import CosyVoice2
from cosyapp.models.sampling import SamplingParams

TOKENS_PER_SECOND = 25
MODEL_RATIO = SamplingParams().max_token_text_ratio  # the random models keep upstream's 20
REALISTIC_RATIO = 3.0
REALISTIC_TEXTS = {
    "short": "Hello, how are you?",
    "medium": (
        "Your order has shipped and should arrive on Thursday. "
        "Reply to this message if you need to change it."
    ),
    "long": (
        "Welcome back to the evening news. Heavy rain is expected across the north of the country "
        "tonight, so drivers should allow extra time for their journeys. In the city, the new bridge "
        "opened to traffic this morning after three years of work. Local shops say business has "
        "already picked up. Finally, the weekend looks bright and warm, which is good news for the "
        "music festival in the park on Saturday."
    ),
}
TEXT_SETS = ("tokens", *REALISTIC_TEXTS)

SPEAKER = "bench"
VOICE_ID = f"model-{SPEAKER}"  # the id VoiceLibrary gives a speaker of the folder's spk2info.pt
PROMPT_TOKENS = 75  # a 3 s prompt
PROMPT_TEXT = "A fixed prompt for the benchmark."


@dataclass(frozen=True)
class TextSet:
    """A text every request of a setting speaks, and the speech tokens it decodes per text token."""

    name: str
    text: str
    ratio: float

    def describe(self, text: TextFrontend) -> dict:
        """Characters, sentences, text tokens, speech tokens and audio seconds of one request."""
        sentences = text.prepare(self.text)
        limits = replace(SamplingParams(), max_token_text_ratio=self.ratio)
        speech = sum(limits.length_limits(len(s.ids))[1] for s in sentences)
        return {
            "text": self.text,
            "chars": len(self.text),
            "sentences": len(sentences),
            "text_tokens": sum(len(s.ids) for s in sentences),
            "speech_tokens_per_text_token": self.ratio,
            "speech_tokens": speech,
            "audio_s": speech / TOKENS_PER_SECOND,
        }


def prepare_model(folder: Path, full_size: bool, device: torch.device) -> Path:
    """The endless random-weight model folder (written once; full size = CosyVoice2-0.5B's shapes)."""
    if not (folder / "hift.pt").is_file():
        if full_size:
            write_full_size_model(folder, seed=0, endless=True, device=device.type)
        else:
            write_random_model(folder, seed=0, endless=True)
    return folder


def voice_features(seed: int = 0) -> VoiceFeatures:
    """The fixed 3 s prompt (random features: speed does not depend on their values)."""
    g = torch.Generator().manual_seed(seed)
    return VoiceFeatures(
        speech_tokens=torch.randint(0, 6561, (PROMPT_TOKENS,), generator=g),
        speech_feat=torch.randn(2 * PROMPT_TOKENS, 80, generator=g) - 5.0,
        embedding=torch.randn(192, generator=g),
    )


def bench_voice(text: TextFrontend) -> Voice:
    """The prompt voice of every request, as a server of the folder offers it (``VOICE_ID``)."""
    info = VoiceInfo(VOICE_ID, SPEAKER, "model", note="from the model folder")
    return Voice(info, voice_features(), prompt_ids=tuple(text.prompt_ids(PROMPT_TEXT)))


def write_speaker(folder: Path, text: TextFrontend) -> None:
    """Save the bench voice as the folder's ``spk2info.pt`` speaker (upstream's ``add_zero_shot_spk``
    layout), so every server of the folder offers it by name."""
    features = voice_features()
    ids = text.prompt_ids(PROMPT_TEXT)
    tokens = features.speech_tokens[None].int()
    entry = {
        "prompt_text": torch.tensor([ids], dtype=torch.int32),
        "llm_prompt_speech_token": tokens,
        "flow_prompt_speech_token": tokens,
        "prompt_speech_feat": features.speech_feat[None],
        "llm_embedding": features.embedding[None],
        "flow_embedding": features.embedding[None],
    }
    torch.save({SPEAKER: entry}, folder / "spk2info.pt")


def text_for_tokens(text: TextFrontend, tokens: int) -> str:
    """A one-sentence text that decodes exactly ``tokens`` speech tokens at the model's ratio.

    Raises ValueError when ``tokens`` is not a multiple of that ratio.
    """
    if tokens <= 0 or tokens % MODEL_RATIO:
        raise ValueError(f"--tokens must be a positive multiple of {MODEL_RATIO:g}, got {tokens}")
    target = int(tokens // MODEL_RATIO)
    for repeats in range(1, target + 1):
        for word in ("go", "the", "a", "I", "yes", "hello"):
            candidate = " ".join([word] * repeats) + "."
            sentences = text.prepare(candidate)
            if len(sentences) == 1 and len(sentences[0].ids) == target:
                return candidate
    raise ValueError(f"found no one-sentence text of exactly {target} text tokens")


def text_sets(
    names: list[str], text: TextFrontend, tokens: int, realistic_ratio: bool = True
) -> list[TextSet]:
    """The named text sets, in order (``tokens`` decodes ``tokens``). ``realistic_ratio`` False keeps
    the model's ratio for the realistic texts too."""
    ratio = REALISTIC_RATIO if realistic_ratio else MODEL_RATIO
    return [
        TextSet(name, text_for_tokens(text, tokens), MODEL_RATIO)
        if name == "tokens"
        else TextSet(name, REALISTIC_TEXTS[name], ratio)
        for name in names
    ]


@contextmanager
def decoding_ratio(model: CosyVoice2, ratio: float) -> Iterator[None]:
    """Inside the block, the model decodes ``ratio`` speech tokens per text token.

    The endless model always reaches its maximum length, which the Pipeline (and the reference path)
    read from ``model.lm.sampling`` per sentence: setting the ratio there sets the load. Change it only
    between levels, while no request is in flight.
    """
    before = model.lm.sampling
    model.lm.sampling = replace(
        before, max_token_text_ratio=ratio, min_token_text_ratio=min(before.min_token_text_ratio, ratio)
    )
    try:
        yield
    finally:
        model.lm.sampling = before

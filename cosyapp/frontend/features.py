"""The audio-derived part of a voice prompt, light enough to import where no audio is decoded."""

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from cosyapp.models.cosyvoice2 import TOKEN_MEL_RATIO, PromptInputs

EMBEDDING_DIM = 192
MEL_BINS = 80
FEATURES_FORMAT = "cosyapp.VoiceFeatures/1"


@dataclass
class VoiceFeatures:
    """The audio-derived part of a voice prompt, after the 1:2 token/mel alignment (docs/model.md §3.7).

    speech_tokens (P,) long; speech_feat (2P, 80) float32: 24 kHz prompt mel; embedding (192,)
    float32: CAM++ x-vector (not normalised: the flow does that).
    """

    speech_tokens: torch.Tensor
    speech_feat: torch.Tensor
    embedding: torch.Tensor

    def __post_init__(self) -> None:
        p = len(self.speech_tokens)
        assert self.speech_tokens.shape == (p,) and self.speech_tokens.dtype == torch.long
        assert self.speech_feat.shape == (TOKEN_MEL_RATIO * p, MEL_BINS)
        assert self.speech_feat.dtype == torch.float32
        assert self.embedding.shape == (EMBEDDING_DIM,) and self.embedding.dtype == torch.float32

    def save(self, path: str | Path) -> None:
        """Write to a safetensors file; the file appears complete or not at all."""
        path = Path(path)
        tensors = {
            "speech_tokens": self.speech_tokens,
            "speech_feat": self.speech_feat,
            "embedding": self.embedding,
        }
        tmp = path.with_name(path.name + ".tmp")
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in tensors.items()},
            str(tmp),
            metadata={"format": FEATURES_FORMAT},
        )
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> "VoiceFeatures":
        """Read a file written by ``save`` (no code is executed). Raises ValueError for any other file."""
        try:
            with safe_open(str(path), framework="pt") as f:
                found = (f.metadata() or {}).get("format")
        except SafetensorError as err:
            raise ValueError(f"{path} is not a safetensors file: {err}") from err
        if found != FEATURES_FORMAT:
            raise ValueError(f"{path} holds no voice features (format {found!r}, not {FEATURES_FORMAT!r})")
        tensors = load_file(str(path))
        return cls(tensors["speech_tokens"], tensors["speech_feat"], tensors["embedding"])

    def prompt(self, prompt_text_ids: torch.Tensor | list[int]) -> PromptInputs:
        """These features joined with the normalised prompt transcript's token ids (Np,)."""
        return PromptInputs(
            text_ids=torch.as_tensor(prompt_text_ids, dtype=torch.long),
            speech_tokens=self.speech_tokens,
            speech_feat=self.speech_feat,
            embedding=self.embedding,
        )

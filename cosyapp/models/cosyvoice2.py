"""The loaded CosyVoice 2 networks and the reference synthesis path (batch 1, non-streaming).

The reference path is upstream's non-streaming ``tts`` (docs/model.md §8.1) in plain PyTorch: LM
decoding with the RAS sampler, then flow (finalize, full attention), optional speed change, then
HiFT. The serving engine batches these same modules; this path is the yardstick it is tested against.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from cosyapp.models.flow import CausalMaskedDiffWithXvec
from cosyapp.models.hift import HiFTGenerator
from cosyapp.models.lm import Qwen2LM

TOKEN_MEL_RATIO = 2
SAMPLES_PER_FRAME = 480


@dataclass
class PromptInputs:
    """What the frontend derives from one voice prompt (docs/model.md §3.8), on any device.

    text_ids (Np,) long: normalised prompt transcript ids; speech_tokens (P,) long; speech_feat
    (2P, 80) float: 24 kHz prompt mel; embedding (192,) float: CAM++ x-vector.
    """

    text_ids: torch.Tensor
    speech_tokens: torch.Tensor
    speech_feat: torch.Tensor
    embedding: torch.Tensor


@dataclass
class CosyVoice2:
    """The three networks of one model folder, plus its hyperparameters."""

    lm: Qwen2LM
    flow: CausalMaskedDiffWithXvec
    hift: HiFTGenerator
    hparams: dict[str, Any]
    model_dir: Path

    @property
    def sample_rate(self) -> int:
        return int(self.hparams["sample_rate"])

    @property
    def device(self) -> torch.device:
        return self.flow.input_embedding.weight.device

    @torch.inference_mode()
    def tokens_to_mel(self, tokens: torch.Tensor, prompt: PromptInputs) -> torch.Tensor:
        """Flow in finalize, non-streaming mode: tokens (G,) -> mel (80, 2G) of the generated part."""
        dev, dtype = self.device, self.flow.input_embedding.weight.dtype
        # A flow whose matrix weights the engine stored in its autocast dtype runs under that
        # autocast (engine/token2wav/precision.py).
        amp = self.flow.matmul_dtype
        with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
            mel, mel_len = self.flow.inference(
                token=tokens[None].to(dev),
                token_len=torch.tensor([len(tokens)], device=dev),
                prompt_token=prompt.speech_tokens[None].to(dev),
                prompt_token_len=torch.tensor([len(prompt.speech_tokens)], device=dev),
                prompt_feat=prompt.speech_feat[None].to(dev, dtype),
                prompt_feat_len=torch.tensor([len(prompt.speech_feat)], device=dev),
                embedding=prompt.embedding[None].to(dev, dtype),
                streaming=False,
                finalize=True,
            )
        return mel[0, :, : int(mel_len[0])].float()

    @torch.inference_mode()
    def mel_to_wave(self, mel: torch.Tensor, speed: float = 1.0) -> torch.Tensor:
        """HiFT on mel (80, F), after the non-streaming speed change; returns (480 * F',) floats.

        See docs/model.md §6.8.
        """
        mel = mel[None].float().to(self.hift.conv_pre.bias.device)
        if speed != 1.0:
            mel = F.interpolate(mel, size=int(mel.shape[2] / speed), mode="linear")
        speech, _ = self.hift(mel)
        return speech[0]

    def synthesize(
        self,
        text_ids: torch.Tensor,
        prompt: PromptInputs,
        speed: float = 1.0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """One sentence of zero-shot speech: text ids (Nt,) -> 24 kHz waveform (480 * 2G / speed,) on CPU.

        ``generator`` drives the LM sampler (it must live on the model's device); HiFT draws its noise
        from torch's default generator, as upstream does.
        """
        tokens = list(self.lm.generate(prompt.text_ids, text_ids, prompt.speech_tokens, generator))
        if not tokens:
            return torch.zeros(0)
        mel = self.tokens_to_mel(torch.tensor(tokens, dtype=torch.long), prompt)
        return self.mel_to_wave(mel, speed).cpu()

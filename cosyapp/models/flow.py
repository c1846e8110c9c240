"""CosyVoice 2 flow (speech tokens -> 80-bin mel): encoder, conditional flow matching, batched inference.

`CausalMaskedDiffWithXvec` is the root of the official ``flow.pt``. Upstream only runs batch 1;
`inference` takes right-padded batches and gives every item what a batch-1 call would give.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyapp.models.flow_encoder import UpsampleConformerEncoder, length_mask
from cosyapp.models.flow_estimator import CausalConditionalDecoder

MAX_MEL_FRAMES = 15000  # columns of the fixed CFM noise: prompt + generated mel frames per call (300 s)


def cosine_time_grid(n_timesteps: int, device: torch.device | str | None, dtype: torch.dtype) -> Tensor:
    """The n_timesteps + 1 Euler times t_k = 1 - cos(k / n_timesteps * pi / 2), built in `dtype`."""
    t = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    return 1 - torch.cos(t * 0.5 * torch.pi)


class CausalConditionalCFM(nn.Module):
    """Euler sampler of the flow-matching ODE with classifier-free guidance and fixed noise.

    Has no parameters of its own. `rand_noise` is upstream's seed-0 draw, kept as a plain CPU
    attribute (not a buffer) so it stays out of the state dict and is identical however the
    module was built (also under the meta device).
    """

    def __init__(
        self, estimator: CausalConditionalDecoder, inference_cfg_rate: float = 0.7, n_timesteps: int = 10
    ):
        super().__init__()
        self.estimator = estimator
        self.inference_cfg_rate = inference_cfg_rate
        self.n_timesteps = n_timesteps
        # Upstream seeds the global generators with 0 and draws; a fresh CPU generator seeded with
        # 0 yields the same numbers without touching global RNG state.
        generator = torch.Generator("cpu").manual_seed(0)
        shape = (1, estimator.out_channels, MAX_MEL_FRAMES)
        self.rand_noise = torch.randn(shape, generator=generator, device="cpu")

    def forward(
        self,
        mu: Tensor,
        mask: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        all_valid: bool = False,
    ) -> Tensor:
        """Integrate from the fixed noise to a mel.

        mu, cond (B, 80, T) right-padded; mask (B, 1, T) 1 at valid frames; spks (B, 80).
        all_valid: every item is T frames long (no padding), which the estimator can use.
        Every item starts from rand_noise[:, :, :T_i] (its noise begins at column 0, as for batch 1).
        Returns x (B, 80, T) float32; frames beyond each item's length are meaningless.
        Raises ValueError when T exceeds the noise length.
        """
        batch, _, frames = mu.shape
        if frames > self.rand_noise.size(2):
            limit = self.rand_noise.size(2)
            raise ValueError(f"the flow handles at most {limit} mel frames per item, got {frames}")
        x = self.rand_noise[:, :, :frames].to(mu.device, mu.dtype).expand(batch, -1, -1)
        t_span = cosine_time_grid(self.n_timesteps, mu.device, mu.dtype)
        # CFG doubles the batch: [conditional items; the same items with mu, spks and cond zeroed].
        # Like upstream, the estimator inputs take the dtype of spks (the autocast dtype under autocast).
        dtype = spks.dtype
        mask_in = torch.cat([mask, mask]).to(dtype)
        mu_in = torch.cat([mu, torch.zeros_like(mu)]).to(dtype)
        spks_in = torch.cat([spks, torch.zeros_like(spks)])
        cond_in = torch.cat([cond, torch.zeros_like(cond)]).to(dtype)
        rate = self.inference_cfg_rate
        t = t_span[0]
        for step in range(1, len(t_span)):
            # Upstream's running-t step size: equal to t_span[step] - t_span[step - 1] up to rounding.
            dt = t_span[step] - t
            t_in = t.to(dtype).expand(2 * batch)
            x_in = torch.cat([x, x]).to(dtype)
            velocity = self.estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, streaming, all_valid)
            v_cond, v_uncond = velocity.chunk(2)
            x = x + dt * ((1.0 + rate) * v_cond - rate * v_uncond)
            t = t + dt
        return x.float()


def join_prompt(
    prompt_token: Tensor, prompt_len: Tensor, token: Tensor, token_len: Tensor
) -> tuple[Tensor, Tensor]:
    """Per item prompt_token[:P_i] ++ token[:G_i], right-padded with 0 to max(P_i + G_i).

    Takes (B, P) / (B,) / (B, G) / (B,); returns (tokens (B, N), lengths (B,)).
    """
    lengths = prompt_len + token_len
    width = int(lengths.max())
    both = torch.cat([prompt_token, token], dim=1)
    pos = torch.arange(width, device=token.device).unsqueeze(0)
    p = prompt_len.unsqueeze(1)
    # Position n reads prompt column n before P_i, and token column n - P_i (at P + n - P_i in `both`) after.
    src = torch.where(pos < p, pos, prompt_token.size(1) + pos - p).clamp(max=both.size(1) - 1)
    joined = both.gather(1, src).masked_fill(pos >= lengths.unsqueeze(1), 0)
    return joined, lengths


def prompt_condition(prompt_feat: Tensor, prompt_feat_len: Tensor, frames: int) -> Tensor:
    """cond (B, 80, frames): each item's prompt mel (B, M, 80) in its first M_i frames, zeros elsewhere."""
    feat = prompt_feat[:, :frames]
    feat = feat * length_mask(prompt_feat_len, feat.size(1)).unsqueeze(-1)
    return F.pad(feat, (0, 0, 0, frames - feat.size(1))).transpose(1, 2)


def generated_frames(feat: Tensor, start: Tensor, lengths: Tensor) -> Tensor:
    """feat (B, C, T) -> (B, C, max(lengths)) with feat[i, :, start_i : start_i + lengths_i], zero after."""
    width = int(lengths.max()) if lengths.numel() else 0
    idx = (start.unsqueeze(1) + torch.arange(width, device=feat.device)).clamp(max=feat.size(2) - 1)
    out = feat.gather(2, idx.unsqueeze(1).expand(-1, feat.size(1), -1))
    return out.masked_fill(~length_mask(lengths, width).unsqueeze(1), 0.0)


class CausalMaskedDiffWithXvec(nn.Module):
    """Speech tokens + prompt (tokens, mel, x-vector) -> mel of the generated tokens (2 frames per token)."""

    def __init__(
        self,
        input_size: int = 512,
        output_size: int = 80,
        spk_embed_dim: int = 192,
        vocab_size: int = 6561,
        token_mel_ratio: int = 2,
        pre_lookahead_len: int = 3,
        encoder: UpsampleConformerEncoder | None = None,
        decoder: CausalConditionalCFM | None = None,
    ):
        super().__init__()
        if encoder is None:
            encoder = UpsampleConformerEncoder(
                input_size=input_size, pre_lookahead_len=pre_lookahead_len, upsample_stride=token_mel_ratio
            )
        if decoder is None:
            decoder = CausalConditionalCFM(CausalConditionalDecoder(out_channels=output_size))
        assert encoder.upsample_stride == token_mel_ratio and encoder.pre_lookahead_len == pre_lookahead_len
        self.output_size = output_size
        self.token_mel_ratio = token_mel_ratio
        self.pre_lookahead_len = pre_lookahead_len
        self.input_embedding = nn.Embedding(vocab_size, input_size)
        self.spk_embed_affine_layer = nn.Linear(spk_embed_dim, output_size)
        self.encoder = encoder
        self.encoder_proj = nn.Linear(encoder.output_size, output_size)
        self.decoder = decoder
        # Set when the serving engine stores the Linear/Conv1d weights in its autocast dtype
        # (engine/token2wav/precision.py): the flow must then run under that autocast.
        self.matmul_dtype: torch.dtype | None = None

    @torch.inference_mode()
    def inference(
        self,
        token: Tensor,
        token_len: Tensor,
        prompt_token: Tensor,
        prompt_token_len: Tensor,
        prompt_feat: Tensor,
        prompt_feat_len: Tensor,
        embedding: Tensor,
        streaming: bool = False,
        finalize: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Mel frames for a right-padded batch; item i equals a batch-1 call up to float rounding.

        token (B, G) / token_len (B,): generated tokens; prompt_token (B, P) / prompt_token_len (B,);
        prompt_feat (B, M, 80) / prompt_feat_len (B,): prompt mel (2 frames per prompt token);
        embedding (B, 192): x-vector. Item i's sequence is prompt ++ generated tokens.
        finalize=False (a streaming chunk): each item's last `pre_lookahead_len` tokens are right
        context only. streaming=True turns on the static chunk masks (encoder and estimator).
        Returns (mel (B, 80, max(mel_len)) float32, zero beyond mel_len; mel_len (B,)), with the frames
        after each item's prompt: mel_len = 2 * G_i (finalize) or 2 * (G_i - pre_lookahead_len).
        Raises ValueError if a chunk call has fewer than `pre_lookahead_len` tokens for some item.
        """
        if not finalize and bool((token_len < self.pre_lookahead_len).any()):
            raise ValueError(f"a chunk call (finalize=False) needs at least {self.pre_lookahead_len} tokens")
        tokens, lengths = join_prompt(prompt_token, prompt_token_len, token, token_len)
        # Equal token counts give equal frame counts (h_lens), so a batch of one length has no padded
        # frame and its estimator needs no attention mask. Read here, before the encoder runs, so the
        # decoder's launches do not wait for the encoder to finish.
        all_valid = bool((lengths == tokens.size(1)).all())
        spks = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))
        x = self.input_embedding(tokens.clamp(min=0)) * length_mask(lengths, tokens.size(1)).unsqueeze(-1)
        h, h_lens = self.encoder(x, lengths, streaming=streaming, finalize=finalize)
        mu = self.encoder_proj(h).transpose(1, 2)
        frames = mu.size(2)
        mask = length_mask(h_lens, frames).unsqueeze(1).to(mu.dtype)
        cond = prompt_condition(prompt_feat, prompt_feat_len, frames).to(mu.dtype)
        feat = self.decoder(mu, mask, spks, cond, streaming=streaming, all_valid=all_valid)
        mel_len = h_lens - prompt_feat_len
        assert bool((mel_len >= 0).all()), "prompt mel longer than prompt + generated tokens"
        return generated_frames(feat, prompt_feat_len, mel_len), mel_len

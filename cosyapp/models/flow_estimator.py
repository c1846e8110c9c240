"""Velocity estimator of the CosyVoice 2 flow: a causal 1-D U-Net with transformer blocks.

Every convolution is causal or pointwise and LayerNorm acts per frame, so with right padding and
key masks each batch item sees exactly what a batch-1 call would. Module names follow the official
``flow.pt`` (``decoder.estimator.*``).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyapp.models.flow_encoder import attention_mask


def time_embedding(t: Tensor, dim: int, scale: float = 1000.0) -> Tensor:
    """Sinusoidal embedding of diffusion times t (B,) -> (B, dim) as [sin | cos], in t's dtype."""
    half = dim // 2
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    # Same operation order as upstream (scale * t first, in t's dtype) so fp16 rounding matches.
    angles = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat([angles.sin(), angles.cos()], dim=-1).to(t.dtype)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs matrix products in on ``device`` now, or None outside autocast."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


class TimestepMLP(nn.Module):
    """Linear, SiLU, Linear on the time embedding."""

    def __init__(self, in_channels: int, time_embed_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class CausalConv1d(nn.Conv1d):
    """Conv1d (stride 1) that left-pads kernel_size - 1 zeros, so frame t sees frames <= t only."""

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class Transpose(nn.Module):
    """Swap two axes (lets a LayerNorm act over channels inside a Sequential of (B, C, T) layers)."""

    def __init__(self, dim0: int, dim1: int):
        super().__init__()
        self.dims = (dim0, dim1)

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(*self.dims)


class CausalBlock1D(nn.Module):
    """Masked causal conv k3, LayerNorm over channels, Mish: (B, dim, T) -> (B, dim_out, T)."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), Transpose(1, 2), nn.LayerNorm(dim_out), Transpose(1, 2), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.finish(self.block[0](x * mask), mask)

    def finish(self, h: Tensor, mask: Tensor) -> Tensor:
        """What follows the convolution: LayerNorm over the channels of h (B, C, T), Mish, mask."""
        _, to_channels_last, norm, to_channels_first, mish = self.block
        return mish(to_channels_first(norm(to_channels_last(h)))) * mask


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with the time embedding added in between, plus a 1x1 residual conv."""

    def __init__(self, dim: int, dim_out: int, time_emb_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, t_emb: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(t_emb).unsqueeze(-1)
        return self.block2(h, mask) + self.res_conv(x * mask)


class Attention(nn.Module):
    """The projections around self-attention: bias-free q/k/v in, a biased output projection.

    The attention itself (scale 1/sqrt(head_dim)) is the caller's: SDPA over the call's own keys in
    ``TransformerBlock.forward``, over cached keys too in the incremental flow.
    """

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, dim) -> queries, keys, values, each (B, heads, T, head_dim)."""
        b, t, _ = x.shape
        q, k, v = (
            proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
            for proj in (self.to_q, self.to_k, self.to_v)
        )
        return q, k, v

    def out(self, attended: Tensor) -> Tensor:
        """Attention output (B, heads, T, head_dim) -> (B, T, dim)."""
        b, _, t, _ = attended.shape
        return self.to_out[0](attended.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class GELUProjection(nn.Module):
    """Linear followed by exact (erf) GELU."""

    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, inner)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    """GELU MLP with 4x inner width."""

    def __init__(self, dim: int):
        super().__init__()
        # Index 1 was dropout upstream; the Identity keeps the checkpoint's `net.2` index.
        self.net = nn.Sequential(GELUProjection(dim, 4 * dim), nn.Identity(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + FFN block (diffusers BasicTransformerBlock, no cross/adaptive norm)."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """x (B, T, dim), mask (B, 1|T, T) of allowed keys, bool or additive (0 / -inf), or None for
        every key -> (B, T, dim)."""
        # Upstream adds a -1e10 bias at blocked keys; -inf gives the same probabilities (exp
        # underflows to exactly 0 either way) and lets SDPA pick a fused kernel.
        attn_mask = None if mask is None else mask.unsqueeze(1)
        attended = F.scaled_dot_product_attention(*self.qkv(x), attn_mask=attn_mask)
        return self.after_attention(x, attended)

    # The block's memory-bound work lives in these two methods, which the recompute and the
    # incremental flow share; engine/token2wav/fused.py compiles after_attention for the incremental
    # flow (the forward it compiles whole).
    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys, values (B, heads, T, head_dim) of norm1(x), x (B, T, dim)."""
        return self.attn1.qkv(self.norm1(x))

    def after_attention(self, x: Tensor, attended: Tensor) -> Tensor:
        """The attention's output projection and residual, then the FFN with its residual."""
        h = x + self.attn1.out(attended)
        return h + self.ff(self.norm3(h))


class CausalConditionalDecoder(nn.Module):
    """The flow's velocity network v(x, t | mu, spks, cond), one U-Net level (as in CosyVoice 2)."""

    def __init__(
        self,
        in_channels: int = 320,
        out_channels: int = 80,
        channels: tuple[int, ...] = (256,),
        attention_head_dim: int = 64,
        n_blocks: int = 4,
        num_mid_blocks: int = 12,
        num_heads: int = 8,
        static_chunk_size: int = 50,
    ):
        super().__init__()
        # Upstream also supports deeper U-Nets with strided resampling; CosyVoice 2 uses one level,
        # and that is all this implementation builds.
        if len(channels) != 1:
            raise ValueError(f"only a one-level U-Net (channels of length 1) is supported, got {channels}")
        ch = channels[0]
        time_dim = 4 * ch
        self.in_channels, self.out_channels = in_channels, out_channels
        self.static_chunk_size = static_chunk_size
        self.time_mlp = TimestepMLP(in_channels, time_dim)

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(ch, num_heads, attention_head_dim) for _ in range(n_blocks))

        # Index 2 of the down and up stages is upstream's resampling slot: a same-rate causal conv
        # at the last (here the only) level.
        down = [CausalResnetBlock1D(in_channels, ch, time_dim), transformers(), CausalConv1d(ch, ch, 3)]
        self.down_blocks = nn.ModuleList([nn.ModuleList(down)])
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock1D(ch, ch, time_dim), transformers()])
            for _ in range(num_mid_blocks)
        )
        up = [CausalResnetBlock1D(2 * ch, ch, time_dim), transformers(), CausalConv1d(ch, ch, 3)]
        self.up_blocks = nn.ModuleList([nn.ModuleList(up)])
        self.final_block = CausalBlock1D(ch, ch)
        self.final_proj = nn.Conv1d(ch, out_channels, 1)

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        streaming: bool = False,
        all_valid: bool = False,
    ) -> Tensor:
        """Velocity at state x.

        x, mu, cond (B, 80, T); mask (B, 1, T) 1 at valid frames (right padding); t (B,) times;
        spks (B, 80). streaming=True restricts attention to static chunks of `static_chunk_size`
        frames from frame 0 (unlimited left context). Returns (B, out_channels, T), zero at padding.
        all_valid: the caller knows that every frame of every row is valid (mask all ones).
        """
        t_emb = self.time_mlp(time_embedding(t, self.in_channels))
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)
        # streaming first: a compiled forward (fused.py) then has one graph for streaming calls, not two.
        attn_mask = None if not streaming and all_valid else self._attention_bias(mask, streaming, h)

        resnet, blocks, conv = self.down_blocks[0]
        h = self._attend(blocks, resnet(h, mask, t_emb), attn_mask)
        skip = h
        h = conv(h * mask)
        for resnet, blocks in self.mid_blocks:
            h = self._attend(blocks, resnet(h, mask, t_emb), attn_mask)
        resnet, blocks, conv = self.up_blocks[0]
        h = self._attend(blocks, resnet(torch.cat([h, skip], dim=1), mask, t_emb), attn_mask)
        h = conv(h * mask)
        h = self.final_block(h, mask)
        return self.final_proj(h * mask) * mask

    def _attention_bias(self, mask: Tensor, streaming: bool, h: Tensor) -> Tensor:
        """The additive attention mask (B, 1|T, T): 0 at allowed keys, -inf at the others.

        Made once, in the attention's dtype, for every block: SDPA would turn a boolean mask into
        exactly this in each of them. Full attention with no padded key needs none at all
        (``all_valid``), and SDPA then runs its fused kernels without reading a mask
        (docs/model.md §6.6): the same attention, up to the kernels' float rounding.
        """
        allowed = attention_mask(mask[:, 0].bool(), self.static_chunk_size if streaming else 0)
        bias = torch.zeros(allowed.shape, dtype=autocast_dtype(h.device) or h.dtype, device=h.device)
        return bias.masked_fill_(~allowed, float("-inf"))

    @staticmethod
    def _attend(blocks: nn.ModuleList, h: Tensor, attn_mask: Tensor | None) -> Tensor:
        h = h.transpose(1, 2)
        for block in blocks:
            h = block(h, attn_mask)
        return h.transpose(1, 2)

"""Token encoder of the CosyVoice 2 flow: pre-lookahead conv, rel-pos Conformer, x2 causal upsampling.

Batched with right padding: every item's positions start at 0, padded keys are masked out, and all
convolutions look only left (or, for the pre-lookahead conv, at most `pre_lookahead_len` tokens
right, which are either real context tokens or zeros), so each item sees exactly what a batch-1
call would see. Module names follow the official ``flow.pt`` (``encoder.*``).
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def chunk_mask(length: int, chunk: int, device: torch.device | str | None = None) -> Tensor:
    """Static chunk mask with unlimited left context.

    Returns bool (length, length): query i may attend to key j iff j < (i // chunk + 1) * chunk.
    """
    pos = torch.arange(length, device=device)
    return pos.unsqueeze(0) < ((pos // chunk + 1) * chunk).unsqueeze(1)


def length_mask(lengths: Tensor, max_len: int) -> Tensor:
    """lengths (B,) -> bool (B, max_len), True at each item's valid (left-aligned) positions."""
    return torch.arange(max_len, device=lengths.device) < lengths.unsqueeze(1)


def attention_mask(valid: Tensor, chunk: int = 0) -> Tensor:
    """Which keys each query may attend to, from the valid positions `valid` (B, T) bool.

    chunk = 0 gives full attention over valid keys, as bool (B, 1, T) that broadcasts over queries;
    chunk > 0 adds the static chunk rule of `chunk_mask`, as bool (B, T, T).
    """
    keys = valid.unsqueeze(1)
    if chunk > 0:
        return keys & chunk_mask(valid.size(1), chunk, valid.device)
    return keys


def rel_pos_table(length: int, d_model: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """ESPnet "new" relative positional table (1, 2*length - 1, d_model).

    Row m encodes the relative distance length - 1 - m with interleaved [sin, cos] pairs. Upstream
    precomputes 5000 positions per direction once and slices the centre; we compute the rows we need
    (same float32 formula) so the module holds no tensor state.
    """
    dist = torch.arange(length - 1, -length, -1, device=device, dtype=torch.float32)
    freqs = torch.exp(
        torch.arange(0, d_model, 2, device=device, dtype=torch.float32) * -(math.log(10000.0) / d_model)
    )
    angles = dist.unsqueeze(1) * freqs
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1).unsqueeze(0).to(dtype)


def rel_shift(scores: Tensor) -> Tensor:
    """(B, H, T, 2T-1) position scores -> (B, H, T, T) with out[..., i, j] = scores[..., i, T-1-i+j].

    Column T-1-i+j of the table holds relative distance i-j, so this is the ESPnet relative shift.
    """
    b, h, t, n = scores.shape
    padded = F.pad(scores, (1, 0)).view(b, h, n + 1, t)
    return padded[:, :, 1:].reshape(b, h, t, n)[..., : n // 2 + 1]


class RelPositionAttention(nn.Module):
    """Multi-head self-attention with relative positions (Transformer-XL style biases u and v)."""

    def __init__(self, n_head: int, n_feat: int):
        super().__init__()
        assert n_feat % n_head == 0
        self.h, self.d_k = n_head, n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(n_head, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor) -> Tensor:
        """x (B, T, D), mask bool (B, 1|T, T) of allowed keys, pos_emb (1, 2T-1, D) -> (B, T, D)."""
        b, t, _ = x.shape
        q = self.linear_q(x).view(b, t, self.h, self.d_k)
        k = self.linear_k(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(x).view(b, t, self.h, self.d_k).transpose(1, 2)
        p = self.linear_pos(pos_emb).view(1, -1, self.h, self.d_k).transpose(1, 2)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = rel_shift(torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1)))
        scores = (content + position) / math.sqrt(self.d_k)
        blocked = ~mask.unsqueeze(1)
        # Zeroing after the softmax keeps a fully blocked row at 0 instead of NaN (as upstream).
        attn = torch.softmax(scores.masked_fill(blocked, float("-inf")), dim=-1).masked_fill(blocked, 0.0)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, t, self.h * self.d_k)
        return self.linear_out(out)


class FeedForward(nn.Module):
    """Position-wise FFN: Linear, SiLU, Linear."""

    def __init__(self, size: int, hidden: int):
        super().__init__()
        self.w_1 = nn.Linear(size, hidden)
        self.w_2 = nn.Linear(hidden, size)

    def forward(self, x: Tensor) -> Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerLayer(nn.Module):
    """Pre-norm Conformer block without macaron FFN or conv module: x + MHA(LN x), then x + FFN(LN x)."""

    def __init__(self, size: int, heads: int, linear_units: int):
        super().__init__()
        self.self_attn = RelPositionAttention(heads, size)
        self.feed_forward = FeedForward(size, linear_units)
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)

    def forward(self, x: Tensor, mask: Tensor, pos_emb: Tensor) -> Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_emb)
        return x + self.feed_forward(self.norm_ff(x))


class LinearEmbed(nn.Module):
    """Input layer: Linear, LayerNorm, then the rel-pos module's x sqrt(d) scaling (after the norm)."""

    def __init__(self, idim: int, odim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.xscale


class PreLookaheadLayer(nn.Module):
    """Conv that lets each token see the next `pre_lookahead_len` tokens, then a causal conv, residual.

    Takes x (B, T, C) whose columns after each item's main tokens hold either its right-context
    tokens (streaming chunk) or zeros (finalize); returns (B, T, C), where position t depends on
    x[t - 2 : t + pre_lookahead_len + 1]. Positions beyond an item's main tokens are meaningless.
    """

    def __init__(self, channels: int, pre_lookahead_len: int):
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, channels, pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(channels, channels, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = F.pad(x.transpose(1, 2), (0, self.pre_lookahead_len))
        h = F.leaky_relu(self.conv1(h), 0.01)
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))
        return h.transpose(1, 2) + x


class CausalUpsample(nn.Module):
    """Nearest-neighbour x stride, then a causal conv (kernel 2*stride + 1): (B, C, T) -> (B, C, stride*T)."""

    def __init__(self, channels: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, stride * 2 + 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.interpolate(x, scale_factor=float(self.stride), mode="nearest")
        return self.conv(F.pad(x, (self.stride * 2, 0)))


class UpsampleConformerEncoder(nn.Module):
    """Token encoder: embed, pre-lookahead, Conformer blocks, x2 upsampling, Conformer blocks, norm."""

    def __init__(
        self,
        input_size: int = 512,
        output_size: int = 512,
        attention_heads: int = 8,
        linear_units: int = 2048,
        num_blocks: int = 6,
        num_up_blocks: int = 4,
        static_chunk_size: int = 25,
        pre_lookahead_len: int = 3,
        upsample_stride: int = 2,
    ):
        super().__init__()
        self.output_size = output_size
        self.static_chunk_size = static_chunk_size
        self.pre_lookahead_len = pre_lookahead_len
        self.upsample_stride = upsample_stride
        self.embed = LinearEmbed(input_size, output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(output_size, pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerLayer(output_size, attention_heads, linear_units) for _ in range(num_blocks)
        )
        self.up_layer = CausalUpsample(output_size, upsample_stride)
        self.up_embed = LinearEmbed(output_size, output_size)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(output_size, attention_heads, linear_units) for _ in range(num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(output_size, eps=1e-5)

    def output_lengths(self, lengths: list[int], finalize: bool = True) -> list[int]:
        """The ``h_lens`` that forward returns for items of these token counts, computed on the host
        (a caller that plans with them need not wait for the device)."""
        lookahead = 0 if finalize else self.pre_lookahead_len
        return [(n - lookahead) * self.upsample_stride for n in lengths]

    def forward(
        self, xs: Tensor, xs_lens: Tensor, streaming: bool = False, finalize: bool = True
    ) -> tuple[Tensor, Tensor]:
        """Encode embedded tokens.

        xs (B, N, input_size): each item's embedded tokens, right-padded (padding values are ignored);
        N should be max(xs_lens). With finalize=False the last `pre_lookahead_len` tokens of each item
        are right context only. streaming=True applies static chunk masks (chunk `static_chunk_size`
        tokens, then that times the stride in frames), counted from position 0 of each item.
        Returns (h (B, stride*T, output_size) zero beyond h_lens, h_lens (B,)), T = N or N - lookahead.
        """
        lookahead = 0 if finalize else self.pre_lookahead_len
        lens = xs_lens - lookahead
        width = xs.size(1) - lookahead
        # Upstream embeds the right context separately (same layers); embedding everything at once
        # is the same per position. Zeroing past each item gives finalize's zero lookahead padding.
        x = self.embed(xs) * length_mask(xs_lens, xs.size(1)).unsqueeze(-1)
        x = self.pre_lookahead_layer(x)[:, :width]
        x = self._blocks(self.encoders, x, lens, self.static_chunk_size if streaming else 0)

        x = self.up_layer(x.transpose(1, 2)).transpose(1, 2)
        lens, width = lens * self.upsample_stride, width * self.upsample_stride
        x = self.up_embed(x)
        chunk = self.static_chunk_size * self.upsample_stride if streaming else 0
        x = self._blocks(self.up_encoders, x, lens, chunk)
        return self.after_norm(x) * length_mask(lens, width).unsqueeze(-1), lens

    @staticmethod
    def _blocks(layers: nn.ModuleList, x: Tensor, lens: Tensor, chunk: int) -> Tensor:
        valid = length_mask(lens, x.size(1))
        # Padded positions only ever act as (masked) keys; zero them so they stay finite in fp16.
        x = x * valid.unsqueeze(-1)
        mask = attention_mask(valid, chunk)
        pos_emb = rel_pos_table(x.size(1), x.size(2), x.device, x.dtype)
        for layer in layers:
            x = layer(x, mask, pos_emb)
        return x

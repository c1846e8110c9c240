import math

import pytest
import torch
from torch import nn

from cosyapp.models.flow import CausalConditionalCFM, CausalMaskedDiffWithXvec, cosine_time_grid
from cosyapp.models.flow_encoder import UpsampleConformerEncoder, chunk_mask
from cosyapp.models.flow_estimator import CausalConditionalDecoder

MEL = 80
LOOKAHEAD = 3


def _tiny_encoder() -> UpsampleConformerEncoder:
    return UpsampleConformerEncoder(
        input_size=32, output_size=32, attention_heads=2, linear_units=64, num_blocks=1, num_up_blocks=1
    )


def _tiny_flow() -> CausalMaskedDiffWithXvec:
    estimator = CausalConditionalDecoder(
        channels=(32,), attention_head_dim=16, n_blocks=1, num_mid_blocks=1, num_heads=2
    )
    return CausalMaskedDiffWithXvec(
        input_size=32, encoder=_tiny_encoder(), decoder=CausalConditionalCFM(estimator)
    ).eval()


@pytest.fixture(scope="module")
def tiny_flow() -> CausalMaskedDiffWithXvec:
    torch.manual_seed(0)
    return _tiny_flow()


def _utterance(n_prompt: int, n_total: int, seed: int) -> dict[str, torch.Tensor]:
    """Prompt tokens, a stream of n_total generated tokens, prompt mel (2 frames/token), x-vector."""
    g = torch.Generator().manual_seed(seed)
    return {
        "prompt": torch.randint(0, 6561, (n_prompt,), generator=g),
        "tokens": torch.randint(0, 6561, (n_total,), generator=g),
        "mel": torch.randn(2 * n_prompt, MEL, generator=g) - 5,
        "xvec": torch.randn(192, generator=g),
    }


def _batch(items: list[dict[str, torch.Tensor]], n_tokens: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded inference kwargs: item i with its first n_tokens[i] generated tokens."""

    def pad(seqs: list[torch.Tensor]) -> torch.Tensor:
        return nn.utils.rnn.pad_sequence(seqs, batch_first=True)

    tokens = [u["tokens"][:n] for u, n in zip(items, n_tokens, strict=True)]
    return {
        "token": pad(tokens),
        "token_len": torch.tensor([len(t) for t in tokens]),
        "prompt_token": pad([u["prompt"] for u in items]),
        "prompt_token_len": torch.tensor([len(u["prompt"]) for u in items]),
        "prompt_feat": pad([u["mel"] for u in items]),
        "prompt_feat_len": torch.tensor([len(u["mel"]) for u in items]),
        "embedding": torch.stack([u["xvec"] for u in items]),
    }


def test_meta_built_flow_has_exactly_the_checkpoint_names_and_shapes(manifest):
    with torch.device("meta"):
        flow = CausalMaskedDiffWithXvec()
    assert {k: list(v.shape) for k, v in flow.state_dict().items()} == manifest("flow.pt")


def test_noise_and_constants_are_not_in_the_state_dict(tiny_flow):
    assert list(tiny_flow.buffers()) == []
    assert set(tiny_flow.state_dict()) == {name for name, _ in tiny_flow.named_parameters()}
    assert tiny_flow.decoder.rand_noise.shape == (1, MEL, 15000)


def test_random_state_dict_with_checkpoint_names_loads_strictly(manifest):
    g = torch.Generator().manual_seed(3)
    state = {name: torch.randn(shape, generator=g) for name, shape in manifest("flow.pt").items()}
    flow = CausalMaskedDiffWithXvec()
    result = flow.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(
        flow.decoder.estimator.mid_blocks[11][1][3].attn1.to_q.weight,
        state["decoder.estimator.mid_blocks.11.1.3.attn1.to_q.weight"],
    )


def test_full_size_flow_loaded_onto_meta_gives_two_finite_frames_per_token():
    # Weights from PyTorch's default init: well scaled, unlike plain randn (overflow) or tiny randn
    # (denormals make CPU matmuls crawl).
    torch.manual_seed(4)
    state = CausalMaskedDiffWithXvec().state_dict()
    with torch.device("meta"):
        flow = CausalMaskedDiffWithXvec()
    flow.load_state_dict(state, strict=True, assign=True)
    mel, mel_len = flow.inference(**_batch([_utterance(5, 8, seed=1)], [8]))
    assert mel.shape == (1, MEL, 16) and mel.dtype == torch.float32
    assert mel_len.tolist() == [16]
    assert torch.isfinite(mel).all() and mel.abs().sum() > 0


def test_two_mel_frames_per_token_and_chunk_calls_drop_the_lookahead_tokens(tiny_flow):
    items = [_utterance(6, 12, seed=1), _utterance(3, 9, seed=2)]
    mel, mel_len = tiny_flow.inference(**_batch(items, [12, 9]), finalize=True)
    assert mel_len.tolist() == [24, 18] and mel.shape == (2, MEL, 24)
    mel, mel_len = tiny_flow.inference(**_batch(items, [12, 9]), streaming=True, finalize=False)
    assert mel_len.tolist() == [2 * (12 - LOOKAHEAD), 2 * (9 - LOOKAHEAD)] and mel.shape == (2, MEL, 18)
    assert torch.all(mel[1, :, 12:] == 0)


def test_cosine_time_grid_has_eleven_points_one_minus_cos():
    expected = torch.tensor([1 - math.cos(k / 10 * math.pi / 2) for k in range(11)])
    torch.testing.assert_close(cosine_time_grid(10, "cpu", torch.float32), expected)


class _KnownVelocity(nn.Module):
    """Stand-in estimator: v = mu + spks + cond + 0.5 x + t, recording what it was given."""

    out_channels = MEL

    def __init__(self):
        super().__init__()
        self.calls: list[dict[str, torch.Tensor]] = []

    def forward(self, x, mask, mu, t, spks, cond, streaming, all_valid=False):
        self.calls.append({"x": x, "mask": mask, "mu": mu, "t": t, "spks": spks, "cond": cond})
        return (mu + spks[:, :, None] + cond + 0.5 * x + t[:, None, None]) * mask


def test_cfm_is_ten_euler_steps_of_guided_velocity_on_the_cosine_grid():
    estimator = _KnownVelocity()
    cfm = CausalConditionalCFM(estimator)
    g = torch.Generator().manual_seed(5)
    mu, cond = torch.randn(2, MEL, 7, generator=g), torch.randn(2, MEL, 7, generator=g)
    spks = torch.randn(2, MEL, generator=g)
    mask = torch.ones(2, 1, 7)
    out = cfm(mu, mask, spks, cond)

    x = cfm.rand_noise[:, :, :7].double().expand(2, -1, -1)
    grid = [1 - math.cos(k / 10 * math.pi / 2) for k in range(11)]
    for k in range(10):
        v_cond = mu.double() + spks.double()[:, :, None] + cond.double() + 0.5 * x + grid[k]
        v_uncond = 0.5 * x + grid[k]
        x = x + (grid[k + 1] - grid[k]) * (1.7 * v_cond - 0.7 * v_uncond)
    torch.testing.assert_close(out, x.float(), rtol=1e-5, atol=1e-5)

    assert len(estimator.calls) == 10
    first = estimator.calls[0]
    assert torch.equal(first["x"][:2], first["x"][2:]) and torch.equal(first["t"], torch.zeros(4))
    for key in ("mu", "spks", "cond"):
        assert first[key][2:].abs().sum() == 0


def test_cfm_starts_every_item_from_the_first_columns_of_the_seed0_noise():
    class _Still(nn.Module):
        out_channels = MEL

        def forward(self, x, mask, mu, t, spks, cond, streaming, all_valid=False):
            return torch.zeros_like(x)

    cfm = CausalConditionalCFM(_Still())
    expected = torch.randn(1, MEL, 15000, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cfm.rand_noise, expected)
    mask = torch.tensor([[1.0] * 9, [1.0] * 4 + [0.0] * 5])[:, None]
    out = cfm(torch.zeros(2, MEL, 9), mask, torch.zeros(2, MEL), torch.zeros(2, MEL, 9))
    assert torch.equal(out[0], expected[0, :, :9])
    assert torch.equal(out[1, :, :4], expected[0, :, :4])


def test_same_input_gives_identical_mel(tiny_flow):
    batch = _batch([_utterance(4, 10, seed=3)], [10])
    first, _ = tiny_flow.inference(**batch)
    second, _ = tiny_flow.inference(**batch)
    assert torch.equal(first, second)


def test_chunk_mask_allows_keys_up_to_the_end_of_the_query_chunk():
    mask = chunk_mask(7, 3, "cpu")
    expected = torch.tensor([[j < (i // 3 + 1) * 3 for j in range(7)] for i in range(7)])
    assert mask.dtype == torch.bool and torch.equal(mask, expected)


def _encode(encoder, xs: torch.Tensor, streaming: bool) -> torch.Tensor:
    with torch.no_grad():
        return encoder(xs, torch.tensor([xs.size(1)]), streaming=streaming)[0]


def test_streaming_encoder_differs_from_full_attention():
    torch.manual_seed(0)
    encoder = _tiny_encoder()
    xs = torch.randn(1, 60, 32)
    assert not torch.allclose(_encode(encoder, xs, True), _encode(encoder, xs, False), atol=1e-3)


def test_streaming_encoder_chunk_ignores_tokens_beyond_its_end_plus_lookahead():
    torch.manual_seed(0)
    encoder = _tiny_encoder()
    xs = torch.randn(1, 60, 32)
    changed = xs.clone()
    changed[:, 25 + LOOKAHEAD :] += 1.0  # first token the 25-token chunk cannot reach through the lookahead
    streamed, streamed_changed = _encode(encoder, xs, True), _encode(encoder, changed, True)
    torch.testing.assert_close(streamed[:, :50], streamed_changed[:, :50], rtol=0, atol=1e-6)
    assert not torch.allclose(streamed[:, 50:], streamed_changed[:, 50:], atol=1e-3)
    full, full_changed = _encode(encoder, xs, False), _encode(encoder, changed, False)
    assert not torch.allclose(full[:, :50], full_changed[:, :50], atol=1e-3)


@pytest.mark.parametrize("finalize", [True, False])
def test_the_encoders_output_lengths_are_known_on_the_host(finalize):
    torch.manual_seed(0)
    encoder = _tiny_encoder()
    lengths = [60, 41, 9, 4]
    xs = torch.randn(len(lengths), max(lengths), 32)
    with torch.no_grad():
        h, h_lens = encoder(xs, torch.tensor(lengths), streaming=True, finalize=finalize)
    assert encoder.output_lengths(lengths, finalize) == h_lens.tolist()
    assert h.size(1) == max(encoder.output_lengths(lengths, finalize))


def _alone_and_batched(flow, items, n_tokens, **flags):
    """Each item's mel from its own batch-1 call, plus (mel, mel_len) of one call on the whole batch."""
    alone = []
    for item, n in zip(items, n_tokens, strict=True):
        mel, mel_len = flow.inference(**_batch([item], [n]), **flags)
        alone.append(mel[0, :, : int(mel_len[0])])
    mel, mel_len = flow.inference(**_batch(items, n_tokens), **flags)
    return alone, mel, mel_len


def test_batched_items_match_single_item_calls_when_finalizing(tiny_flow):
    items = [_utterance(7, 30, seed=4), _utterance(4, 12, seed=5)]
    alone, mel, mel_len = _alone_and_batched(tiny_flow, items, [30, 12], streaming=False, finalize=True)
    for i, single in enumerate(alone):
        assert int(mel_len[i]) == single.size(1)
        torch.testing.assert_close(mel[i, :, : single.size(1)], single, rtol=0, atol=1e-4)


def test_batched_items_match_single_item_calls_for_streaming_chunks(tiny_flow):
    items = [_utterance(4, 12, seed=6), _utterance(7, 46, seed=7)]
    alone, mel, mel_len = _alone_and_batched(tiny_flow, items, [12, 46], streaming=True, finalize=False)
    for i, single in enumerate(alone):
        assert int(mel_len[i]) == single.size(1)
        torch.testing.assert_close(mel[i, :, : single.size(1)], single, rtol=0, atol=1e-4)


def test_chunk_call_frames_equal_a_longer_streaming_call_that_sees_the_same_lookahead(tiny_flow):
    # Prompt 7 + 18 tokens end on a 25-token chunk; the 3 tokens after them are the chunk's lookahead.
    utterance = _utterance(7, 46, seed=8)
    chunk_batch = _batch([utterance], [18 + LOOKAHEAD])
    chunk, chunk_len = tiny_flow.inference(**chunk_batch, streaming=True, finalize=False)
    longer, _ = tiny_flow.inference(**_batch([utterance], [46]), streaming=True, finalize=False)
    assert chunk_len.tolist() == [36]
    torch.testing.assert_close(chunk, longer[:, :, :36], rtol=0, atol=1e-4)


def test_full_attention_without_padding_needs_no_mask():
    """all_valid drops the attention mask; with every frame valid that is the same attention."""
    torch.manual_seed(2)
    estimator = CausalConditionalDecoder(
        channels=(32,), attention_head_dim=16, n_blocks=2, num_mid_blocks=1, num_heads=2, static_chunk_size=8
    ).eval()
    g = torch.Generator().manual_seed(4)
    x, mu, cond = (torch.randn(3, MEL, 23, generator=g) for _ in range(3))
    spks, t = torch.randn(3, MEL, generator=g), torch.rand(3, generator=g)
    mask = torch.ones(3, 1, 23)
    with torch.inference_mode():
        masked = estimator(x, mask, mu, t, spks, cond)
        unmasked = estimator(x, mask, mu, t, spks, cond, all_valid=True)
        # Streaming keeps its chunk mask whatever all_valid says.
        chunked = estimator(x, mask, mu, t, spks, cond, streaming=True)
        chunked_valid = estimator(x, mask, mu, t, spks, cond, streaming=True, all_valid=True)
    torch.testing.assert_close(unmasked, masked, rtol=1e-5, atol=1e-6)
    assert torch.equal(chunked, chunked_valid)
    assert not torch.allclose(chunked, masked, atol=1e-3)


def test_a_batch_of_one_length_matches_single_item_calls(tiny_flow):
    items = [_utterance(4, 12, seed=s) for s in (7, 8)]
    seen = []
    hook = tiny_flow.decoder.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(kwargs["all_valid"]), with_kwargs=True
    )
    try:
        both, lengths = tiny_flow.inference(**_batch(items, [12, 12]))
        tiny_flow.inference(**_batch(items, [12, 11]))  # padded: the decoder keeps its mask
        tiny_flow.inference(**_batch(items, [12, 12]), streaming=True, finalize=False)
        tiny_flow.inference(**_batch(items, [12, 10]), streaming=True, finalize=False)
    finally:
        hook.remove()
    assert seen == [True, False, True, False]
    assert lengths.tolist() == [24, 24]
    for i, item in enumerate(items):
        alone, _ = tiny_flow.inference(**_batch([item], [12]))
        torch.testing.assert_close(both[i : i + 1], alone, rtol=1e-5, atol=1e-5)

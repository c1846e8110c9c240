"""Bucket padding of the graphed flow estimator (CUDA graphs themselves are checked on the GPU run)."""

import copy

import pytest
import torch

from cosyapp.engine.token2wav.graphs import GraphedEstimator, bucket


def inputs(rows: int, frames: int, valid: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, 1, frames)
    for i, n in enumerate(valid):
        mask[i, :, :n] = 1
    return (
        torch.randn(rows, 80, frames, generator=g),
        mask,
        torch.randn(rows, 80, frames, generator=g),
        torch.rand(rows, generator=g),
        torch.randn(rows, 80, generator=g),
        torch.randn(rows, 80, frames, generator=g),
    )


def test_buckets_round_up():
    assert [bucket(n, (2, 4, 8)) for n in (1, 2, 3, 8, 9)] == [2, 2, 4, 8, None]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    ("rows", "frames", "valid"), [(2, 37, [37, 20]), (6, 130, [130, 64, 1, 99, 130, 50])]
)
def test_padding_to_a_bucket_leaves_valid_frames_unchanged(tiny_model, streaming, rows, frames, valid):
    estimator = tiny_model.flow.decoder.estimator
    graphed = GraphedEstimator(estimator, frame_buckets=(64, 128, 192), use_graphs=False)
    args = inputs(rows, frames, valid)
    with torch.inference_mode():
        expected = estimator(*args, streaming)
        got = graphed(*args, streaming)
    assert got.shape == expected.shape
    for i, n in enumerate(valid):
        torch.testing.assert_close(got[i, :, :n], expected[i, :, :n], atol=1e-5, rtol=1e-4)


def test_buckets_are_reused_and_stale_rows_do_not_leak(tiny_model):
    graphed = GraphedEstimator(tiny_model.flow.decoder.estimator, frame_buckets=(64, 128), use_graphs=False)
    with torch.inference_mode():
        graphed(*inputs(4, 60, [60, 60, 60, 60], seed=1))
        small = inputs(3, 50, [50, 40, 30], seed=2)
        got = graphed(*small)
        expected = tiny_model.flow.decoder.estimator(*small)
    assert graphed.captured == 1  # (4 rows, 64 frames) served both calls
    for i, n in enumerate([50, 40, 30]):
        torch.testing.assert_close(got[i, :, :n], expected[i, :, :n], atol=1e-5, rtol=1e-4)


def test_whole_flow_with_the_graphed_estimator_matches(tiny_model):
    flow = copy.deepcopy(tiny_model.flow)
    flow.decoder.estimator = GraphedEstimator(flow.decoder.estimator, use_graphs=False)
    g = torch.Generator().manual_seed(3)
    args = dict(
        token=torch.randint(0, 6561, (2, 30), generator=g),
        token_len=torch.tensor([30, 22]),
        prompt_token=torch.randint(0, 6561, (2, 10), generator=g),
        prompt_token_len=torch.tensor([10, 7]),
        prompt_feat=torch.randn(2, 20, 80, generator=g),
        prompt_feat_len=torch.tensor([20, 14]),
        embedding=torch.randn(2, 192, generator=g),
    )
    mel, mel_len = flow.inference(**args)
    ref, ref_len = tiny_model.flow.inference(**args)
    assert torch.equal(mel_len, ref_len)
    torch.testing.assert_close(mel, ref, atol=1e-4, rtol=1e-4)


def test_calls_past_the_largest_bucket_run_eagerly_without_a_capture(tiny_model):
    estimator = tiny_model.flow.decoder.estimator
    graphed = GraphedEstimator(estimator, row_buckets=(2,), frame_buckets=(64,), use_graphs=False)
    args = inputs(4, 70, [70, 70, 50, 10])
    with torch.inference_mode():
        got = graphed(*args)
        expected = estimator(*args)
    assert graphed.captured == 0
    torch.testing.assert_close(got, expected)


def test_capture_all_prepares_every_bucket_in_both_attention_modes(tiny_model):
    graphed = GraphedEstimator(
        tiny_model.flow.decoder.estimator, row_buckets=(2, 4), frame_buckets=(64, 128), use_graphs=False
    )
    with torch.inference_mode():
        assert graphed.capture_all(torch.device("cpu"), torch.float32) == 8
        graphed(*inputs(3, 100, [100, 90, 80]), True)
    assert graphed.captured == 8  # the call used a prepared bucket

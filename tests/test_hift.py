import math

import pytest
import torch

from cosyapp.models.hift import ConvRNNF0Predictor, HiFTGenerator, SineGen2, Snake

SAMPLES_PER_FRAME = 480
SR = 24000


def _tiny_hift() -> HiFTGenerator:
    return HiFTGenerator(base_channels=32, f0_predictor=ConvRNNF0Predictor(cond_channels=32))


@pytest.fixture(scope="module")
def full_hift() -> HiFTGenerator:
    torch.manual_seed(0)
    return HiFTGenerator().eval()


@pytest.fixture(scope="module")
def tiny_hift() -> HiFTGenerator:
    torch.manual_seed(0)
    return _tiny_hift().eval()


def _mel(batch: int, frames: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 80, frames, generator=g) * 2 - 5


def _sine_gen(harmonic_num: int = 0, noise_std: float = 0.0) -> SineGen2:
    return SineGen2(
        SR, SAMPLES_PER_FRAME, harmonic_num, sine_amp=0.1, noise_std=noise_std, voiced_threshold=10
    )


def _constant_f0(hz: float, frames: int) -> torch.Tensor:
    return torch.full((1, frames * SAMPLES_PER_FRAME, 1), hz)


def _upstream_noise(batch: int, length: int, channels: int) -> torch.Tensor:
    """Upstream's randn_like on the sines, a transposed (B, L, C) view of a (B, C, L) tensor."""
    return torch.randn_like(torch.empty(batch, channels, length).transpose(1, 2))


def _peak_hz(signal: torch.Tensor) -> float:
    spectrum = torch.fft.rfft(signal.double()).abs()
    return spectrum.argmax().item() * SR / signal.numel()


def test_meta_built_model_has_exactly_the_checkpoint_names_and_shapes(manifest):
    with torch.device("meta"):
        model = HiFTGenerator()
    assert {k: list(v.shape) for k, v in model.state_dict().items()} == manifest("hift.pt")


def test_random_state_dict_with_checkpoint_names_loads_strictly(manifest):
    g = torch.Generator().manual_seed(3)
    state = {name: torch.randn(shape, generator=g) for name, shape in manifest("hift.pt").items()}
    model = HiFTGenerator()
    result = model.load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert torch.equal(
        model.conv_pre.parametrizations.weight.original1, state["conv_pre.parametrizations.weight.original1"]
    )


def test_full_size_forward_gives_finite_audio_of_480_samples_per_frame(full_hift):
    frames = 20
    torch.manual_seed(0)
    with torch.inference_mode():
        speech, source = full_hift(_mel(2, frames))
    assert speech.shape == (2, SAMPLES_PER_FRAME * frames)
    assert source.shape == (2, 1, SAMPLES_PER_FRAME * frames)
    assert speech.dtype == torch.float32
    assert torch.isfinite(speech).all() and torch.isfinite(source).all()


@pytest.mark.parametrize("frames", [1, 3, 8, 17])
def test_output_has_480_samples_per_mel_frame(tiny_hift, frames):
    with torch.inference_mode():
        speech, source = tiny_hift(_mel(2, frames))
    assert speech.shape == (2, SAMPLES_PER_FRAME * frames)
    assert source.shape == (2, 1, SAMPLES_PER_FRAME * frames)


def test_output_is_clamped_to_audio_limit_for_extreme_inputs():
    torch.manual_seed(0)
    model = _tiny_hift().eval()
    with torch.no_grad():
        model.conv_post.bias[:9] = 10.0  # exp(10) magnitudes, far past the clip at 100
    with torch.inference_mode():
        speech, _ = model(torch.full((1, 80, 6), 10.0))
    assert speech.abs().max().item() == pytest.approx(0.99)
    assert (speech.abs() <= 0.99).all()


def test_same_seed_gives_identical_output_and_other_seed_differs(tiny_hift):
    mel = _mel(1, 5)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        with torch.inference_mode():
            runs.append(tiny_hift(mel))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][1], runs[2][1])


def test_cache_source_replaces_the_first_samples_of_the_source_only(tiny_hift):
    mel = _mel(2, 6)
    cache = torch.linspace(-0.5, 0.5, 1000).expand(2, 1, 1000)
    with torch.inference_mode():
        torch.manual_seed(5)
        _, plain_source = tiny_hift(mel)
        torch.manual_seed(5)
        speech, source = tiny_hift(mel, cache_source=cache)
    assert torch.equal(source[:, :, :1000], cache)
    assert torch.equal(source[:, :, 1000:], plain_source[:, :, 1000:])
    assert speech.shape == (2, SAMPLES_PER_FRAME * 6)


def test_empty_cache_source_changes_nothing(tiny_hift):
    mel = _mel(1, 4)
    with torch.inference_mode():
        torch.manual_seed(2)
        plain = tiny_hift(mel)
        torch.manual_seed(2)
        cached = tiny_hift(mel, cache_source=torch.zeros(1, 1, 0))
    assert torch.equal(plain[0], cached[0]) and torch.equal(plain[1], cached[1])


def test_forward_draws_rand_then_two_randn_from_the_default_generator(tiny_hift):
    batch, frames = 2, 3
    length = frames * SAMPLES_PER_FRAME
    torch.manual_seed(11)
    with torch.inference_mode():
        tiny_hift(_mel(batch, frames))
    after_forward = torch.rand(4)
    torch.manual_seed(11)
    torch.rand(batch, 9)
    _upstream_noise(batch, length, 9)
    torch.randn(batch, length, 1)
    assert torch.equal(after_forward, torch.rand(4))


def test_constant_f0_gives_sines_at_the_f0_and_its_harmonics():
    frames = 20
    sines = _sine_gen(harmonic_num=8)(_constant_f0(200.0, frames))[0]
    assert sines.shape == (frames * SAMPLES_PER_FRAME, 9)
    for h in range(9):
        assert _peak_hz(sines[:, h]) == pytest.approx(200.0 * (h + 1))
    fundamental = sines[:, 0]
    # The phase is held constant over the first and last half frame (240 samples each), so 200 Hz
    # over the remaining 9120 samples = 76 periods = 152 sign changes.
    crossings = (fundamental[1:].sign() != fundamental[:-1].sign()).sum().item()
    assert crossings == 152
    assert torch.equal(fundamental[:240], fundamental[:1].expand(240))
    assert fundamental.abs().max().item() == pytest.approx(0.1, abs=1e-4)


def test_phase_stays_continuous_across_an_f0_change():
    f0 = torch.cat([_constant_f0(150.0, 5), _constant_f0(300.0, 5)], dim=1)
    sine = _sine_gen()(f0)[0, :, 0]
    # A continuous 300 Hz sine at 24 kHz moves at most 0.1 * 2*pi*300/24000 per sample.
    assert sine.diff().abs().max().item() < 0.1 * 2 * math.pi * 300 / SR * 1.01


def test_random_initial_phase_does_not_change_voiced_sines():
    f0 = _constant_f0(220.0, 4)
    torch.manual_seed(0)
    first = _sine_gen(harmonic_num=8)(f0)
    torch.manual_seed(1)
    second = _sine_gen(harmonic_num=8)(f0)
    assert torch.equal(first, second)


def test_unvoiced_frames_are_pure_noise_at_a_third_of_sine_amp():
    frames = 10
    torch.manual_seed(4)
    out = _sine_gen(harmonic_num=8, noise_std=0.003)(_constant_f0(5.0, frames))
    torch.manual_seed(4)
    torch.rand(1, 9)
    expected = _upstream_noise(1, frames * SAMPLES_PER_FRAME, 9) * (0.1 / 3)
    torch.testing.assert_close(out, expected)
    assert out.std().item() == pytest.approx(0.1 / 3, rel=0.02)


def test_voiced_frames_get_noise_at_nsf_sigma():
    frames = 4
    f0 = _constant_f0(200.0, frames)
    clean = _sine_gen(harmonic_num=8)(f0)
    torch.manual_seed(9)
    noisy = _sine_gen(harmonic_num=8, noise_std=0.003)(f0)
    torch.manual_seed(9)
    torch.rand(1, 9)
    expected_noise = _upstream_noise(1, frames * SAMPLES_PER_FRAME, 9) * 0.003
    torch.testing.assert_close(noisy - clean, expected_noise)


def test_f0_predictor_returns_non_negative_hz_per_frame():
    torch.manual_seed(0)
    f0 = ConvRNNF0Predictor(cond_channels=16)(_mel(2, 7))
    assert f0.shape == (2, 7)
    assert (f0 >= 0).all()


def test_snake_adds_sin_squared_over_alpha():
    snake = Snake(2)
    with torch.no_grad():
        snake.alpha.copy_(torch.tensor([0.5, 2.0]))
    x = torch.tensor([[[1.0, -2.0], [0.3, 4.0]]])
    alpha = torch.tensor([0.5, 2.0])[None, :, None]
    torch.testing.assert_close(snake(x), x + torch.sin(alpha * x) ** 2 / alpha)


@pytest.mark.parametrize("layer", ["conv_pre", "ups.0", "resblocks.4.convs1.2"])
def test_weight_norm_weight_is_g_times_v_over_its_norm(layer):
    model = _tiny_hift()
    module = model.get_submodule(layer)
    g = torch.rand_like(module.parametrizations.weight.original0) + 0.5
    v = torch.randn_like(module.parametrizations.weight.original1)
    model.load_state_dict(
        {
            **model.state_dict(),
            f"{layer}.parametrizations.weight.original0": g,
            f"{layer}.parametrizations.weight.original1": v,
        }
    )
    norm = v.flatten(1).norm(dim=1)[:, None, None]
    torch.testing.assert_close(module.weight, g * v / norm)


def test_stft_window_is_scipys_periodic_hann(tiny_hift):
    signal = pytest.importorskip("scipy.signal")
    expected = torch.from_numpy(signal.get_window("hann", 16, fftbins=True)).float()
    assert torch.equal(tiny_hift.stft_window, expected)


def test_meta_built_model_runs_on_cpu_after_assign_load(tiny_hift):
    with torch.device("meta"):
        model = _tiny_hift()
    model.load_state_dict(tiny_hift.state_dict(), strict=True, assign=True)
    mel = _mel(1, 4)
    with torch.inference_mode():
        torch.manual_seed(3)
        expected, _ = tiny_hift(mel)
        torch.manual_seed(3)
        speech, _ = model.eval()(mel)
    assert torch.equal(speech, expected)


def test_batched_output_with_generators_equals_each_item_run_alone(tiny_hift):
    mel = _mel(3, 6)
    seeds = (21, 22, 23)
    # The noise draws are identical; batched convolutions round differently (measured <= 1.3e-7),
    # far below the noise amplitudes (0.003 voiced, 0.033 unvoiced) a wrong draw would show.
    with torch.inference_mode():
        speech, source = tiny_hift(mel, generators=[torch.Generator().manual_seed(s) for s in seeds])
        for i, seed in enumerate(seeds):
            alone, alone_source = tiny_hift(mel[i : i + 1], generators=[torch.Generator().manual_seed(seed)])
            torch.testing.assert_close(speech[i : i + 1], alone, rtol=0, atol=1e-6)
            torch.testing.assert_close(source[i : i + 1], alone_source, rtol=0, atol=1e-6)


def test_a_generator_draws_what_the_default_generator_seeded_alike_draws(tiny_hift):
    mel = _mel(1, 5)
    with torch.inference_mode():
        torch.manual_seed(31)
        expected = tiny_hift(mel)
        torch.manual_seed(0)
        got = tiny_hift(mel, generators=[torch.Generator().manual_seed(31)])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_fused_weight_norm_gives_the_same_audio_without_parametrizations():
    torch.manual_seed(0)
    model = _tiny_hift().eval()
    mel = _mel(2, 9)
    with torch.inference_mode():
        expected, _ = model(mel, generators=[torch.Generator().manual_seed(i) for i in range(2)])
        model.fuse_weight_norm()
        got, _ = model(mel, generators=[torch.Generator().manual_seed(i) for i in range(2)])
    assert not any("parametrizations" in name for name in model.state_dict())
    assert "conv_pre.weight" in model.state_dict()
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_noise_drawn_ahead_gives_the_same_audio_and_leaves_the_generators_where_a_call_would(tiny_hift):
    mel, cache = _mel(3, 7), torch.randn(3, 1, 480 * 2) * 0.1
    seeds = (41, 42, 43)

    def generators():
        return [torch.Generator().manual_seed(s) for s in seeds]

    with torch.inference_mode():
        drawing = generators()
        expected = tiny_hift(mel, cache, generators=drawing)
        ahead = generators()
        got = tiny_hift(mel, cache, noise=tiny_hift.draw_noise(mel, ahead))
        # each generator then continues exactly as after a call that drew for itself
        assert all(torch.equal(a.get_state(), d.get_state()) for a, d in zip(ahead, drawing, strict=True))
        torch.manual_seed(5)
        default_expected = tiny_hift(mel, cache)
        torch.manual_seed(5)
        default_got = tiny_hift(mel, cache, noise=tiny_hift.draw_noise(mel))
    for want, have in ((expected, got), (default_expected, default_got)):
        assert torch.equal(want[0], have[0]) and torch.equal(want[1], have[1])
    assert not torch.equal(expected[0], default_expected[0])  # the noise matters


@pytest.mark.parametrize(("batch", "frames"), [(1, 2), (3, 241), (2, 1441)])
def test_istft_without_the_nola_check_is_torch_istft_bit_for_bit(tiny_hift, batch, frames):
    g = torch.Generator().manual_seed(frames)
    magnitude = torch.rand(batch, 9, frames, generator=g) * 200  # past the clamp at 100 too
    phase = torch.rand(batch, 9, frames, generator=g) * 6 - 3
    clamped = torch.clamp(magnitude, max=1e2)
    spec = torch.complex(clamped * torch.cos(phase), clamped * torch.sin(phase))
    window = tiny_hift._window(magnitude)
    expected = torch.istft(spec, tiny_hift.n_fft, tiny_hift.hop_len, tiny_hift.n_fft, window=window)
    assert torch.equal(tiny_hift._istft(magnitude, phase), expected)

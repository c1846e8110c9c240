"""HiFT vocoder of CosyVoice 2: mel (B, 80, F) -> 24 kHz waveform (B, 480*F).

F0 predictor -> harmonic neural source (SineGen2) -> HiFi-GAN body fed with the source's STFT ->
iSTFT -> clamp. Module names follow the official `hift.pt`, so
`HiFTGenerator().load_state_dict(state_dict, strict=True)` works on it.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

Generators = Sequence[torch.Generator] | None


def _randn_like(x: Tensor, generators: Generators) -> Tensor:
    """randn_like(x) from the default generator, or item i of the batch from generators[i].

    Per item, the draw is the one a batch-1 call with that generator (or with the default generator
    seeded alike) makes: empty_like + normal_ is what randn_like does, strides included.
    """
    if generators is None:
        return torch.randn_like(x)
    assert len(generators) == x.shape[0], f"{len(generators)} generators for a batch of {x.shape[0]}"
    return torch.cat([torch.empty_like(x[i : i + 1]).normal_(generator=g) for i, g in enumerate(generators)])


def _rand(batch: int, n: int, like: Tensor, generators: Generators) -> Tensor:
    """rand(batch, n) on like's device and dtype, per item from generators[i] when given."""
    if generators is None:
        return torch.rand(batch, n, device=like.device, dtype=like.dtype)
    return torch.cat(
        [torch.rand(1, n, generator=g, device=like.device, dtype=like.dtype) for g in generators]
    )


@dataclass
class SourceNoise:
    """The random numbers one HiFT call draws, drawn ahead (``HiFTGenerator.draw_noise``), so a call
    can take them as inputs (a CUDA graph replays no draws): the initial phases (B, H+1), the sines'
    noise (B, L, H+1, laid out as (B, H+1, L) like the sines it is drawn for) and the unused noise
    branch (B, L, 1) that upstream draws too."""

    phases: Tensor
    sines: Tensor
    spare: Tensor


def _same_padding(kernel_size: int, dilation: int = 1) -> int:
    return dilation * (kernel_size - 1) // 2


def _periodic_hann(n_fft: int) -> Tensor:
    # Computed in float64 then cast, like upstream's scipy get_window("hann", n, fftbins=True).
    # Explicit CPU so the model can be built under `torch.device("meta")`.
    return torch.hann_window(n_fft, periodic=True, dtype=torch.float64, device="cpu").to(torch.float32)


class Snake(nn.Module):
    """Snake activation x + sin^2(alpha*x)/alpha with a per-channel alpha (linear scale); (B, C, T)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        return snake(x, self.alpha)


def snake(x: Tensor, alpha: Tensor) -> Tensor:
    """The Snake activation of x (B, C, T) with per-channel alpha (C,)."""
    alpha = alpha[None, :, None]
    # Reciprocal-then-multiply (not a division) as upstream, for bitwise parity.
    return x + (1.0 / (alpha + 1e-9)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Three residual (Snake -> dilated conv -> Snake -> conv) units; (B, C, T) -> (B, C, T)."""

    def __init__(self, channels: int, kernel_size: int, dilations: Sequence[int]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            weight_norm(
                nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=_same_padding(kernel_size, d))
            )
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            weight_norm(nn.Conv1d(channels, channels, kernel_size, padding=_same_padding(kernel_size)))
            for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:
        for act1, conv1, act2, conv2 in zip(
            self.activations1, self.convs1, self.activations2, self.convs2, strict=True
        ):
            x = x + conv2(act2(conv1(act1(x))))
        return x


class ConvRNNF0Predictor(nn.Module):
    """Per-frame F0 in Hz from a mel: (B, in_channels, F) -> (B, F), always >= 0."""

    def __init__(self, num_class: int = 1, in_channels: int = 80, cond_channels: int = 512):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            conv = nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1)
            layers += [weight_norm(conv), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, num_class)

    def forward(self, mel: Tensor) -> Tensor:
        x = self.condnet(mel).transpose(1, 2)
        return torch.abs(self.classifier(x).squeeze(-1))


class SineGen2(nn.Module):
    """Harmonic sines plus noise from a sample-rate F0 track (upstream's "type 2" sine generator).

    Takes f0 (B, L, 1) in Hz with L a multiple of `upsample_scale`; returns (B, L, harmonic_num + 1).
    Draws, in this order from the default generator of f0's device: rand(B, H+1) initial phases and
    randn(B, L, H+1) noise; with `generators`, item i makes its batch-1 draws from generators[i].
    """

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        harmonic_num: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ):
        super().__init__()
        self.sampling_rate = sampling_rate
        self.upsample_scale = upsample_scale
        self.harmonic_num = harmonic_num
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold

    def _phase(self, freqs: Tensor, generators: Generators, initial: Tensor | None = None) -> Tensor:
        # Only the integer-free part of the per-sample increment matters: sin(2*pi*n) = 0.
        increments = (freqs / self.sampling_rate) % 1
        # The random initial phase lands on sample 0, which the frame-rate interpolation below never
        # reads, so it has no effect; it is kept because it consumes RNG exactly as upstream does.
        if initial is None:
            initial = _rand(freqs.shape[0], freqs.shape[2], freqs, generators)
        initial = torch.cat([torch.zeros_like(initial[:, :1]), initial[:, 1:]], dim=1)
        increments = torch.cat([increments[:, :1] + initial[:, None], increments[:, 1:]], dim=1)
        # Accumulating at frame rate and interpolating the phase back keeps it continuous across
        # frames with different F0 (no clicks at pitch changes), at 1/480 of the cumsum length.
        frame_increments = F.interpolate(
            increments.transpose(1, 2), scale_factor=1 / self.upsample_scale, mode="linear"
        ).transpose(1, 2)
        phase = torch.cumsum(frame_increments, dim=1) * 2 * math.pi
        return F.interpolate(
            phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale, mode="linear"
        ).transpose(1, 2)

    def forward(self, f0: Tensor, generators: Generators = None, noise: SourceNoise | None = None) -> Tensor:
        """``noise``: the call's draws made ahead (HiFTGenerator.draw_noise) instead of drawing here."""
        harmonics = torch.arange(1, self.harmonic_num + 2, device=f0.device, dtype=f0.dtype)
        phases = None if noise is None else noise.phases
        sines = torch.sin(self._phase(f0 * harmonics, generators, phases)) * self.sine_amp
        voiced = (f0 > self.voiced_threshold).to(f0.dtype)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        # `sines` is a transposed view in (B, H+1, L) memory order. randn_like keeps that layout (and on
        # CPU a non-contiguous normal_ uses another sampler), so the noise matches upstream's draw only
        # while `sines` stays this view: making it contiguous would change the audio for a given seed.
        drawn = _randn_like(sines, generators) if noise is None else noise.sines
        return sines * voiced + noise_amp * drawn


class SourceModuleHnNSF(nn.Module):
    """Neural source: harmonics merged by a Linear(H+1 -> 1) and tanh; f0 (B, L, 1) -> (B, L, 1)."""

    def __init__(
        self,
        sampling_rate: int,
        upsample_scale: int,
        harmonic_num: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ):
        super().__init__()
        self.sine_amp = sine_amp
        self.l_sin_gen = SineGen2(
            sampling_rate, upsample_scale, harmonic_num, sine_amp, noise_std, voiced_threshold
        )
        self.l_linear = nn.Linear(harmonic_num + 1, 1)

    def forward(self, f0: Tensor, generators: Generators = None, noise: SourceNoise | None = None) -> Tensor:
        excitation = self.l_sin_gen(f0, generators, noise)
        merged = torch.tanh(self.l_linear(excitation))
        if noise is None:
            # Upstream also returns a noise branch nobody uses; drawing it keeps the RNG stream in step.
            _randn_like(f0, generators)
        return merged


class HiFTGenerator(nn.Module):
    """CosyVoice 2 vocoder. forward(mel (B, 80, F), cache_source) -> (speech (B, 480F), source (B, 1, 480F)).

    Keyword names mirror the upstream yaml (`istft_params` is split into `istft_n_fft`/`istft_hop_len`);
    defaults are the official CosyVoice2-0.5B values.
    """

    def __init__(
        self,
        in_channels: int = 80,
        base_channels: int = 512,
        nb_harmonics: int = 8,
        sampling_rate: int = 24000,
        nsf_alpha: float = 0.1,
        nsf_sigma: float = 0.003,
        nsf_voiced_threshold: float = 10.0,
        upsample_rates: Sequence[int] = (8, 5, 3),
        upsample_kernel_sizes: Sequence[int] = (16, 11, 7),
        istft_n_fft: int = 16,
        istft_hop_len: int = 4,
        resblock_kernel_sizes: Sequence[int] = (3, 7, 11),
        resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        source_resblock_kernel_sizes: Sequence[int] = (7, 7, 11),
        source_resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3, 5), (1, 3, 5), (1, 3, 5)),
        lrelu_slope: float = 0.1,
        audio_limit: float = 0.99,
        f0_predictor: ConvRNNF0Predictor | None = None,
    ):
        super().__init__()
        self.n_fft = istft_n_fft
        self.hop_len = istft_hop_len
        self.lrelu_slope = lrelu_slope
        self.audio_limit = audio_limit
        self.upsample_scale = math.prod(upsample_rates) * istft_hop_len
        self.num_kernels = len(resblock_kernel_sizes)
        # Upstream picks SineGen (type 1) only at 22050 Hz; CosyVoice 2 runs at 24 kHz, so only
        # SineGen2 is implemented.
        self.m_source = SourceModuleHnNSF(
            sampling_rate, self.upsample_scale, nb_harmonics, nsf_alpha, nsf_sigma, nsf_voiced_threshold
        )
        self.f0_predictor = (
            ConvRNNF0Predictor(in_channels=in_channels) if f0_predictor is None else f0_predictor
        )
        self.conv_pre = weight_norm(nn.Conv1d(in_channels, base_channels, 7, padding=3))

        stage_channels = [base_channels // 2 ** (i + 1) for i in range(len(upsample_rates))]
        self.ups = nn.ModuleList(
            weight_norm(nn.ConvTranspose1d(2 * ch, ch, k, u, padding=(k - u) // 2))
            for ch, u, k in zip(stage_channels, upsample_rates, upsample_kernel_sizes, strict=True)
        )
        # The source STFT runs at the final frame rate; stage i sees it downsampled by the product
        # of the upsample rates still to come.
        stft_channels = istft_n_fft + 2
        self.source_downs = nn.ModuleList()
        for i, ch in enumerate(stage_channels):
            rate = math.prod(upsample_rates[i + 1 :])
            if rate == 1:
                self.source_downs.append(nn.Conv1d(stft_channels, ch, 1))
            else:
                self.source_downs.append(nn.Conv1d(stft_channels, ch, 2 * rate, rate, padding=rate // 2))
        self.source_resblocks = nn.ModuleList(
            ResBlock(ch, k, d)
            for ch, k, d in zip(
                stage_channels, source_resblock_kernel_sizes, source_resblock_dilation_sizes, strict=True
            )
        )
        self.resblocks = nn.ModuleList(
            ResBlock(ch, k, d)
            for ch in stage_channels
            for k, d in zip(resblock_kernel_sizes, resblock_dilation_sizes, strict=True)
        )
        self.conv_post = weight_norm(nn.Conv1d(stage_channels[-1], stft_channels, 7, padding=3))
        # A plain attribute, not a buffer: checkpoints carry no window and strict loading must not
        # expect one. Moved to the input's device in forward.
        self.stft_window = _periodic_hann(istft_n_fft)
        self._windows: dict[tuple, Tensor] = {}  # stft_window per (device, dtype), made at first use

    def fuse_weight_norm(self) -> None:
        """Store each weight-normed weight as a plain weight, for serving.

        The weight-norm parametrization recomputes g * v / ||v|| at every call of every conv (three
        extra kernels each, ~60 convs); after this the same values are computed once. The module then
        no longer loads official checkpoints (their names are the parametrization's), so call it after
        loading.
        """
        for module in self.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)

    def _window(self, like: Tensor) -> Tensor:
        """The STFT window on ``like``'s device and dtype, copied there once (a copy from host memory
        at every call would wait for it, and cannot be part of a CUDA graph)."""
        key = (like.device, like.dtype)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = self.stft_window.to(device=like.device, dtype=like.dtype)
        return window

    def _source(self, mel: Tensor, generators: Generators, noise: SourceNoise | None = None) -> Tensor:
        f0 = self.f0_predictor(mel)
        f0 = F.interpolate(f0[:, None], scale_factor=float(self.upsample_scale), mode="nearest")
        return self.m_source(f0.transpose(1, 2), generators, noise).transpose(1, 2)

    def draw_noise(self, mel: Tensor, generators: Generators = None) -> SourceNoise:
        """What a call on ``mel`` (B, 80, F) would draw, drawn now in the same order from the same
        generators (per item from generators[i], as in forward), for ``forward(noise=...)``."""
        batch, samples = mel.shape[0], mel.shape[2] * self.upsample_scale
        channels = self.m_source.l_sin_gen.harmonic_num + 1
        like = mel.new_empty(0)
        phases = _rand(batch, channels, like, generators)
        # the layouts forward draws into: the sines' transposed view, then f0's (B, L, 1)
        sines = _randn_like(mel.new_empty(batch, channels, samples).transpose(1, 2), generators)
        spare = _randn_like(mel.new_empty(batch, samples, 1), generators)
        return SourceNoise(phases, sines, spare)

    def _stft(self, source: Tensor) -> Tensor:
        spec = torch.stft(
            source, self.n_fft, self.hop_len, self.n_fft, window=self._window(source), return_complex=True
        )
        return torch.cat([spec.real, spec.imag], dim=1)

    def _istft(self, magnitude: Tensor, phase: Tensor) -> Tensor:
        """torch.istft(spec, n_fft, hop, n_fft, window) (center=True), step by step as torch does it:
        inverse real FFT per frame, window, overlap-add, divided by the window's own overlap-add, the
        n_fft/2 samples of centring trimmed at each end; the same values, bit for bit. torch.istft
        also checks the divisor for zeros (its NOLA check), which reads a value back from the GPU;
        the periodic Hann window at a quarter-window hop never overlap-adds to zero inside the kept
        samples, so this skips the check, and a HiFT call has no host sync (a CUDA graph can hold it)."""
        magnitude = torch.clamp(magnitude, max=1e2)
        spec = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        window, frames = self._window(magnitude), spec.size(2)
        length = self.n_fft + self.hop_len * (frames - 1)
        waves = torch.fft.irfft(spec.transpose(1, 2), n=self.n_fft, dim=-1) * window  # (B, T, n_fft)
        added = torch.ops.aten.unfold_backward(waves, [spec.size(0), length], 1, self.n_fft, self.hop_len)
        envelope = torch.ops.aten.unfold_backward(
            window.pow(2).expand(1, frames, self.n_fft), [1, length], 1, self.n_fft, self.hop_len
        )
        half = self.n_fft // 2
        return added[:, half : length - half] / envelope[:, half : length - half]

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """Waveform (B, 480F) from mel (B, 80, F) and source (B, 1, 480F), clamped to +-audio_limit."""
        s_stft = self._stft(source.squeeze(1))
        x = self.conv_pre(mel)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.lrelu_slope))
            if i == len(self.ups) - 1:
                # The last transposed conv yields one frame fewer than the STFT's L/hop + 1.
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
            blocks = self.resblocks[i * self.num_kernels : (i + 1) * self.num_kernels]
            x = sum(block(x) for block in blocks) / self.num_kernels
        # Default slope 0.01 here, not lrelu_slope: upstream calls leaky_relu without one.
        x = self.conv_post(F.leaky_relu(x))
        n_bins = self.n_fft // 2 + 1
        magnitude = torch.exp(x[:, :n_bins])
        # sin() before using it as a phase is redundant but part of the trained model.
        phase = torch.sin(x[:, n_bins:])
        return torch.clamp(self._istft(magnitude, phase), -self.audio_limit, self.audio_limit)

    def forward(
        self,
        speech_feat: Tensor,
        cache_source: Tensor | None = None,
        *,
        generators: Sequence[torch.Generator] | None = None,
        noise: SourceNoise | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Vocode a mel (upstream's `inference`).

        speech_feat: (B, in_channels, F) log-mel. cache_source: optional (B, 1, c) source samples
        from the previous streaming chunk; they replace the first c samples of the new source so its
        phase continues. generators: optional, one per item on the mel's device; item i then draws
        its source noise from generators[i] exactly as a batch-1 call would, so its audio does not
        depend on the rest of the batch. None draws from torch's default generator, as upstream.
        noise: the call's draws made ahead (``draw_noise``); then nothing is drawn here.
        Returns (speech (B, 480F), source (B, 1, 480F)).
        Unlike upstream, not decorated with inference_mode: the caller picks the grad mode.
        """
        source = self._source(speech_feat, generators, noise)
        if cache_source is not None and cache_source.shape[2] > 0:
            c = cache_source.shape[2]
            assert c <= source.shape[2], (
                f"cache_source has {c} samples, the new source only {source.shape[2]}"
            )
            # Same values as upstream's in-place slice assignment, without mutating an autograd tensor.
            source = torch.cat([cache_source.to(source.dtype), source[:, :, c:]], dim=2)
        return self.decode(speech_feat, source), source

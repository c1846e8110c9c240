"""A prompt recording -> the features CosyVoice 2 conditions on (docs/model.md §2, §3.4-3.7, §9).

Three views of the same recording: speech tokens from whisper log-mels at 16 kHz through
``speech_tokenizer_v2.onnx``, a CAM++ x-vector from mean-normalised kaldi fbanks at 16 kHz through
``campplus.onnx``, and the 24 kHz Matcha mel the flow is prompted with. Tokens and mel are then
trimmed so that every token has exactly two mel frames.
"""

import functools
from pathlib import Path

import librosa
import numpy as np
import torch
import torch.nn.functional as F
import torchaudio
from torchaudio.compliance import kaldi

from cosyapp.frontend.audio import MAX_PROMPT_SECONDS, PromptAudio
from cosyapp.frontend.features import MEL_BINS, VoiceFeatures
from cosyapp.models.cosyvoice2 import SAMPLES_PER_FRAME, TOKEN_MEL_RATIO

CAMPPLUS_FILE = "campplus.onnx"
SPEECH_TOKENIZER_FILE = "speech_tokenizer_v2.onnx"
TOKENIZER_RATE = 16_000
MEL_RATE = 24_000

WHISPER_N_FFT, WHISPER_HOP, WHISPER_MELS = 400, 160, 128
MEL_N_FFT, MEL_FMAX = 1920, 8000.0


def resample(wave: torch.Tensor, orig_rate: int, target_rate: int) -> torch.Tensor:
    """torchaudio's windowed-sinc resampler at its defaults, as upstream; (N,) -> (N',).

    See docs/model.md §3.3.
    """
    if orig_rate == target_rate:
        return wave
    return _resampler(orig_rate, target_rate)(wave)


@functools.cache
def _resampler(orig_rate: int, target_rate: int) -> torchaudio.transforms.Resample:
    # The transform, not torchaudio.functional.resample: its kernel is built in float64 as upstream's,
    # which moves the output by up to ~1e-5.
    return torchaudio.transforms.Resample(orig_rate, target_rate)


@functools.cache
def _mel_filters(sample_rate: int, n_fft: int, n_mels: int, fmax: float | None) -> torch.Tensor:
    """librosa's slaney-scale, slaney-normalised filterbank, (n_mels, n_fft // 2 + 1)."""
    basis = librosa.filters.mel(sr=sample_rate, n_fft=n_fft, n_mels=n_mels, fmin=0.0, fmax=fmax)
    return torch.from_numpy(basis).float()


def whisper_log_mel(wave16k: torch.Tensor) -> torch.Tensor:
    """Whisper's 128-band log-mel (docs/model.md §3.4): (N,) at 16 kHz -> (1, 128, N // 160)."""
    window = torch.hann_window(WHISPER_N_FFT)
    spec = torch.stft(wave16k, WHISPER_N_FFT, WHISPER_HOP, window=window, return_complex=True)
    power = spec[:, :-1].abs() ** 2  # whisper drops the last (centred, half-padded) frame
    mel = _mel_filters(TOKENIZER_RATE, WHISPER_N_FFT, WHISPER_MELS, None) @ power
    log_mel = mel.clamp(min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return ((log_mel + 4.0) / 4.0)[None]


def kaldi_fbank_cmn(wave16k: torch.Tensor) -> torch.Tensor:
    """80-bin kaldi fbank minus its per-bin mean over time, CAM++'s input (docs/model.md §3.5).

    (N,) at 16 kHz in float [-1, 1] scale (not int16 scale) -> (1 + (N - 400) // 160, 80).
    """
    feats = kaldi.fbank(wave16k[None], num_mel_bins=MEL_BINS, dither=0.0, sample_frequency=TOKENIZER_RATE)
    return feats - feats.mean(dim=0, keepdim=True)


def prompt_mel(wave24k: torch.Tensor) -> torch.Tensor:
    """Matcha's mel_spectrogram with CosyVoice 2's settings: (N,) at 24 kHz -> (N // 480, 80).

    See docs/model.md §3.6.
    """
    pad = (MEL_N_FFT - SAMPLES_PER_FRAME) // 2
    padded = F.pad(wave24k[None, None], (pad, pad), mode="reflect")[0, 0]
    window = torch.hann_window(MEL_N_FFT)
    spec = torch.stft(padded, MEL_N_FFT, SAMPLES_PER_FRAME, window=window, center=False, return_complex=True)
    magnitude = torch.sqrt(spec.real**2 + spec.imag**2 + 1e-9)
    mel = _mel_filters(MEL_RATE, MEL_N_FFT, MEL_BINS, MEL_FMAX) @ magnitude
    return mel.clamp(min=1e-5).log().T.contiguous()


def align_tokens_and_mel(tokens: torch.Tensor, mel: torch.Tensor, embedding: torch.Tensor) -> VoiceFeatures:
    """Trim tokens (P_raw,) and mel (T50, 80) to P = min(T50 // 2, P_raw) tokens and 2P frames.

    See docs/model.md §3.7.
    """
    n = min(len(mel) // TOKEN_MEL_RATIO, len(tokens))
    assert n > 0, "a validated prompt (>= 1 s) always yields tokens"
    return VoiceFeatures(tokens[:n].clone(), mel[: TOKEN_MEL_RATIO * n].clone(), embedding)


class VoiceFrontend:
    """Runs the two frontend ONNX networks of a model folder on prompt recordings.

    CAM++ runs on the CPU; the speech tokenizer runs on CUDA when ``device`` is a CUDA device
    (docs/model.md §9).
    """

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu") -> None:
        import onnxruntime as ort

        model_dir, device = Path(model_dir), torch.device(device)
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = 1
        cpu = ["CPUExecutionProvider"]
        cuda = ("CUDAExecutionProvider", {"device_id": device.index or 0})
        # onnxruntime warns by itself and stays on the CPU if its CUDA provider is missing.
        tokenizer_providers = [cuda, *cpu] if device.type == "cuda" else cpu
        self._campplus = _open_session(ort, model_dir / CAMPPLUS_FILE, options, cpu)
        self._tokenizer = _open_session(ort, model_dir / SPEECH_TOKENIZER_FILE, options, tokenizer_providers)

    def features(self, audio: PromptAudio) -> VoiceFeatures:
        """Speech tokens, x-vector and prompt mel of a validated recording, aligned 1:2."""
        wave = torch.from_numpy(audio.samples)
        wave16k = resample(wave, audio.sample_rate, TOKENIZER_RATE)
        tokens = self.speech_tokens(wave16k)
        embedding = self.speaker_embedding(wave16k)
        mel = prompt_mel(resample(wave, audio.sample_rate, MEL_RATE))
        return align_tokens_and_mel(tokens, mel, embedding)

    def speech_tokens(self, wave16k: torch.Tensor) -> torch.Tensor:
        """(N,) at 16 kHz, at most 30 s -> (P_raw,) long token ids at 25 Hz, as many as the graph returns."""
        assert len(wave16k) <= MAX_PROMPT_SECONDS * TOKENIZER_RATE, "the speech tokenizer takes at most 30 s"
        feats = whisper_log_mel(wave16k).numpy()
        inputs = self._tokenizer.get_inputs()
        outputs = self._tokenizer.run(
            None,
            {
                inputs[0].name: feats,
                inputs[1].name: np.array([feats.shape[2]], dtype=np.int32),
            },
        )
        return torch.from_numpy(outputs[0].reshape(-1).astype(np.int64))

    def speaker_embedding(self, wave16k: torch.Tensor) -> torch.Tensor:
        """(N,) at 16 kHz -> the (192,) float32 CAM++ x-vector."""
        feats = kaldi_fbank_cmn(wave16k)[None].numpy()
        outputs = self._campplus.run(None, {self._campplus.get_inputs()[0].name: feats})
        return torch.from_numpy(outputs[0].reshape(-1).astype(np.float32))


def _open_session(ort, path: Path, options, providers: list):
    """An onnxruntime session on one of the model folder's ONNX files."""
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} is missing from the model folder {path.parent}")
    return ort.InferenceSession(str(path), sess_options=options, providers=providers)

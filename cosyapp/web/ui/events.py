"""What the page's events do: turn form values into SynthesisRequests for the shared Pipeline.

Two ways to speak, both named API endpoints:
- ``speak`` (streaming): one async generator per session, fed by ``Pipeline.stream``; closing it
  (Stop, a closed tab, a cancelled client job) closes the pipeline stream, which aborts its work.
- ``speak_clip`` (whole clip): a Gradio batch function; the queue hands it every waiting request at
  once and it runs them through ``Pipeline.synthesize_batch``.

Every error a user can cause leaves here as ``gr.Error`` with a readable message.
"""

import asyncio
import html
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import gradio as gr
import numpy as np

from cosyapp.engine.pipeline import MAX_SEED, BusyError, SynthesisRequest, check_options
from cosyapp.frontend.audio import PromptAudio, VoiceError, load_prompt_audio
from cosyapp.frontend.text import TextError
from cosyapp.frontend.voices import Voice, VoiceInfo, VoiceNotFoundError, check_prompt_text
from cosyapp.service import Service
from cosyapp.web.ui.audio import ClipFolder, to_int16, wav_bytes

log = logging.getLogger(__name__)

RECORDING = "recording"  # speaker-control value: the recording in the form, used without saving it
RECORDING_LABEL = "The recording below (used as is, not saved)"
USER_ERRORS = (TextError, VoiceError, VoiceNotFoundError, BusyError, ValueError)


def user_error(err: Exception) -> gr.Error:
    """A toast for an error the user caused (or can wait out); the message is HTML-escaped."""
    if isinstance(err, VoiceNotFoundError):
        message = "That voice is not available (it may have been removed); pick another one."
    else:
        message = str(err)
    message = message[:1].upper() + message[1:]
    # The toast renders HTML; quotes need no escaping in text and would reach API clients as &#x27;.
    return gr.Error(html.escape(message, quote=False), print_exception=False)


def unexpected_error(err: Exception, what: str) -> gr.Error:
    log.error("%s failed", what, exc_info=err)
    return gr.Error(f"{what} failed unexpectedly; the server log has the details.", print_exception=False)


def request_stats(
    samples: int, sample_rate: int, elapsed: float, ttfa: float | None = None, batch: int = 0
) -> str:
    """The stats line under the player: TTFA (streaming) or batch size (whole clip), RTF, length."""
    seconds = samples / sample_rate
    parts = [f"TTFA **{ttfa:.2f} s**"] if ttfa is not None else []
    if batch:
        parts.append(f"whole clip in a batch of **{batch}**")
    rtf = f"{elapsed / seconds:.2f}" if seconds else "–"
    parts += [f"RTF **{rtf}**", f"audio **{seconds:.2f} s** ({samples:,} samples at {sample_rate:,} Hz)"]
    return " · ".join(parts)


@dataclass
class BatchSizes:
    """Sizes of the batches Gradio handed to ``speak_clip``: gauges of the engine's metrics."""

    last: int = 0
    largest: int = 0

    def record(self, size: int) -> None:
        self.last = size
        self.largest = max(self.largest, size)


class Handlers:
    """The event handlers of one demo, over the process's shared Service."""

    def __init__(self, service: Service):
        self.service = service
        self.pipeline = service.pipeline
        self.voices = service.voices
        self.max_chars = service.settings.max_text_chars
        self.max_upload_mb = service.settings.max_upload_mb
        self.clips = ClipFolder()
        self.batch_sizes = BatchSizes()

    # --- voices -------------------------------------------------------------------------------

    def voice_choices(self, session: str | None) -> list[tuple[str, str]]:
        """(label, id) for the speaker control: library voices visible to ``session``, then the
        recording in the form."""
        return [(voice_label(info), info.id) for info in self.voices.list_voices(session or None)] + [
            (RECORDING_LABEL, RECORDING)
        ]

    def recording_audio(self, recording: str) -> PromptAudio:
        """The validated recording of an upload (at most ``--max-upload-mb``). Raises a VoiceError."""
        return load_prompt_audio(recording, max_mb=self.max_upload_mb)

    def check_recording(self, recording: str | None) -> dict:
        """Validate a new upload or microphone recording and select it as the voice."""
        if recording is None:
            return gr.skip()
        try:
            self.recording_audio(recording)
        except VoiceError as err:
            raise user_error(err) from err
        return gr.update(value=RECORDING)

    def save_voice(
        self, name: str, recording: str | None, prompt_text: str, shared: bool, session: str
    ) -> tuple[dict, str]:
        """Save the recording as a named voice; returns the updated speaker control and a cleared name."""
        if recording is None:
            raise gr.Error("Upload or record a voice prompt first.", print_exception=False)
        try:
            audio = self.recording_audio(recording)
            info = self.voices.save(name, audio, prompt_text, session or None, shared=shared)
        except USER_ERRORS as err:
            raise user_error(err) from err
        except Exception as err:
            raise unexpected_error(err, "Saving the voice") from err
        gr.Info(f"Saved “{info.name}”" + (", shared with everyone." if shared else ", visible only to you."))
        return gr.update(choices=self.voice_choices(session), value=info.id), ""

    def voice(self, voice_id: str, recording: str | None, prompt_text: str, session: str) -> Voice:
        """The voice chosen in the form. Raises VoiceError, VoiceNotFoundError or ValueError."""
        if voice_id != RECORDING:
            if not voice_id:
                raise ValueError("pick a voice")
            return self.voices.get(voice_id, session or None)
        if recording is None:
            raise ValueError("upload or record a voice prompt, or pick a voice from the list")
        audio = self.recording_audio(recording)
        prompt_text = check_prompt_text(prompt_text, audio)
        features = self.voices.features_of(audio)
        info = VoiceInfo(id=RECORDING, name="your recording", kind="user", shared=False)
        return Voice(info, features, prompt_text=prompt_text)

    def request(
        self,
        text: str,
        voice_id: str,
        recording: str | None,
        prompt_text: str,
        speed: float,
        seed: float | None,
        session: str,
        streaming: bool,
        client: str | None = None,
    ) -> SynthesisRequest:
        """Check the form and build the request (computes a recording's features: call off the loop).

        ``client`` keys fair admission; default: the browser's session id, when it sent one."""
        if not (text or "").strip():
            raise ValueError("type some text to speak")
        if len(text) > self.max_chars:
            raise ValueError(f"the text has {len(text)} characters; at most {self.max_chars}")
        if seed is None:  # the page always sends one (the dice fills it)
            raise ValueError(f"the seed must be a whole number from 0 to {MAX_SEED}")
        check_options(speed, seed)
        voice = self.voice(voice_id, recording, prompt_text, session)
        client = client or (f"ui:{session}" if session else None)
        return SynthesisRequest(text, voice, float(speed), int(seed), streaming, client)

    # --- speaking -----------------------------------------------------------------------------

    async def speak(
        self,
        text: str,
        voice_id: str,
        recording: str | None,
        prompt_text: str,
        speed: float,
        seed: float | None,
        session: str,
        http: gr.Request,
    ) -> AsyncIterator[tuple]:
        """Stream speech: yields (WAV bytes chunk, stats, skip) per chunk, then (skip, stats, WAV file)."""
        started = time.monotonic()
        # API callers send no browser session id: their Gradio session keys fair admission instead.
        client = f"ui:{session or http.session_hash}"
        try:
            request = await asyncio.to_thread(
                self.request, text, voice_id, recording, prompt_text, speed, seed, session, True, client
            )
        except USER_ERRORS as err:
            raise user_error(err) from err
        except Exception as err:
            raise unexpected_error(err, "Preparing the voice") from err
        stream = self.pipeline.stream(request)
        pieces: list[np.ndarray] = []
        ttfa = None
        rate = self.pipeline.sample_rate
        try:
            async for chunk in stream:
                ttfa = ttfa or time.monotonic() - started
                pieces.append(chunk.samples)
                samples = sum(len(p) for p in pieces)
                stats = request_stats(samples, rate, time.monotonic() - started, ttfa) + " · streaming…"
                yield wav_bytes(chunk.samples, rate), stats, None if len(pieces) == 1 else gr.skip()
        except USER_ERRORS as err:
            raise user_error(err) from err
        except Exception as err:
            raise unexpected_error(err, "Speaking") from err
        finally:
            await stream.aclose()
        clip = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        path = await asyncio.to_thread(self.clips.write, clip, rate)
        yield gr.skip(), request_stats(len(clip), rate, time.monotonic() - started, ttfa), str(path)

    async def speak_clip(
        self,
        text: list[str],
        voice_id: list[str],
        recording: list[str | None],
        prompt_text: list[str],
        speed: list[float],
        seed: list[float | None],
        session: list[str],
    ) -> list[list]:
        """Gradio batch function: whole clips for every waiting request, synthesised together.

        Takes the form of ``speak``, each field a list with one entry per request (the parameter
        names are singular because they name the API's parameters).

        Returns [players, stats lines, files], one entry per request. A batch of one raises
        ``gr.Error`` for a failure; in a larger batch a failed request gets its message in its stats
        line, since an exception would fail every request of the batch.
        """
        started = time.monotonic()
        size = len(text)
        self.batch_sizes.record(size)
        forms = zip(text, voice_id, recording, prompt_text, speed, seed, session, strict=True)
        requests = await asyncio.gather(
            *(asyncio.to_thread(self.request, *form, False) for form in forms), return_exceptions=True
        )
        valid = [r for r in requests if isinstance(r, SynthesisRequest)]
        results = iter(await self.pipeline.synthesize_batch(valid))
        outcomes = [next(results) if isinstance(r, SynthesisRequest) else r for r in requests]
        elapsed = time.monotonic() - started
        players, stats, files = [], [], []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                error = (
                    user_error(outcome)
                    if isinstance(outcome, USER_ERRORS)
                    else unexpected_error(outcome, "Speaking")
                )
                if size == 1:
                    raise error from outcome
                players.append(None)
                stats.append(f"**Failed:** {error.message}")
                files.append(None)
                continue
            rate, clip = outcome
            path = str(await asyncio.to_thread(self.clips.write, clip, rate))
            # Samples, not the file: Gradio probes a returned audio file with ffprobe, which many
            # machines lack (imageio-ffmpeg brings ffmpeg only); 16-bit samples are stored unchanged.
            players.append((rate, to_int16(clip)))
            stats.append(request_stats(len(clip), rate, elapsed, batch=size))
            files.append(path)
        return [players, stats, files]


def voice_label(info: VoiceInfo) -> str:
    if info.kind == "model":
        return f"{info.name} (model speaker)"
    if info.kind == "user":
        return f"{info.name} ({'shared' if info.shared else 'yours'})"
    return info.name

"""What the page's events do: turn form values into SynthesisRequests for the shared Pipeline.

Two ways to speak, both named API endpoints taking the fields of ``SpeechForm``:
- ``speak`` (streaming): one async generator per session, fed by ``Pipeline.stream``; closing it
  (Stop, a closed tab, a cancelled client job) closes the pipeline stream, which aborts its work.
- ``speak_clip`` (whole clip): a Gradio batch function; the queue hands it every waiting request at
  once and it runs them together through ``Pipeline.synthesize``, cancelling those whose page has
  gone (``liveness.py``).

Every error leaves here through ``as_toast``: a ``UserError`` with its message, anything else logged
with its traceback and shown as a generic "internal error".
"""

import asyncio
import html
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import gradio as gr
import numpy as np

from cosyapp.asr.whisper import Transcript
from cosyapp.codec import to_int16
from cosyapp.engine.request import SynthesisRequest, shown
from cosyapp.errors import UserError, VoiceError, VoiceNotFoundError
from cosyapp.frontend.audio import PromptAudio
from cosyapp.frontend.prepare import read_upload
from cosyapp.frontend.voice_rules import check_prompt_text
from cosyapp.frontend.voices import Voice, VoiceInfo
from cosyapp.service import Service
from cosyapp.web.clients import client_key
from cosyapp.web.ui.audio import ClipFolder
from cosyapp.web.ui.form import SpeechForm, as_text
from cosyapp.web.ui.liveness import ClientWatch
from cosyapp.web.ui.player import PlayerFeed

log = logging.getLogger(__name__)

RECORDING = "recording"  # speaker-control value: the recording in the form, used without saving it
RECORDING_LABEL = "The recording below (used as is, not saved)"
INTERNAL_ERROR = "Internal error: the server log has the details."


def as_toast(err: Exception) -> gr.Error:
    """The UI's one mapping of errors: a ``UserError`` as its message (HTML-escaped: the toast renders
    HTML; quotes stay, they would reach API clients as &#x27;), anything else logged with its
    traceback and shown as INTERNAL_ERROR."""
    if isinstance(err, UserError):
        return gr.Error(html.escape(err.message, quote=False), print_exception=False)
    log.error("a UI request failed", exc_info=err)
    return gr.Error(INTERNAL_ERROR, print_exception=False)


@contextmanager
def toasts() -> Iterator[None]:
    """Raise what the block raises as ``as_toast``'s gr.Error."""
    try:
        yield
    except Exception as err:
        raise as_toast(err) from err


def client_address(http: gr.Request | None) -> str | None:
    return http.client.host if http is not None and http.client is not None else None


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


def failed_stats(message: str, batch: int) -> str:
    """The stats line of a whole clip that failed in a batch: ``**Failed:** MESSAGE · whole clip in
    a batch of **N**`` (README: how an API client tells a failure)."""
    return f"**Failed:** {message} · whole clip in a batch of **{batch}**"


def batch_failure(stats: object) -> str | None:
    """The message of a ``failed_stats`` line, for API clients; None for any other output."""
    if not isinstance(stats, str) or not stats.startswith("**Failed:** "):
        return None
    return stats.removeprefix("**Failed:** ").rsplit(" · whole clip in a batch of", 1)[0]


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
        self.client_watch = ClientWatch()  # attached to the demo once it is built (layout.py)

    # --- voices -------------------------------------------------------------------------------

    def voice_choices(self, session: str | None) -> list[tuple[str, str]]:
        """(label, id) for the speaker control: library voices visible to ``session``, then the
        recording in the form."""
        return [(voice_label(info), info.id) for info in self.voices.list_voices(session or None)] + [
            (RECORDING_LABEL, RECORDING)
        ]

    def recording_audio(self, recording: str) -> PromptAudio:
        """The prompt of an upload (at most ``--max-upload-mb``) as the page previews it: prepared by
        ``frontend/prepare.py`` (web/ui/prompt.py). Raises a VoiceError."""
        return read_upload(recording, self.max_upload_mb).audio

    def save_voice(
        self,
        name: str,
        recording: str | None,
        prompt_text: str,
        shared: bool,
        session: str,
        heard: Transcript | None = None,
    ) -> tuple[dict, str]:
        """Save the recording as a named voice; returns the updated speaker control and a cleared name.
        ``heard``: the recogniser's transcript of the recording; while the box holds it unchanged, the
        voice keeps the language it was heard in (else its script's, frontend/voices.py)."""
        with toasts():
            prompt_text, session = as_text(prompt_text, "transcript"), as_text(session, "session")
            check_shared(shared)
            if recording is None:
                raise VoiceError("Upload or record a voice prompt first.")
            audio = self.recording_audio(recording)
            as_heard = heard is not None and not heard.demo and heard.text.split() == prompt_text.split()
            language = heard.language if as_heard else ""
            owner = session or None
            info = self.voices.save(name, audio, prompt_text, owner, shared=shared, language=language)
        gr.Info(f"Saved “{info.name}”" + (", shared with everyone." if shared else ", visible only to you."))
        return gr.update(choices=self.voice_choices(session), value=info.id), ""

    def delete_voice(self, voice_id: str, session: str) -> dict:
        """Delete a voice saved in this browser session (shared or not); returns the updated speaker
        control with its first voice selected."""
        with toasts():
            voice_id, session = as_text(voice_id, "voice"), as_text(session, "session")
            info = self.own_voice(voice_id, session, "delete", self.voices.delete)
        gr.Info(f"Deleted “{info.name}”.")
        choices = self.voice_choices(session)
        return gr.update(choices=choices, value=choices[0][1])

    def own_voice(
        self, voice_id: str, owner: str, action: str, change: Callable[[str, str], object]
    ) -> VoiceInfo:
        """Apply ``change(voice_id, owner)`` to a voice this browser saved (``action`` names it in
        the messages: delete, rename, share); returns the voice's listing before the change. Raises
        a ``VoiceError`` for a voice of the server, of another browser, or without a browser."""
        listed = {info.id: info for info in self.voices.list_voices(owner or None)}
        info = listed.get(voice_id)
        if info is None or info.kind != "user":
            raise VoiceError(f"Pick one of your saved voices to {action}; the others come with the server.")
        if not owner:  # without one, delete would act for the HTTP API: any shared voice
            raise VoiceError(f"Open the page in a browser to {action} the voices it saved.")
        try:
            change(voice_id, owner)
        except VoiceNotFoundError:
            message = f"“{info.name}” was saved in another browser; only that browser can {action} it."
            raise VoiceError(message) from None
        return info

    def voice(self, voice_id: str, recording: str | None, prompt_text: str, session: str) -> Voice:
        """The voice chosen in the form. Raises a VoiceError (VoiceNotFoundError for an unknown id)."""
        if voice_id != RECORDING:
            if not voice_id:
                raise VoiceError("Pick a voice.")
            return self.voices.get(voice_id, session or None)
        if recording is None:
            raise VoiceError("Upload or record a voice prompt, or pick a voice from the list.")
        audio = self.recording_audio(recording)
        prompt_text = check_prompt_text(prompt_text, audio)
        features = self.voices.features_of(audio)
        info = VoiceInfo(id=RECORDING, name="your recording", kind="user", shared=False)
        return Voice(info, features, prompt_text=prompt_text)

    def request(
        self, form: SpeechForm, streaming: bool, address: str | None, gradio_session: str | None = None
    ) -> SynthesisRequest:
        """Check the form (``SpeechForm.check``), then build the request (a recording's features are
        computed here: call it off the loop). Fair admission keys it by the page's session, else by
        the Gradio session of an API client (each gradio_client Client is one), else by ``address``."""
        form.check(self.max_chars)
        voice = self.voice(form.voice_id, form.recording, form.prompt_text, form.session)
        seed = None if form.seed is None else int(form.seed)
        client = client_key(form.session or gradio_session, address)
        return SynthesisRequest(form.text, voice, float(form.speed), seed, streaming, client)

    # --- speaking -----------------------------------------------------------------------------

    async def speak(self, http: gr.Request, **values) -> AsyncIterator[tuple]:
        """Stream speech for the ``SpeechForm`` in ``values``: yields as ``stream``."""

        def build() -> SynthesisRequest:
            return self.request(SpeechForm(**values), True, client_address(http), http.session_hash)

        async for update in self.stream(build):
            yield update

    async def stream(self, build: Callable[[], SynthesisRequest]) -> AsyncIterator[tuple]:
        """Stream the request ``build`` returns (called in a thread; its errors become toasts): yields
        (player value, stats, skip) per chunk (``PlayerFeed``: the stream so far as 16-bit PCM), then
        (the value marked done, stats, WAV file). ``speak`` and the page's modes (modes.py) use it."""
        started = time.monotonic()
        pieces: list[np.ndarray] = []
        ttfa = None
        rate = self.pipeline.sample_rate
        feed = PlayerFeed(rate)
        with toasts():
            request = await asyncio.to_thread(build)
            stream = self.pipeline.stream(request)
            notes: list[str] = []  # the audio budget's (engine/budget.py): a toast now, and in the stats
            try:
                async for chunk in stream:
                    if chunk.note:
                        notes.append(chunk.note)
                        gr.Warning(chunk.note)
                        continue
                    ttfa = ttfa or time.monotonic() - started
                    pieces.append(chunk.samples)
                    samples = sum(len(p) for p in pieces)
                    stats = request_stats(samples, rate, time.monotonic() - started, ttfa) + " · streaming…"
                    yield feed.add(chunk.samples, ttfa), stats, None if len(pieces) == 1 else gr.skip()
            finally:
                await stream.aclose()
        clip = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
        path = await asyncio.to_thread(self.clips.write, clip, rate)
        stats = request_stats(len(clip), rate, time.monotonic() - started, ttfa)
        yield feed.value(done=True), " · ".join([stats, *notes]), str(path)

    async def speak_clip(self, http: gr.Request, **values: list) -> list[list]:
        """Gradio batch function: whole clips for every waiting request, synthesised together.

        ``values`` holds the ``SpeechForm`` fields, each a list with one entry per request. Gradio
        hands a batch function only its first event's request, so callers without a session in one
        batch share that event's address for fair admission.

        Returns [players, stats lines, files], one entry per request. A batch of one raises
        ``gr.Error`` for a failure; in a larger batch a failed request gets no audio and no file and
        its message in its stats line (``failed_stats``), since an exception would fail every
        request of the batch.
        """
        started = time.monotonic()
        forms = SpeechForm.batch(values)
        size = len(forms)
        self.batch_sizes.record(size)
        requests = await asyncio.gather(
            *(asyncio.to_thread(self.request, form, False, client_address(http)) for form in forms),
            return_exceptions=True,
        )
        # The clips are made together (their work shares the engines' batches); a request whose page
        # has gone is cancelled on the way (liveness.py).
        synthesize = self.pipeline.synthesize
        calls = [synthesize(r) if isinstance(r, SynthesisRequest) else _given(r) for r in requests]
        outcomes = await self.client_watch.run(http, calls)
        elapsed = time.monotonic() - started
        players, stats, files = [], [], []
        for outcome in outcomes:
            if isinstance(outcome, asyncio.CancelledError):  # its page has gone: nobody to answer
                players.append(None)
                stats.append(failed_stats("The page closed before the clip was ready.", size))
                files.append(None)
                continue
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                error = as_toast(outcome)
                if size == 1:
                    raise error from outcome
                players.append(None)
                stats.append(failed_stats(error.message, size))
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


async def _given(value: object) -> object:
    return value


def check_shared(shared: object) -> bool:
    """``shared`` as sent by a client, if it is a bool; raises a ``UserError`` otherwise."""
    if not isinstance(shared, bool):
        raise UserError(f"“Share with everyone” must be true or false, got {shown(shared)}.")
    return shared


def voice_label(info: VoiceInfo) -> str:
    if info.kind == "model":
        return f"{info.name} (model speaker)"
    if info.kind == "user":
        return f"{info.name} ({'shared' if info.shared else 'yours'})"
    return info.name

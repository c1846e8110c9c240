"""The page's own-voice prompt: what happens when a recording is uploaded or recorded.

1. ``prepare``: the recording is read (any format the frontend decodes) and prepared
   (``frontend/prepare.py``); the page shows the clip that will be used, its length and what was
   trimmed, and selects the recording as the voice. Gradio's audio upload takes audio/* files only,
   so recordings in video containers (a browser's .webm, a phone's .mp4 or .3gp) come through a
   button of their own (``take_file``), which puts their prepared clip in the recording player;
2. ``transcribe``: the shared speech recogniser transcribes that clip (in its own thread, batched
   with other sessions' uploads);
3. ``fill``: the transcript goes into the transcript box only if the box is empty or still holds the
   previous automatic transcript: a box the user edited is never overwritten. It runs as its own
   step, reading the box as it is once the transcript is ready, so typing during step 2 is kept.

The demo recogniser's transcript is marked as meaningless beside the box.
"""

import gradio as gr

from cosyapp.asr.whisper import Transcript
from cosyapp.codec import to_int16
from cosyapp.errors import UserError
from cosyapp.frontend.prepare import PreparedPrompt, read_upload
from cosyapp.service import Service
from cosyapp.web.ui.events import RECORDING, toasts

DEMO_NOTE = (
    "⚠️ Filled in by the **demo speech recogniser** (random weights): the text is meaningless. "
    "Type what is said in the recording."
)
HEARD_NOTE = "Filled in by automatic transcription ({language}): check it against the recording."
# Recordings in video containers, which Gradio's audio upload (audio/* only) refuses.
OTHER_FORMATS = [".webm", ".mp4", ".3gp", ".3g2", ".mov", ".mkv"]
NO_ASR_NOTE = "Type what is said in the recording (automatic transcription is off on this server)."


class PromptHandlers:
    """The handlers of the own-voice prompt over ``service``'s speech recogniser."""

    def __init__(self, service: Service):
        self.asr = service.asr
        self.max_upload_mb = service.settings.max_upload_mb

    def prepared(self, recording: str) -> PreparedPrompt:
        """The prepared prompt of an uploaded file. Raises a VoiceError."""
        return read_upload(recording, self.max_upload_mb)

    def prepare(self, recording: str | None) -> tuple:
        """(speaker control, preview clip, what was done) for a new upload or microphone recording."""
        if recording is None:
            return gr.skip(), None, ""
        with toasts():
            prepared = self.prepared(recording)
        audio = prepared.audio
        preview = (audio.sample_rate, to_int16(audio.samples))  # samples: Gradio would ffprobe a file
        return gr.update(value=RECORDING), preview, prepared.summary()

    def take_file(self, path: str | None) -> tuple:
        """(recording, speaker control, preview clip, what was done) for a file of the other-formats
        button: the recording player gets its prepared clip, which preparing again leaves as it is."""
        if path is None:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        voice, preview, note = self.prepare(path)
        return preview, voice, preview, note

    def transcribe(self, recording: str | None, box: str, auto: str) -> Transcript | None:
        """The transcript of the recording's prepared clip; None when the box holds the user's own
        text, or there is no recording. A recogniser that cannot load is shown as a toast."""
        if recording is None or (box.strip() and box != auto):
            return None
        if self.asr is None:
            return Transcript("", "", demo=False)
        with toasts():
            try:
                return self.asr.transcribe(self.prepared(recording).audio)
            except UserError as error:
                gr.Warning(error.message)
                return None

    def fill(self, box: str, auto: str, heard: Transcript | None) -> tuple:
        """(box, automatic transcript, note): ``heard`` goes into the box unless the user typed there."""
        if heard is None or (box.strip() and box != auto):
            return gr.skip(), gr.skip(), gr.skip()
        if not heard.text:
            return gr.skip(), gr.skip(), NO_ASR_NOTE
        note = DEMO_NOTE if heard.demo else HEARD_NOTE.format(language=heard.language)
        return heard.text, heard.text, note


def wire_prompt(
    handlers: PromptHandlers,
    recording: gr.Audio,
    other_file: gr.UploadButton,
    voice: gr.Dropdown,
    prompt_text: gr.Textbox,
    preview: gr.Audio,
    prepared_note: gr.Markdown,
    transcript_note: gr.Markdown,
    voice_jobs: dict,
) -> gr.State:
    """Connect the prompt's events: a new recording or file is prepared, transcribed and filled in.
    Returns the state holding what the recogniser heard (a Transcript, or None)."""
    auto = gr.State("")  # the last automatic transcript put in the box
    heard = gr.State(None)
    prepared = [
        recording.upload(handlers.prepare, recording, [voice, preview, prepared_note], **voice_jobs),
        recording.stop_recording(handlers.prepare, recording, [voice, preview, prepared_note], **voice_jobs),
        other_file.upload(
            handlers.take_file, other_file, [recording, voice, preview, prepared_note], **voice_jobs
        ),
    ]
    for event in prepared:
        event.success(handlers.transcribe, [recording, prompt_text, auto], heard, **voice_jobs).success(
            handlers.fill,
            [prompt_text, auto, heard],
            [prompt_text, auto, transcript_note],
            queue=False,
            api_name=False,
        )
    recording.clear(
        lambda: (None, "", "", None), None, [preview, prepared_note, transcript_note, heard], api_name=False
    )
    return heard

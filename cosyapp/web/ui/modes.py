"""The page's modes: Clone / Cross-lingual / Instruct / Convert tabs over the one speech form.

Clone is the form as it was (``/speak`` and ``/speak_clip``, unchanged). The other three stream
through ``/speak_mode``: the form's seven values, then ``mode`` (cross_lingual, instruct2, vc, or
zero_shot), ``instruction`` and ``source`` (the speech to convert). Each tab keeps its inputs when
another is picked; only the chosen mode's are used, so an instruction typed earlier never reaches a
cross-lingual request. The stream itself is ``Handlers.stream``'s, as ``/speak``'s: same
admission, stats, Stop and player.

The tag buttons insert CosyVoice 2's fine-grained tags at the text box's cursor (a span tag wraps
the selection) in the browser, with no server round trip.
"""

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import gradio as gr

from cosyapp.engine.request import SynthesisRequest
from cosyapp.frontend.modes import (
    CROSS_LINGUAL,
    INSTRUCT,
    MAX_INSTRUCTION_CHARS,
    VOICE_CONVERSION,
    ZERO_SHOT,
    check_mode,
)
from cosyapp.frontend.voices import ASSETS_VOICES
from cosyapp.web.clients import client_key
from cosyapp.web.ui.events import Handlers, client_address
from cosyapp.web.ui.form import Refused, SpeechForm
from cosyapp.web.ui.inputs import hand_on

TABS = {  # tab label -> mode
    "Clone": ZERO_SHOT,
    "Cross-lingual": CROSS_LINGUAL,
    "Instruct": INSTRUCT,
    "Convert": VOICE_CONVERSION,
}
NOTES = {
    ZERO_SHOT: "**Clone** continues the voice's recording: its timbre, pace and delivery. "
    "Best when the text is in the recording's language.",
    CROSS_LINGUAL: "**Cross-lingual** takes only the timbre from the voice: for text in another language "
    "than its recording (a Chinese voice speaking English), which Clone would pull toward its accent.",
    INSTRUCT: "**Instruct** says *how* to speak. The model was trained on short instructions: it follows "
    "dialects, emotions and pace well, volume and styles less reliably, long descriptions loosely. "
    "Chinese or English; at most 200 characters.",
    VOICE_CONVERSION: "**Convert** says a recording's speech again in the chosen voice: same words and "
    "timing, no text (1-30 s of speech, at least 16 kHz).",
}
PRESETS = {  # group -> (button, instruction)
    "Dialect": [
        (name, f"用{name}说这句话") for name in ("粤语", "四川话", "上海话", "天津话", "长沙话", "郑州话")
    ],
    "Emotion": [(name, f"用{name}的语气说") for name in ("开心", "悲伤", "生气", "惊讶", "温柔")],
    "Pace and volume": [
        ("快速", "用很快的速度说"),
        ("慢速", "用很慢的速度说"),
        ("小声", "用小声说"),
        ("大声", "用很大的声音说"),
    ],
    "English": [
        ("Happy", "Speak happily, full of energy."),
        ("Sad", "Speak sadly, in a low voice."),
        ("Whisper", "Speak softly, in a whisper."),
        ("News anchor", "Speak like a news anchor, slowly and calmly."),
    ],
}
TAGS = [  # (button, inserted before the cursor or selection, after it)
    ("[laughter]", "[laughter]", ""),
    ("[breath]", "[breath]", ""),
    ("[cough]", "[cough]", ""),
    ("[sigh]", "[sigh]", ""),
    ("<strong>", "<strong>", "</strong>"),
    ("<laughter>", "<laughter>", "</laughter>"),
]
CROSS_LINGUAL_EXAMPLES = [
    ["The weather is lovely today. Shall we take a walk in the park?", "zh-aishell-w0121"],
    ["今天天气真不错，我们一起去公园散步吧。", "en-espeak-us"],
    ["It is <strong>so</strong> nice to meet you! [laughter]", "zh-aishell-w0122"],
]
INSTRUCT_EXAMPLES = [
    ["今天天气真不错，我们一起去公园散步吧。", "zh-aishell-w0121", "用四川话说这句话"],
    ["我真的太高兴了[laughter]，谢谢你们！", "zh-aishell-w0122", "用开心的语气说"],
    ["Please keep your voice down, the baby is sleeping.", "en-espeak-us", "Speak softly, in a whisper."],
]
CONVERT_EXAMPLES = [
    [str(ASSETS_VOICES / "zh-aishell-w0121.wav"), "en-espeak-gb"],
    [str(ASSETS_VOICES / "en-espeak-us.wav"), "zh-aishell-w0122"],
]


def insert_js(before: str, after: str) -> str:
    """The ``js=`` of a tag button: the text box's value with ``before``/``after`` around its selection
    (at its cursor when nothing is selected), the cursor put after the insertion (inside an empty
    span, so one can type its words)."""
    return f"""(value) => {{
  const box = document.querySelector("#text textarea");
  const text = box ? box.value : value;
  const start = box ? box.selectionStart : text.length, end = box ? box.selectionEnd : text.length;
  const [before, after] = [{json.dumps(before)}, {json.dumps(after)}];
  const caret = start === end ? start + before.length : end + before.length + after.length;
  if (box) setTimeout(() => {{ box.focus(); box.setSelectionRange(caret, caret); }}, 60);
  return text.slice(0, start) + before + text.slice(start, end) + after + text.slice(end);
}}"""


@dataclass
class ModeTabs:
    """The mode choice and each mode's own inputs, laid out above the text box by ``build``."""

    tabs: dict[str, gr.Tab]  # by mode
    mode: gr.Textbox  # hidden: the chosen mode, an input of /speak_mode
    instruction: gr.Textbox
    presets: list[tuple[gr.Button, str]]
    source: gr.Audio

    @classmethod
    def build(cls) -> "ModeTabs":
        """Lay out the tabs in the current Blocks context."""
        tabs: dict[str, gr.Tab] = {}
        presets: list[tuple[gr.Button, str]] = []
        mode = gr.Textbox(ZERO_SHOT, visible=False, elem_id="mode")
        with gr.Tabs(elem_id="modes"):
            for label, name in TABS.items():
                with gr.Tab(label, id=name, elem_id=f"mode-{name}") as tabs[name]:
                    gr.Markdown(NOTES[name], elem_classes="mode-note")
                    if name == INSTRUCT:
                        instruction = gr.Textbox(
                            PRESETS["Dialect"][1][1],
                            label="Instruction: how to speak",
                            max_length=MAX_INSTRUCTION_CHARS,
                            placeholder="e.g. 用四川话说这句话, or Speak slowly and softly.",
                            elem_id="instruction",
                        )
                        for group, choices in PRESETS.items():
                            with gr.Row(elem_classes="preset-row"):
                                gr.Markdown(f"{group}:", elem_classes="preset-group")
                                for preset, text in choices:
                                    button = gr.Button(preset, size="sm", min_width=60, scale=0)
                                    presets.append((button, text))
                    if name == VOICE_CONVERSION:
                        source = gr.Audio(
                            sources=["upload", "microphone"],
                            type="filepath",
                            label="Speech to convert (1-30 s)",
                            elem_id="source-speech",
                        )
        return cls(tabs, hand_on(mode), hand_on(instruction), presets, source)


def tag_buttons(text: gr.Textbox) -> gr.Row:
    """A row of buttons inserting fine-grained tags into ``text`` at its cursor (browser only)."""
    with gr.Row(elem_id="tag-buttons") as row:
        gr.Markdown("Insert:", elem_classes="preset-group")
        for label, before, after in TAGS:
            button = gr.Button(label, size="sm", min_width=60, scale=0, elem_classes="tag-button")
            button.click(None, text, text, js=insert_js(before, after), api_name=False)
    return row


def controls(mode: str, streaming: bool) -> list[dict]:
    """Updates for [text, counter, tag row, Stream box, generate, generate_clip, generate_mode,
    player, clip player]: Clone as the form was (stream or whole clip); the other modes stream, with
    their own button; Convert has no text."""
    clone = mode == ZERO_SHOT
    stream = streaming or not clone
    has_text = mode != VOICE_CONVERSION
    return [
        gr.update(visible=has_text),
        gr.update(visible=has_text),
        gr.update(visible=has_text),
        gr.update(visible=clone),
        gr.update(visible=clone and streaming),
        gr.update(visible=clone and not streaming),
        gr.update(visible=not clone),
        gr.update(visible=stream),
        gr.update(visible=not stream),
    ]


class ModeHandlers:
    """``/speak_mode``: the form's request in another mode, streamed by ``Handlers.stream``."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.frontend = handlers.voices.frontend
        self.max_upload_mb = handlers.max_upload_mb

    def request(self, values: dict, address: str | None, gradio_session: str | None) -> SynthesisRequest:
        """The request for ``values`` (SpeechForm's fields, ``mode``, ``instruction``, ``source``).
        Checks cheap rules first (mode and instruction, then the form), then the voice, then reads
        the speech to convert. Raises a UserError. Call it off the event loop."""
        mode, instruction, source = (values.pop(key) for key in ("mode", "instruction", "source"))
        form = SpeechForm(**values)
        for value in (mode, instruction, source):
            if isinstance(value, Refused):
                raise value.error
        converting = mode == VOICE_CONVERSION
        instruction = instruction if mode == INSTRUCT else None
        if not converting:
            check_mode(mode, instruction)
        form.check(self.handlers.max_chars, needs_text=not converting)
        voice = self.handlers.voice(form.voice_id, form.recording, form.prompt_text, form.session)
        tokens: tuple[int, ...] = ()
        if converting:
            if source is None:
                check_mode(mode, None, ())  # raises its message: upload or record it
            from cosyapp.frontend.source import source_tokens  # torch: the page's modules import none

            tokens = source_tokens(self.frontend, source, self.max_upload_mb)
        return SynthesisRequest(
            "" if converting else form.text,
            voice,
            float(form.speed),
            None if form.seed is None else int(form.seed),
            True,
            client_key(form.session or gradio_session, address),
            mode=mode,
            instruction=instruction,
            source_tokens=tokens,
        )

    async def speak_mode(self, http: gr.Request, **values) -> AsyncIterator[tuple]:
        """Stream speech in the mode of ``values``; yields as ``Handlers.speak``."""

        def build() -> SynthesisRequest:
            return self.request(values, client_address(http), http.session_hash)

        async for update in self.handlers.stream(build):
            yield update


def wire_modes(
    handlers: Handlers,
    tabs: ModeTabs,
    form: dict,
    examples: list[list[str]],
    *,
    text_parts: list,
    streaming: gr.Checkbox,
    buttons: list[gr.Button],
    players: list,
    stats: gr.Markdown,
    download: gr.File,
    stop: gr.Button,
    concurrency: dict,
) -> None:
    """Wire the tabs: each mode's examples, presets, the visible controls per mode and Stream box,
    and ``/speak_mode`` on the last of ``buttons`` (generate, generate_clip, generate_mode), which
    Stop cancels. ``text_parts``: text box, counter, tag row; ``players``: streaming, whole clip."""
    text, voice = form["text"], form["voice_id"]
    with tabs.tabs[ZERO_SHOT]:
        gr.Examples(examples, [text, voice], label="Examples")
    with tabs.tabs[CROSS_LINGUAL]:
        gr.Examples(CROSS_LINGUAL_EXAMPLES, [text, voice], label="Examples")
    with tabs.tabs[INSTRUCT]:
        gr.Examples(INSTRUCT_EXAMPLES, [text, voice, tabs.instruction], label="Examples")
    with tabs.tabs[VOICE_CONVERSION]:
        gr.Examples(CONVERT_EXAMPLES, [tabs.source, voice], label="Examples")
    for button, instruction in tabs.presets:
        button.click(None, None, tabs.instruction, js=f"() => {json.dumps(instruction)}", api_name=False)

    shown = [*text_parts, streaming, *buttons, *players]
    quiet = {"queue": False, "show_progress": "hidden", "api_name": False}
    for name, tab in tabs.tabs.items():
        tab.select(lambda on, name=name: [name, *controls(name, on)], streaming, [tabs.mode, *shown], **quiet)
    streaming.change(lambda on, mode: controls(mode, on), [streaming, tabs.mode], shown, **quiet)

    modes = ModeHandlers(handlers)
    speaking = buttons[-1].click(
        modes.speak_mode,
        inputs_kwargs=form | {"mode": tabs.mode, "instruction": tabs.instruction, "source": tabs.source},
        outputs=[players[0], stats, download],
        api_name="speak_mode",
        **concurrency,
    )
    stop.click(None, None, None, cancels=[speaking], queue=False, api_name=False)

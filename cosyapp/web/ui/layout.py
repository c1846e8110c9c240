"""The page: ``build_demo(service)`` lays out the Blocks and wires events, queue and live panel.

Queue sizing (one process, one shared Pipeline):
- streaming: up to ``max_streams + max_waiting`` generators at once, so requests wait in the
  Pipeline's admission, which shares the streams fairly across sessions (Gradio's queue is FIFO);
- whole clips: Gradio batches of up to ``CLIP_BATCH`` requests, two batches at once, so a new batch
  gathers while the previous one finishes;
- voice work (checking uploads, saving voices): ``VOICE_JOBS`` at once;
- ``max_size`` waiting events in all; beyond that Gradio answers "This application is currently busy".
"""

import secrets
from pathlib import Path

import gradio as gr

from cosyapp.engine.request import MAX_SPEED, MIN_SPEED
from cosyapp.service import Service
from cosyapp.web.ui.compare import CSS as COMPARE_CSS
from cosyapp.web.ui.compare import CompareSection, wire_compare
from cosyapp.web.ui.events import RECORDING, Handlers
from cosyapp.web.ui.form import SpeechForm
from cosyapp.web.ui.gallery import Gallery, voice_gallery, wire_gallery
from cosyapp.web.ui.inputs import hand_on, isolate_requests
from cosyapp.web.ui.modes import ModeTabs, tag_buttons, wire_modes
from cosyapp.web.ui.panel import build_panel
from cosyapp.web.ui.player import stop_players_js, stream_player
from cosyapp.web.ui.prompt import OTHER_FORMATS, PromptHandlers, wire_prompt

CLIP_BATCH = 16
CLIP_BATCHES_AT_ONCE = 2
VOICE_JOBS = 4
EXAMPLES = [
    ["Hello! This is CosyVoice 2, speaking from one shared engine.", "en-espeak-us"],
    ["今天天气真不错，我们一起去公园散步吧。", "zh-aishell-w0121"],
    ["The birch canoe slid on the smooth planks.", "en-espeak-gb"],
]
THEME = gr.themes.Soft()
CSS = """
.demo-banner { border-left: 4px solid var(--color-accent); padding: 4px 12px;
  background: var(--background-fill-secondary); border-radius: var(--radius-md); }
.char-counter { text-align: right; opacity: 0.75; font-size: var(--text-sm); }
.live-stats { display: grid; grid-template-columns: repeat(auto-fill, minmax(112px, 1fr)); gap: 8px; }
.live-stats .tile { display: flex; flex-direction: column; padding: 6px 10px;
  border: 1px solid var(--border-color-primary); border-radius: var(--radius-md);
  background: var(--background-fill-secondary); }
.live-stats .value { font-size: var(--text-xl); font-weight: 600; color: var(--body-text-color); }
.live-stats .name { font-size: var(--text-sm); color: var(--body-text-color-subdued); }
#seed-row, #action-row { align-items: end; }
#download .empty { height: 64px; min-height: 0; }
.dark audio { color-scheme: dark; }
"""


def demo_banner(reason: str) -> str:
    return (
        f"⚠️ **Demo model: random weights, it speaks noise** ({reason}).  \n"
        "To hear real speech, restart with `--model FunAudioLLM/CosyVoice2-0.5B` on a machine with "
        "network access (downloads it once), or with `--model /path/to/folder` holding the official "
        "CosyVoice2-0.5B files."
    )


def browser_secret(data_dir: Path) -> str:
    """The key that encrypts each browser's session id; kept on disk so ids survive restarts."""
    path = data_dir / "browser-secret"
    if not path.is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


def max_threads(service: Service) -> int:
    """Gradio's cap on jobs running at once (and its thread pool): every slot the queue can fill."""
    return speak_jobs(service) + CLIP_BATCHES_AT_ONCE + VOICE_JOBS + 8


def speak_jobs(service: Service) -> int:
    """Streaming generators at once: every stream the Pipeline runs or lets wait."""
    return service.pipeline.max_streams + service.pipeline.max_waiting


def build_demo(service: Service) -> gr.Blocks:
    """The web UI over ``service``'s shared Pipeline and voice library, its queue configured.

    Also starts the live panel's metrics sampler.
    Serve it with ``demo.launch(**launch_options(demo))`` or mount it with
    ``gr.mount_gradio_app(app, demo, path="/", **mount_options(demo))``.
    """
    handlers = Handlers(service)
    service.pipeline.metrics.gauges.update(
        clip_batch_size=lambda: handlers.batch_sizes.last,
        clip_max_batch_size=lambda: handlers.batch_sizes.largest,
    )
    settings = service.settings
    voices = handlers.voice_choices(None)
    first_voice = voices[0][1]

    with gr.Blocks(title="cosyapp · CosyVoice 2 text-to-speech", delete_cache=(600, 3600)) as demo:
        browser = gr.BrowserState("", storage_key="cosyapp-session", secret=browser_secret(settings.data_dir))
        session = gr.Textbox("", visible=False)
        gr.Markdown("# CosyVoice 2 text-to-speech")
        if service.demo_reason:
            gr.Markdown(demo_banner(service.demo_reason), elem_classes="demo-banner", elem_id="demo-banner")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                mode_tabs = ModeTabs.build()
                text = gr.Textbox(
                    EXAMPLES[0][0],
                    label="Text",
                    lines=4,
                    max_lines=12,
                    max_length=settings.max_text_chars,
                    placeholder="Type what should be said…",
                    elem_id="text",
                )
                counter = gr.Markdown(
                    f"{len(EXAMPLES[0][0])} / {settings.max_text_chars} characters",
                    elem_classes="char-counter",
                    elem_id="char-counter",
                )
                tags = tag_buttons(text)
                # Saved voices come and go per session, and a Gradio batch checks every request against the
                # first one's session: the handlers check the id instead (clear message if unknown).
                voice = gr.Dropdown(
                    voices, value=first_voice, label="Voice", allow_custom_value=True, elem_id="voice"
                )
                with gr.Accordion(
                    "Your own voice: upload or record a prompt", open=False, elem_id="own-voice"
                ):
                    recording = gr.Audio(
                        sources=["upload", "microphone"],
                        type="filepath",
                        label="Prompt recording (1-30 s of clear speech)",
                        elem_id="recording",
                    )
                    other_file = gr.UploadButton(
                        "Or upload a video-format recording (.webm, .mp4, .3gp, .mov)",
                        file_types=OTHER_FORMATS,
                        size="sm",
                        elem_id="upload-other",
                    )
                    preview = gr.Audio(
                        label="What will be used (silence trimmed, levelled)",
                        interactive=False,
                        buttons=["download"],
                        elem_id="prompt-preview",
                    )
                    prepared_note = gr.Markdown("", elem_id="prompt-prepared")
                    prompt_text = gr.Textbox(
                        value="",
                        label="What is said in the recording",
                        placeholder="Filled in automatically from the recording; edit it if needed",
                        lines=2,
                        elem_id="prompt-text",
                    )
                    transcript_note = gr.Markdown("", elem_id="transcript-note")
                    with gr.Row():
                        voice_name = gr.Textbox(label="Name to save it under", scale=3, elem_id="voice-name")
                        shared = gr.Checkbox(label="Share with everyone", scale=1, elem_id="voice-shared")
                    with gr.Row():
                        save = gr.Button("Save voice", size="sm", elem_id="save-voice")
                        delete = gr.Button(
                            "Delete the selected voice", size="sm", variant="stop", elem_id="delete-voice"
                        )
                with gr.Row(elem_id="seed-row"):
                    speed = gr.Slider(
                        MIN_SPEED, MAX_SPEED, value=1.0, step=0.05, label="Speed", scale=3, min_width=180
                    )
                    seed = gr.Number(
                        0, label="Seed", minimum=0, precision=0, scale=2, min_width=120, elem_id="seed"
                    )
                    dice = gr.Button("⚄ random", size="sm", scale=0, min_width=90, elem_id="dice")
                with gr.Row(elem_id="action-row"):
                    streaming = gr.Checkbox(True, label="Stream", scale=0, min_width=110, elem_id="streaming")
                    generate = gr.Button("Generate", variant="primary", scale=2, elem_id="generate")
                    generate_clip = gr.Button(
                        "Generate", variant="primary", scale=2, visible=False, elem_id="generate-clip"
                    )
                    generate_mode = gr.Button(
                        "Generate", variant="primary", scale=2, visible=False, elem_id="generate-mode"
                    )
                    stop = gr.Button("Stop", variant="stop", scale=1, elem_id="stop")
            with gr.Column(scale=2, min_width=300):
                player = stream_player(
                    service.pipeline.sample_rate,
                    start_on="#generate, #generate-mode",
                    stop_on="#stop",
                    elem_id="player",
                )
                clip_player = gr.Audio(
                    label="Speech (whole clip)",
                    type="filepath",
                    buttons=["download"],
                    autoplay=True,
                    interactive=False,
                    visible=False,
                    elem_id="clip-player",
                )
                stats = gr.Markdown("", label="Stats", show_label=False, elem_id="stats")
                download = gr.File(
                    label="Download the whole clip (WAV)", interactive=False, height=90, elem_id="download"
                )
        compare = CompareSection.build(voices, service.pipeline.sample_rate)
        with gr.Accordion("Voice gallery", open=True, elem_id="gallery-box"):
            gallery = voice_gallery(elem_id="gallery")
        build_panel(service.pipeline.metrics)

        form = SpeechForm.inputs(
            text=text,
            voice_id=voice,
            recording=recording,
            prompt_text=prompt_text,
            speed=speed,
            seed=seed,
            session=session,
        )
        # Ranges and types are for people on the page: the server hands on what a client sent and the
        # handlers check it, so one bad value fails only its own request of a batch (inputs.py).
        for component in (text, voice, prompt_text, speed, seed, session):
            hand_on(component)
        speaking = generate.click(
            handlers.speak,
            inputs_kwargs=form,
            outputs=[player, stats, download],
            api_name="speak",
            concurrency_limit=speak_jobs(service),
            concurrency_id="speak",
        )
        clip = generate_clip.click(
            handlers.speak_clip,
            inputs_kwargs=form,
            outputs=[clip_player, stats, download],
            api_name="speak_clip",
            batch=True,
            max_batch_size=CLIP_BATCH,
            concurrency_limit=CLIP_BATCHES_AT_ONCE,
            concurrency_id="speak_clip",
        )
        stopping = stop_players_js("player")
        stop.click(None, None, None, cancels=[speaking, clip], queue=False, api_name=False, js=stopping)
        wire_modes(
            handlers,
            mode_tabs,
            form,
            EXAMPLES,
            text_parts=[text, counter, tags],
            streaming=streaming,
            buttons=[generate, generate_clip, generate_mode],
            players=[player, clip_player],
            stats=stats,
            download=download,
            stop=stop,
            concurrency={"concurrency_limit": speak_jobs(service), "concurrency_id": "speak"},
        )
        wire_compare(
            handlers, compare, form, {"concurrency_limit": speak_jobs(service), "concurrency_id": "speak"}
        )
        text.change(
            None,
            text,
            counter,
            js=f"(t) => `${{[...t].length}} / {settings.max_text_chars} characters`",
            api_name=False,
        )
        dice.click(None, None, seed, js="() => Math.floor(Math.random() * 4294967296)", api_name=False)
        voice_jobs = {"concurrency_limit": VOICE_JOBS, "concurrency_id": "voice", "api_name": False}
        notes = [prepared_note, transcript_note]
        prompt_parts = [recording, other_file, voice, prompt_text, preview, *notes]
        heard = wire_prompt(PromptHandlers(service), *prompt_parts, voice_jobs)
        saved = save.click(
            handlers.save_voice,
            [voice_name, recording, prompt_text, shared, session, heard],
            [voice, voice_name],
            **voice_jobs,
        )
        deleted = delete.click(handlers.delete_voice, [voice, session], voice, **voice_jobs)

        def open_session(stored: str) -> tuple[str, str, dict]:
            key = stored or secrets.token_hex(16)
            return key, key, gr.update(choices=handlers.voice_choices(key))

        opened = demo.load(open_session, browser, [browser, session, voice], queue=False, api_name=False)
        # The page says when its session is open (what a saved voice is filed under, the voice list):
        # <html data-cosy-session="open">, for scripts and tests that drive the page.
        opened.then(
            None, js="() => { document.documentElement.dataset.cosySession = 'open'; }", api_name=False
        )
        gallery_events = [opened, saved, deleted]
        wire_gallery(Gallery(service, handlers), gallery, voice, session, gallery_events, voice_jobs)

    demo.max_threads = max_threads(service)
    # Read back by mount_options: launch and mount set both from their arguments.
    demo.max_file_size = settings.max_upload_mb * 2**20
    demo.auth = [settings.auth] if settings.auth else None
    demo.queue(max_size=max(64, 4 * settings.max_streams), default_concurrency_limit=1)
    isolate_requests(demo)
    handlers.client_watch.attach(demo)
    assert RECORDING not in {v for _, v in voices[:-1]}, "a library voice id collides with RECORDING"
    return demo


def mount_options(demo: gr.Blocks) -> dict:
    """Keyword arguments for ``gr.mount_gradio_app``: theme, CSS, no run history, and the upload limit
    and login set by build_demo. Gradio refuses a larger upload with HTTP 413 while receiving it.
    No ``allowed_paths``: Gradio serves only its own upload and cache folders."""
    return {
        "theme": THEME,
        "css": CSS + COMPARE_CSS,
        "run_history": False,
        "max_file_size": demo.max_file_size,
        "auth": demo.auth,
    }


def launch_options(demo: gr.Blocks) -> dict:
    """Keyword arguments for ``demo.launch``: ``mount_options`` plus the thread cap set by build_demo
    (launch would otherwise reset it to 40)."""
    return mount_options(demo) | {"max_threads": demo.max_threads}

"""Compare: the page's text in several voices (and modes) at once, each row in its own player.

A compare row is a voice, a mode (Clone, Cross-lingual or Instruct) and, for Instruct, an
instruction; every row speaks the form's text with its speed and seed, so the rows differ only in
what the row chooses. ``/compare`` is one queued Gradio generator, as ``/speak`` is (same queue,
concurrency, cancellation by Stop or a closed page): it builds one ``SynthesisRequest`` per row
with the modes' rules (``ModeHandlers.request``) and runs the rows' ``Pipeline.stream``s at once,
merging their chunks, so their LM requests decode in the same engine steps and their token2wav
chunks share the worker's batches. A bad row fails only its own player, with its message.

The rows' chunks are not forced into one worker step with ``Token2Wav.together``: it holds the
shared worker, and with it every other stream playing on the server, until the rows' first chunks
are queued (an LM's time to first audio); warm-up uses it on an idle engine. The rows decode in the
same LM steps, so their chunks reach the worker close together and share its steps as they come.

A compare of N rows holds N stream slots of one client (the page). It starts only when fair
admission has room for all of them (``FairAdmission.room``): a busy server refuses the whole
compare with a message rather than playing some rows and queueing others.

At most ``MAX_ROWS`` rows: four voices at once is already more than one listener can follow, and it
keeps one page's compare within half of a small server's streams (the per-client cap, admission.py).
"""

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import gradio as gr

from cosyapp.engine.request import MAX_SEED, SynthesisRequest
from cosyapp.errors import BusyError, ParamError, UserError
from cosyapp.frontend.modes import CROSS_LINGUAL, INSTRUCT, MAX_INSTRUCTION_CHARS, ZERO_SHOT
from cosyapp.web.ui.events import Handlers, as_toast, client_address, request_stats, toasts
from cosyapp.web.ui.form import SpeechForm
from cosyapp.web.ui.inputs import hand_on
from cosyapp.web.ui.modes import ModeHandlers
from cosyapp.web.ui.player import PlayerFeed, stop_players_js, stream_player

if TYPE_CHECKING:  # the page's modules import no torch
    from cosyapp.engine.pipeline import Pipeline

MAX_ROWS = 4
MODES = [("Clone", ZERO_SHOT), ("Cross-lingual", CROSS_LINGUAL), ("Instruct", INSTRUCT)]
UNUSED = ("— not used —", "")
SHARED = ["text", "recording", "prompt_text", "speed", "seed", "session"]  # the form's, for every row
ROW_FIELDS = ["voice", "mode", "instruction"]
NOTE = (
    "Speaks the text above in each row's voice and mode, all at once, with the speed and seed above. "
    "Each row plays as it streams (pause the ones you do not want to hear) and saves its WAV."
)
CSS = """
#compare .compare-row { border: 1px solid var(--border-color-primary); border-radius: var(--radius-lg);
  padding: 8px; gap: 8px; }
#compare .compare-stats { font-size: var(--text-sm); min-height: 1.5em; }
"""


def row_names(index: int) -> list[str]:
    """The ``/compare`` parameter names of row ``index`` (from 1): voice_1, mode_1, instruction_1."""
    return [f"{name}_{index}" for name in ROW_FIELDS]


def failed(message: str) -> str:
    """A row's stats line when it failed: ``**Failed:** MESSAGE``."""
    return f"**Failed:** {message}"


@dataclass
class Row:
    """One compare row while it runs: its request (or the error that ended it), its player's value
    and its stats line."""

    request: SynthesisRequest | None = None
    error: UserError | None = None
    feed: PlayerFeed | None = None
    line: str = ""
    samples: int = 0
    ttfa: float | None = None
    done: bool = False
    notes: list[str] = field(default_factory=list)

    def fail(self, error: UserError) -> None:
        self.error, self.line = error, failed(error.message)

    def player(self) -> dict | None:
        """The player's value: the stream so far, None for a row that failed."""
        return None if self.error or self.feed is None else self.feed.value(done=self.done)


@dataclass
class BatchesSeen:
    """The largest LM and flow batches the shared engines ran while a compare streamed, from the
    Pipeline's batch statistics (the engines' last step sizes), read every ``PERIOD`` seconds:
    a decode step of the tiny model lasts milliseconds, the rows decode together for many of them."""

    PERIOD = 0.005
    lm: int = 0
    flow: int = 0

    def read(self, pipeline: "Pipeline") -> None:
        gauges = pipeline.metrics.gauges  # a Pipeline's engines, or with --replicas their reports
        self.lm = max(self.lm, gauges["lm_batch_size"]())
        self.flow = max(self.flow, gauges["token2wav_batch_size"]())

    async def watch(self, pipeline: "Pipeline") -> None:
        """Read until cancelled."""
        while True:
            self.read(pipeline)
            await asyncio.sleep(self.PERIOD)

    def line(self, rows: int) -> str:
        """The summary under the rows: how many streamed, and the batches seen once there are any."""
        line = f"{rows} {'voice' if rows == 1 else 'voices'} at once"
        if self.lm or self.flow:
            line += (
                f" · engine batches while they streamed: LM up to **{self.lm}** requests, "
                f"flow up to **{self.flow}** chunks"
            )
        return line


class CompareHandlers:
    """``/compare`` over the page's handlers and the shared Pipeline."""

    def __init__(self, handlers: Handlers):
        self.handlers = handlers
        self.modes = ModeHandlers(handlers)
        self.pipeline = handlers.pipeline

    def rows(self, values: dict, address: str | None, gradio_session: str | None) -> dict[int, Row]:
        """A Row for each used row of ``values`` (the shared form fields, then each row's), by its
        number, with its request or its own error. Raises the UserError that would fail every row:
        the shared form's (text, speed, seed), no row used, more rows than one client may stream at
        once. The seed, if none is given, is drawn once for all rows. Call it off the event loop."""
        shared = {name: values[name] for name in SHARED}
        SpeechForm(voice_id="", **shared).check(self.handlers.max_chars)
        if shared["seed"] is None:
            shared["seed"] = secrets.randbelow(MAX_SEED + 1)
        used = [i for i in range(1, MAX_ROWS + 1) if values[f"voice_{i}"] not in (None, "")]
        if not used:
            raise ParamError("Pick a voice in at least one row to compare.", "voice")
        cap = self.pipeline.admission.max_client_streams
        if len(used) > cap:
            raise ParamError(
                f"This server streams at most {cap} requests of one page at once: compare at most {cap} "
                "voices.",
                "voice",
            )
        rows = {}
        for i in used:
            voice, mode, instruction = (values[name] for name in row_names(i))
            try:
                if mode not in (m for _, m in MODES):
                    names = ", ".join(m for _, m in MODES)
                    raise ParamError(f"Compare speaks the text: the mode must be one of {names}.", "mode")
                row_values = shared | {"voice_id": voice, "mode": mode, "instruction": instruction}
                rows[i] = Row(self.modes.request(row_values | {"source": None}, address, gradio_session))
            except UserError as err:
                rows[i] = Row()
                rows[i].fail(err)
        return rows

    def check_room(self, rows: list[Row]) -> None:
        """Raise BusyError unless fair admission can start every row's stream now."""
        requests = [row.request for row in rows if row.request is not None]
        if not requests:
            return
        room = self.pipeline.admission.room(requests[0].client)
        if room < len(requests):
            raise BusyError(
                f"The server is busy: comparing {len(requests)} voices needs {len(requests)} free streams "
                f"and {room} {'is' if room == 1 else 'are'} free now; try again in a moment."
            )

    async def compare(self, http: gr.Request, **values) -> AsyncIterator[tuple]:
        """Stream every used row at once. Yields (player 1..MAX_ROWS, stats 1..MAX_ROWS, summary): as
        a row's chunks arrive, its player value (``PlayerFeed``) and stats line (TTFA, RTF, length),
        ``gr.skip()`` for the other rows; at the end every row's: an unused or failed row's player
        None, a failed row's stats ``**Failed:** MESSAGE``."""
        started = time.monotonic()
        with toasts():
            rows = await asyncio.to_thread(self.rows, values, client_address(http), http.session_hash)
            if all(row.error is not None for row in rows.values()):
                raise next(iter(rows.values())).error
            self.check_room(list(rows.values()))
        rate = self.pipeline.sample_rate
        live = {i: row for i, row in rows.items() if row.request is not None}
        for row in live.values():
            row.feed, row.line = PlayerFeed(rate), "waiting for the first audio…"
        seen = BatchesSeen()

        def update(changed: list[int]) -> tuple:
            shown = [rows.get(i, Row()) if i in changed else None for i in range(1, MAX_ROWS + 1)]
            players = [gr.skip() if row is None else row.player() for row in shown]
            stats = [gr.skip() if row is None else row.line for row in shown]
            return (*players, *stats, seen.line(len(live)))

        yield update(list(rows))  # the Compare click has stopped every player: a failed row's stays so
        streams = {i: self.pipeline.stream(row.request) for i, row in live.items()}
        watching = asyncio.create_task(seen.watch(self.pipeline))
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(watching.cancel)
            chunks = await stack.enter_async_context(contextlib.aclosing(merged(streams)))
            async for i, item in chunks:
                row, now = rows[i], time.monotonic() - started
                if isinstance(item, BaseException):
                    if not isinstance(item, Exception):
                        raise item
                    row.fail(as_toast(item))  # logs a server error
                elif item is None:
                    row.done = True
                    row.line = " · ".join([request_stats(row.samples, rate, now, row.ttfa), *row.notes])
                elif item.note:
                    row.notes.append(item.note)
                    continue
                else:
                    row.ttfa = row.ttfa or now
                    row.samples += len(item.samples)
                    row.feed.add(item.samples, row.ttfa)
                    row.line = request_stats(row.samples, rate, now, row.ttfa) + " · streaming…"
                yield update([i])
        yield update(list(range(1, MAX_ROWS + 1)))


async def merged(streams: dict[int, AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """The items of several async iterators as they come: (key, item), then (key, None) when one
    ends or (key, exception) when one fails. Closing this cancels and closes every stream."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(key: int, stream: AsyncIterator) -> None:
        async with contextlib.aclosing(stream):
            async for item in stream:
                queue.put_nowait((key, item))

    def ended(key: int, task: asyncio.Task) -> None:
        if not task.cancelled():
            queue.put_nowait((key, task.exception()))  # None when it ended cleanly

    tasks = []
    for key, stream in streams.items():
        tasks.append(asyncio.create_task(pump(key, stream)))
        tasks[-1].add_done_callback(lambda task, key=key: ended(key, task))
    try:
        left = len(tasks)
        while left:
            key, item = await queue.get()
            if item is None or isinstance(item, BaseException):
                left -= 1
            yield key, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass
class CompareRows:
    """The compare section's components: per row its voice, mode, instruction, and its outputs (a
    column of its player and stats line, shown while the row has a voice)."""

    voices: list[gr.Dropdown] = field(default_factory=list)
    modes: list[gr.Dropdown] = field(default_factory=list)
    instructions: list[gr.Textbox] = field(default_factory=list)
    outputs: list[gr.Column] = field(default_factory=list)
    players: list[gr.HTML] = field(default_factory=list)
    stats: list[gr.Markdown] = field(default_factory=list)

    def inputs(self, form: dict) -> dict:
        """``inputs_kwargs`` of ``/compare``: the shared form fields, then each row's."""
        rows = {}
        for i, row in enumerate(zip(self.voices, self.modes, self.instructions, strict=True), start=1):
            rows |= dict(zip(row_names(i), row, strict=True))
        return {name: form[name] for name in SHARED} | rows

    def add(self, index: int, choices: list[tuple[str, str]], voice: str, sample_rate: int) -> None:
        """Lay out row ``index`` (from 1) in the current Blocks context, its voice set to ``voice``."""
        with gr.Column(elem_classes="compare-row", elem_id=f"compare-row-{index}"):
            with gr.Row(equal_height=True):
                self.voices.append(
                    hand_on(
                        gr.Dropdown(
                            choices,
                            value=voice,
                            label=f"Voice {index}",
                            allow_custom_value=True,
                            scale=2,
                            min_width=160,
                            elem_id=f"compare-voice-{index}",
                        )
                    )
                )
                mode = gr.Dropdown(
                    MODES,
                    value=ZERO_SHOT,
                    label="Mode",
                    scale=1,
                    min_width=120,
                    elem_id=f"compare-mode-{index}",
                )
                self.modes.append(hand_on(mode))
            instruction = gr.Textbox(
                "",
                label="Instruction",
                max_length=MAX_INSTRUCTION_CHARS,
                placeholder="e.g. 用四川话说这句话, or Speak slowly and softly.",
                visible=False,
                elem_id=f"compare-instruction-{index}",
            )
            self.instructions.append(hand_on(instruction))
            with gr.Column(visible=bool(voice)) as outputs:
                self.players.append(
                    stream_player(
                        sample_rate,
                        start_on="#compare-go",
                        stop_on="#compare-stop",
                        elem_id=f"compare-player-{index}",
                    )
                )
                self.stats.append(
                    gr.Markdown("", elem_classes="compare-stats", elem_id=f"compare-stats-{index}")
                )
            self.outputs.append(outputs)


@dataclass
class CompareSection:
    """The compare section: its rows, buttons and the summary line under them."""

    rows: CompareRows
    go: gr.Button
    stop: gr.Button
    summary: gr.Markdown

    @classmethod
    def build(cls, voices: list[tuple[str, str]], sample_rate: int) -> "CompareSection":
        """Lay it out in the current Blocks context, closed; the first rows get the first ``voices``
        ((label, id) choices), the last one none."""
        rows = CompareRows()
        defaults = [v for _, v in voices[: MAX_ROWS - 1]] + [""] * MAX_ROWS
        with gr.Accordion("Compare voices: one text, several voices at once", open=False, elem_id="compare"):
            gr.Markdown(NOTE)
            for i in range(1, MAX_ROWS + 1):
                rows.add(i, [UNUSED, *voices], defaults[i - 1], sample_rate)
            with gr.Row():
                go = gr.Button("Compare", variant="primary", scale=2, elem_id="compare-go")
                stop = gr.Button("Stop", variant="stop", scale=1, elem_id="compare-stop")
            summary = gr.Markdown("", elem_id="compare-summary")
        return cls(rows, go, stop, summary)


def wire_compare(handlers: Handlers, section: CompareSection, form: dict, concurrency: dict) -> None:
    """``/compare`` on the Compare button (Stop cancels it); each row's outputs shown while it has a
    voice and its instruction while its mode is Instruct; the rows' voice lists refreshed with the
    page's session and whenever the speaker control changes (a voice saved or deleted). ``form``:
    the speech form's components by field name."""
    rows = section.rows
    compare = CompareHandlers(handlers)
    running = section.go.click(
        compare.compare,
        inputs_kwargs=rows.inputs(form),
        outputs=[*rows.players, *rows.stats, section.summary],
        api_name="compare",
        **concurrency,
    )
    players = stop_players_js(*(player.elem_id for player in rows.players))
    section.stop.click(None, None, None, cancels=[running], queue=False, api_name=False, js=players)

    quiet = {"queue": False, "show_progress": "hidden", "api_name": False}
    for voice, mode, instruction, outputs in zip(
        rows.voices, rows.modes, rows.instructions, rows.outputs, strict=True
    ):
        voice.change(lambda v: gr.update(visible=v not in (None, "")), voice, outputs, **quiet)
        mode.change(lambda m: gr.update(visible=m == INSTRUCT), mode, instruction, **quiet)

    def choices(session: str) -> list[dict]:
        return [gr.update(choices=[UNUSED, *handlers.voice_choices(session)]) for _ in rows.voices]

    # The speaker control changes with the session's first list and after a voice is saved or deleted.
    for control in (form["session"], form["voice_id"]):
        control.change(choices, form["session"], rows.voices, **quiet)

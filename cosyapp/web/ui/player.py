"""The page's streaming player: raw 16-bit PCM through Gradio's queue, played with the Web Audio API.

The streaming event stays a queued Gradio generator (admission, queue and cancellation as for any
event); what it yields for the player is a ``PlayerFeed`` value, the stream so far:
``{"run", "rate", "chunks": [base64 of 16-bit little-endian PCM, ...], "ttfa", "done"}``. Gradio
sends a generator's outputs as diffs, so each chunk crosses the wire once (a list append) and a page
that receives several updates at once still has every chunk. No server-side encoding beyond base64.

The player is a ``gr.HTML`` with a fixed template, Gradio 6's documented way to put custom markup,
CSS and JavaScript on a page (``js_on_load`` runs once with ``element``, ``props`` and ``watch``).
It needs no build step and upgrades with Gradio, unlike a Svelte custom component (a separate
package built with npm and pinned to Gradio's frontend). ``static/player.js`` decodes the chunks
and feeds an AudioWorklet (``static/player-worklet.js``) that plays them gaplessly from the first
chunk, with a jitter buffer that grows after each underrun; where AudioWorklet is unavailable (a
page on plain http from another host is not a secure context) it schedules AudioBufferSourceNodes.
"""

import base64
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr
import numpy as np

from cosyapp.codec import pcm16

STATIC = Path(__file__).with_name("static")
TEMPLATE = """
<div class="cosy-player" data-state="idle">
  <div class="cp-label">Speech (streaming)</div>
  <div class="cp-row">
    <button class="cp-play" type="button" aria-label="Play" disabled>▶</button>
    <input class="cp-seek" type="range" min="0" max="0" step="0.01" value="0" aria-label="Position" disabled>
    <span class="cp-time">0:00 / 0:00</span>
  </div>
  <div class="cp-row">
    <label class="cp-volume-label">Volume
      <input class="cp-volume" type="range" min="0" max="1" step="0.01" value="1" aria-label="Volume">
    </label>
    <button class="cp-download" type="button" disabled>Download WAV</button>
  </div>
  <div class="cp-metrics" aria-live="polite"></div>
</div>
"""
CSS = """
.cosy-player { display: flex; flex-direction: column; gap: 8px; padding: 10px 12px;
  border: 1px solid var(--border-color-primary); border-radius: var(--radius-lg);
  background: var(--block-background-fill); }
.cp-label { font-size: var(--text-sm); color: var(--block-label-text-color); }
.cp-row { display: flex; flex-wrap: wrap; align-items: center; gap: 10px; }
.cp-seek { flex: 1 1 120px; min-width: 0; accent-color: var(--color-accent); }
.cp-volume { width: 96px; accent-color: var(--color-accent); vertical-align: middle; }
.cp-play, .cp-download { border: 1px solid var(--button-secondary-border-color);
  background: var(--button-secondary-background-fill); color: var(--button-secondary-text-color);
  border-radius: var(--radius-md); padding: 4px 12px; cursor: pointer; }
.cp-play { min-width: 44px; min-height: 36px; }
.cp-play:disabled, .cp-download:disabled { opacity: 0.5; cursor: default; }
.cp-time, .cp-volume-label, .cp-metrics { font-size: var(--text-sm); color: var(--body-text-color-subdued);
  font-variant-numeric: tabular-nums; }
.cp-download { margin-left: auto; }
"""


def player_js() -> str:
    """The ``js_on_load`` body: the worklet's source as a string, then ``static/player.js``."""
    worklet = (STATIC / "player-worklet.js").read_text()
    return f"const WORKLET_SOURCE = {json.dumps(worklet)};\n" + (STATIC / "player.js").read_text()


def stream_player(sample_rate: int, start_on: str, stop_on: str, **kwargs) -> gr.HTML:
    """The streaming player for ``PlayerFeed`` values at ``sample_rate``. ``start_on`` / ``stop_on``:
    CSS selectors of the page's Generate and Stop buttons (the Generate click opens the audio
    output and starts the click-to-sound clock). Other keyword arguments go to ``gr.HTML``."""
    return gr.HTML(
        None,
        html_template=TEMPLATE,
        css_template=CSS,
        js_on_load=player_js(),
        apply_default_css=False,
        sample_rate=sample_rate,
        start_on=start_on,
        stop_on=stop_on,
        **kwargs,
    )


def stop_players_js(*elem_ids: str) -> str:
    """The ``js`` of a Stop button's event: stop the players with these elem ids.

    Each player also stops on a click matching its ``stop_on`` (a capture listener on the page), but
    the button's own event is what cancels the stream on the server; stopping the players there as
    well ties the two together: a cancelled stream never keeps playing. Stopping twice is harmless.
    """
    selectors = json.dumps([f"#{elem_id} .cosy-player" for elem_id in elem_ids])
    return f"() => {{ for (const s of {selectors}) document.querySelector(s)?.cosyPlayer?.stop(); }}"


@dataclass
class PlayerFeed:
    """The player's value for one stream, built up chunk by chunk.

    Each yield must be a new dict holding a new list (Gradio diffs a yield against the previous
    one, which it keeps by reference); the chunk strings themselves are shared, so the diff is one
    list append per chunk.
    """

    rate: int
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    chunks: list[str] = field(default_factory=list)
    ttfa: float | None = None

    def add(self, samples: np.ndarray, ttfa: float | None) -> dict:
        """Append a chunk of float samples; returns the value to yield."""
        if len(samples):
            self.chunks.append(base64.b64encode(pcm16(samples)).decode("ascii"))
        self.ttfa = ttfa
        return self.value(done=False)

    def value(self, done: bool) -> dict:
        """The stream so far; ``done`` once the last chunk is in."""
        return {"run": self.run, "rate": self.rate, "chunks": [*self.chunks], "ttfa": self.ttfa, "done": done}

"""The voice gallery: every voice the page can use as a card (name, language, source and licence
note, prompt length) with a preview to play, "Use this voice", and for the browser's own voices
rename, share and delete.

The gallery is one ``gr.HTML`` (as the player is): its value is the list of cards, built here per
page, and ``static/gallery.js`` renders it, searching, filtering (language, source) and paging in
the page, so hundreds of shared voices need no server round trip to browse. A preview plays in a
plain ``<audio>`` element from a URL the server signed for this page (``VoicePreviews.url``): no
Gradio event and, once made, no synthesis. The card actions come back as the component's custom
events (``use_voice``, ``rename_voice``, ``share_voice``, ``delete_voice``, ``refresh_voices``;
not ``share``, which Gradio's page keeps for itself), handled with the rules of the speaker
control's own save and delete (``Handlers.own_voice``, ``check_shared``).
"""

from pathlib import Path

import gradio as gr

from cosyapp.frontend.voices import VoiceInfo
from cosyapp.service import Service
from cosyapp.web.ui.events import Handlers, check_shared, toasts
from cosyapp.web.ui.form import as_text

STATIC = Path(__file__).with_name("static")
PAGE_SIZE = 12
SOURCES = {"builtin": "Built-in", "model": "Model speaker", "shared": "Shared", "yours": "Yours"}
TEMPLATE = """
<div class="cosy-gallery">
  <div class="cg-filters">
    <input class="cg-search" type="search" placeholder="Search by name" aria-label="Search voices">
    <select class="cg-language" aria-label="Language"></select>
    <select class="cg-source" aria-label="Source"></select>
    <button class="cg-refresh" type="button" aria-label="Refresh the list">↻</button>
  </div>
  <div class="cg-count" aria-live="polite"></div>
  <ul class="cg-cards"></ul>
  <div class="cg-pages">
    <button class="cg-prev" type="button">‹ Previous</button>
    <span class="cg-page"></span>
    <button class="cg-next" type="button">Next ›</button>
  </div>
</div>
"""
CSS = """
.cosy-gallery { display: flex; flex-direction: column; gap: 10px; }
.cg-filters { display: flex; flex-wrap: wrap; gap: 8px; }
.cg-filters input, .cg-filters select, .cg-card input { min-height: 36px; padding: 4px 8px;
  border: 1px solid var(--input-border-color); border-radius: var(--radius-md);
  background: var(--input-background-fill); color: var(--body-text-color); font-size: var(--text-md); }
.cg-search { flex: 2 1 160px; min-width: 0; }
.cg-filters select { flex: 1 1 120px; min-width: 0; }
.cg-count, .cg-page { font-size: var(--text-sm); color: var(--body-text-color-subdued); }
.cg-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(min(100%, 240px), 1fr));
  gap: 10px; list-style: none; margin: 0; padding: 0; }
.cg-card { display: flex; flex-direction: column; gap: 6px; padding: 10px 12px; margin: 0;
  border: 1px solid var(--border-color-primary); border-radius: var(--radius-lg);
  background: var(--block-background-fill); }
.cg-card[data-selected="true"] { border-color: var(--color-accent); }
.cg-head { display: flex; align-items: baseline; gap: 8px; }
.cg-name { font-weight: 600; overflow-wrap: anywhere; color: var(--body-text-color); }
.cg-badge { margin-left: auto; white-space: nowrap; font-size: var(--text-xs); padding: 1px 8px;
  border-radius: 999px; background: var(--background-fill-secondary); color: var(--body-text-color-subdued); }
.cg-meta, .cg-note { font-size: var(--text-sm); color: var(--body-text-color-subdued);
  overflow-wrap: anywhere; }
.cg-row { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; }
.cg-card button, .cg-pages button, .cg-refresh { min-height: 36px; padding: 4px 10px; cursor: pointer;
  border: 1px solid var(--button-secondary-border-color); border-radius: var(--radius-md);
  background: var(--button-secondary-background-fill); color: var(--button-secondary-text-color); }
.cg-card button.cg-use { background: var(--button-primary-background-fill);
  color: var(--button-primary-text-color); border-color: var(--button-primary-border-color); }
.cg-card button.cg-delete { color: var(--button-cancel-text-color, #b91c1c); }
.cg-card button:disabled, .cg-pages button:disabled { opacity: 0.5; cursor: default; }
.cg-card[data-state="playing"] .cg-play, .cg-card[data-state="loading"] .cg-play {
  border-color: var(--color-accent); }
.cg-rename-form { display: none; }
.cg-card[data-renaming="true"] .cg-rename-form { display: flex; }
.cg-rename-form input { flex: 1 1 120px; min-width: 0; }
.cg-pages { display: flex; align-items: center; justify-content: center; gap: 12px; }
.cg-pages[hidden] { display: none; }
"""


def voice_gallery(**kwargs) -> gr.HTML:
    """The gallery's component, empty until its page's voices are listed (``Gallery.listing``).
    Keyword arguments go to ``gr.HTML``."""
    return gr.HTML(
        {"voices": [], "selected": ""},
        html_template=TEMPLATE,
        css_template=CSS,
        js_on_load=(STATIC / "gallery.js").read_text(),
        apply_default_css=False,
        page_size=PAGE_SIZE,
        sources=SOURCES,
        **kwargs,
    )


class Gallery:
    """The gallery's side of the server: the cards of a page and the handlers of their buttons. Each
    takes the page's browser key (``owner``: whose private voices it sees and may change)."""

    def __init__(self, service: Service, handlers: Handlers):
        self.voices = service.voices
        self.previews = service.previews
        self.handlers = handlers

    def listing(self, owner: str, selected: str = "") -> dict:
        """The gallery's value for the page keyed ``owner``: ``{"voices": [card, ...], "selected"}``;
        queues the previews not made yet (made in the background while the engines are idle)."""
        owner = as_text(owner, "browser key")
        owned = self.voices.owned_ids(owner or None)
        cards = []
        for info in self.voices.list_voices(owner or None):
            ready = self.previews.ready(info.id)
            if not ready:
                self.previews.queue(info.id, owner or None)
            cards.append(self.card(info, info.id in owned, ready))
        return {"voices": cards, "selected": selected}

    def card(self, info: VoiceInfo, own: bool, ready: bool) -> dict:
        """One voice's card: what the page shows and the signed URL of its preview."""
        source = "yours" if own else "shared" if info.kind == "user" else info.kind
        note = "; ".join(part for part in (info.note, info.licence) if part)
        return {
            "id": info.id,
            "name": info.name,
            "language": info.language,
            "source": source,
            "note": note,
            "seconds": round(self.voices.prompt_seconds(info.id), 1),
            "preview": self.previews.url(info.id),
            "ready": ready,
            "own": own,
            "shared": info.shared,
        }

    def use(self, owner: str, evt: gr.EventData) -> dict:
        """ "Use this voice": the speaker control set to the card's voice (and listing this page's
        voices, which may have changed since it was loaded)."""
        with toasts():
            owner = as_text(owner, "browser key")
            voice_id = as_text(evt._data.get("voice"), "voice")
            self.voices.info(voice_id, owner or None)  # VoiceNotFoundError for a voice not visible here
        return gr.update(choices=self.handlers.voice_choices(owner), value=voice_id)

    def rename(self, owner: str, evt: gr.EventData) -> tuple[dict, dict]:
        """Rename one of this browser's voices; returns the new gallery and speaker control."""
        with toasts():
            owner = as_text(owner, "browser key")
            voice_id, name = as_text(evt._data.get("voice"), "voice"), as_text(evt._data.get("name"), "name")
            self.handlers.own_voice(
                voice_id, owner, "rename", lambda v, o: self.voices.update(v, o, name=name)
            )
        gr.Info("Renamed.")
        return self.listing(owner, voice_id), gr.update(choices=self.handlers.voice_choices(owner))

    def share(self, owner: str, evt: gr.EventData) -> tuple[dict, dict]:
        """Share one of this browser's voices with everyone, or make it private again."""
        with toasts():
            owner = as_text(owner, "browser key")
            voice_id, shared = as_text(evt._data.get("voice"), "voice"), check_shared(evt._data.get("shared"))
            info = self.handlers.own_voice(
                voice_id, owner, "share", lambda v, o: self.voices.update(v, o, shared=shared)
            )
        gr.Info(f"“{info.name}” is " + ("shared with everyone." if shared else "visible only to you now."))
        return self.listing(owner, voice_id), gr.update(choices=self.handlers.voice_choices(owner))

    def delete(self, owner: str, evt: gr.EventData) -> tuple[dict, dict]:
        """Delete one of this browser's voices (``Handlers.delete_voice``), its previews with it."""
        update = self.handlers.delete_voice(evt._data.get("voice"), owner)
        return self.listing(owner), update


def wire_gallery(
    gallery: Gallery, component: gr.HTML, voice: gr.Dropdown, owner: gr.Textbox, after: list, jobs: dict
) -> None:
    """The gallery's events; ``after``: the page's events after which its list is made again (the
    page opened, a voice saved or deleted with the speaker control); ``jobs``: the queue settings of
    the page's voice work, which rename, share and delete share (their toasts need the queue)."""
    quick = {"queue": False, "api_name": False, "show_progress": "hidden"}
    for event in after:
        event.then(gallery.listing, [owner, voice], component, **quick)
    component.refresh_voices(gallery.listing, owner, component, **quick)
    component.use_voice(gallery.use, owner, voice, **quick)
    for event, handler in [
        (component.rename_voice, gallery.rename),
        (component.share_voice, gallery.share),
        (component.delete_voice, gallery.delete),
    ]:
        event(handler, owner, [component, voice], show_progress="hidden", **jobs)

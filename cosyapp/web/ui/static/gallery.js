// The voice gallery's page side: the body of gr.HTML's js_on_load (`element`, `props`, `watch`,
// `trigger`). props.value is {voices: [card, ...], selected}; a card is {id, name, language, source,
// note, seconds, preview (a signed URL), ready, own, shared} (web/ui/gallery.py).
// Searching, filtering and paging happen here, over the cards the page already has. Cards are built
// with DOM calls (textContent), never from HTML strings: names are what users typed.
// A preview plays in one <audio> element straight from its URL; a card's data-state says whether it
// is loading, playing or idle, and `window.cosyGallery.played` lists the previews played to their end.

const ALL = "";
const state = { search: "", language: ALL, source: ALL, page: 0, renaming: null, confirming: null };
const audio = new Audio();
audio.preload = "auto";
let playing = null; // the voice id whose preview the audio element holds
const played = [];

const $ = (selector) => element.querySelector(selector);
const voices = () => (props.value && props.value.voices) || [];

function make(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(className, text, label) {
  const node = make("button", className, text);
  node.type = "button";
  if (label) node.setAttribute("aria-label", label);
  return node;
}

function options(select, entries, chosen) {
  select.replaceChildren(...entries.map(([value, label]) => {
    const option = make("option", "", label);
    option.value = value;
    option.selected = value === chosen;
    return option;
  }));
}

function matching() {
  const search = state.search.trim().toLowerCase();
  return voices().filter((v) =>
    (!search || v.name.toLowerCase().includes(search)) &&
    (state.language === ALL || v.language === state.language) &&
    (state.source === ALL || v.source === state.source));
}

function card(v) {
  const item = make("li", "cg-card");
  item.dataset.voice = v.id;
  item.dataset.ready = String(v.ready);
  item.dataset.state = playing === v.id && !audio.paused ? "playing" : "idle";
  item.dataset.selected = String(props.value.selected === v.id);
  item.dataset.renaming = String(state.renaming === v.id);

  const head = make("div", "cg-head");
  head.append(make("span", "cg-name", v.name), make("span", "cg-badge", props.sources[v.source] || v.source));
  const seconds = v.seconds ? `${v.seconds.toFixed(1)} s prompt` : "prompt length unknown";
  const meta = make("div", "cg-meta", [v.language || "language unknown", seconds].join(" · "));
  item.append(head, meta);
  if (v.note) item.append(make("div", "cg-note", v.note));

  const actions = make("div", "cg-row");
  const play = button("cg-play", PLAY_LABELS[item.dataset.state], `Play the preview of ${v.name}`);
  if (!v.ready) play.title = "Not made yet: the first play makes it (a few seconds)";
  actions.append(play, button("cg-use", "Use this voice"));
  item.append(actions);

  if (v.own) {
    const own = make("div", "cg-row");
    own.append(
      button("cg-rename", "Rename"),
      button("cg-share", v.shared ? "Make private" : "Share"),
      button("cg-delete", state.confirming === v.id ? "Really delete?" : "Delete"));
    const form = make("div", "cg-row cg-rename-form");
    const input = make("input", "cg-new-name");
    input.value = v.name;
    input.maxLength = 60;
    input.setAttribute("aria-label", `New name for ${v.name}`);
    form.append(input, button("cg-save-name", "Save name"), button("cg-cancel-name", "Cancel"));
    item.append(own, form);
  }
  return item;
}

function render() {
  const cards = $(".cg-cards");
  if (!cards) return; // the template is being drawn again
  const all = voices();
  const languages = [...new Set(all.map((v) => v.language).filter(Boolean))].sort();
  options($(".cg-language"), [[ALL, "All languages"], ...languages.map((l) => [l, l])], state.language);
  const sources = Object.keys(props.sources).filter((s) => all.some((v) => v.source === s));
  options($(".cg-source"), [[ALL, "All sources"], ...sources.map((s) => [s, props.sources[s]])], state.source);
  if ($(".cg-search").value !== state.search) $(".cg-search").value = state.search;

  const found = matching();
  const pages = Math.max(1, Math.ceil(found.length / props.page_size));
  state.page = Math.min(state.page, pages - 1);
  const shown = found.slice(state.page * props.page_size, (state.page + 1) * props.page_size);
  cards.replaceChildren(...shown.map(card));
  $(".cg-count").textContent = found.length === all.length
    ? `${all.length} voices`
    : `${found.length} of ${all.length} voices`;
  $(".cg-page").textContent = `Page ${state.page + 1} of ${pages}`;
  $(".cg-prev").disabled = state.page === 0;
  $(".cg-next").disabled = state.page >= pages - 1;
  $(".cg-pages").hidden = pages === 1;
}

const PLAY_LABELS = { idle: "▶ Preview", loading: "… Loading", playing: "❚❚ Pause", error: "⚠ Try again" };

function setState(id, value) {
  const item = element.querySelector(`.cg-card[data-voice="${CSS.escape(id)}"]`);
  if (!item) return;
  item.dataset.state = value;
  item.querySelector(".cg-play").textContent = PLAY_LABELS[value];
}

function toggle(v) {
  if (playing === v.id && !audio.paused) {
    audio.pause();
    return;
  }
  if (playing !== null) setState(playing, "idle");
  playing = v.id;
  audio.src = v.preview;
  setState(v.id, "loading");
  audio.play().catch(() => setState(v.id, "error"));
}

audio.addEventListener("playing", () => playing && setState(playing, "playing"));
audio.addEventListener("pause", () => playing && setState(playing, "idle"));
audio.addEventListener("ended", () => {
  if (playing) {
    played.push(playing);
    setState(playing, "idle");
  }
});
audio.addEventListener("error", () => {
  if (!playing) return;
  setState(playing, "error");
  trigger("refresh_voices"); // the voice may be gone, or its URL signed for another model
});

element.addEventListener("click", (event) => {
  const target = event.target.closest("button");
  if (!target) return;
  if (target.matches(".cg-prev, .cg-next")) {
    state.page += target.matches(".cg-next") ? 1 : -1;
    render();
    return;
  }
  if (target.matches(".cg-refresh")) {
    trigger("refresh_voices");
    return;
  }
  const item = target.closest(".cg-card");
  const v = item && voices().find((x) => x.id === item.dataset.voice);
  if (!v) return;
  if (target.matches(".cg-play")) toggle(v);
  else if (target.matches(".cg-use")) {
    props.value.selected = v.id;
    element.querySelectorAll(".cg-card").forEach((c) => { c.dataset.selected = String(c === item); });
    trigger("use_voice", { voice: v.id });
    const form = document.querySelector("#voice");
    if (form) form.scrollIntoView({ behavior: "smooth", block: "center" });
  } else if (target.matches(".cg-rename")) {
    state.renaming = state.renaming === v.id ? null : v.id;
    item.dataset.renaming = String(state.renaming === v.id);
    if (state.renaming) item.querySelector(".cg-new-name").focus();
  } else if (target.matches(".cg-cancel-name")) {
    state.renaming = null;
    item.dataset.renaming = "false";
  } else if (target.matches(".cg-save-name")) {
    state.renaming = null;
    trigger("rename_voice", { voice: v.id, name: item.querySelector(".cg-new-name").value });
  } else if (target.matches(".cg-share")) {
    trigger("share_voice", { voice: v.id, shared: !v.shared });
  } else if (target.matches(".cg-delete")) {
    if (state.confirming !== v.id) {
      state.confirming = v.id; // a second click deletes
      target.textContent = "Really delete?";
      return;
    }
    state.confirming = null;
    if (playing === v.id) audio.pause();
    trigger("delete_voice", { voice: v.id });
  }
});

element.addEventListener("input", (event) => {
  if (event.target.matches(".cg-search")) state.search = event.target.value;
  else return;
  state.page = 0;
  render();
});

element.addEventListener("change", (event) => {
  if (event.target.matches(".cg-language")) state.language = event.target.value;
  else if (event.target.matches(".cg-source")) state.source = event.target.value;
  else return;
  state.page = 0;
  render();
});

element.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && event.target.matches(".cg-new-name")) {
    event.target.closest(".cg-card").querySelector(".cg-save-name").click();
  }
});

window.cosyGallery = { played, audio };
watch("value", render);
render();

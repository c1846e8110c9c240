// The streaming player's page side: the body of gr.HTML's js_on_load (`element`, `props`, `watch`).
// player.py prepends `const WORKLET_SOURCE = "...";` (player-worklet.js).
//
// props.value is the stream so far: {run, rate, chunks: [base64 16-bit PCM, ...], ttfa, done}.
// Gradio sends each new chunk once (a list append in its diff) and may hand several updates to one
// `watch` call, so the page plays chunks from the count it has already taken.
// Clicking an element matching props.start_on creates or resumes the AudioContext (the click is the
// user gesture autoplay policies ask for) and notes the click time; props.stop_on stops playback.
// The root element's data-* attributes and `cosyPlayer` object report what happened (tests, bench).

const root = element.querySelector(".cosy-player");
const ui = {
  play: root.querySelector(".cp-play"),
  seek: root.querySelector(".cp-seek"),
  time: root.querySelector(".cp-time"),
  volume: root.querySelector(".cp-volume"),
  download: root.querySelector(".cp-download"),
  metrics: root.querySelector(".cp-metrics"),
};
const rate = props.sample_rate;
let ctx = null;
let gain = null;
let output = null; // the worklet node's port wrapper, or the scheduled fallback
let ready = null;
let run = null; // the run being played
let staleRun = null; // the run that was playing when Generate was clicked: its late updates are ignored
let taken = 0; // chunks of props.value taken
let clip = []; // Float32Array chunks received
let received = 0;
let played = 0;
let ended = false;
let state = "idle";
let clickAt = null;
let arrivals = []; // [ms after the click, samples] per chunk
let measured = { clickToSound: null, serverTtfa: null, doneAt: null, underruns: 0, target: 0 };
let captured = [];
let dragging = false;

function setState(next) {
  state = next;
  root.dataset.state = next;
  ui.play.textContent = next === "playing" || next === "buffering" || next === "waiting" ? "❚❚" : "▶";
  ui.play.setAttribute("aria-label", ui.play.textContent === "▶" ? "Play" : "Pause");
}

function clock(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

function showPosition() {
  const length = received / rate;
  ui.seek.max = String(length);
  if (!dragging) ui.seek.value = String(played / rate);
  ui.time.textContent = `${clock(played / rate)} / ${clock(length)}`;
  ui.play.disabled = ui.seek.disabled = ui.download.disabled = received === 0;
}

function showMetrics() {
  const ms = (x) => (x === null ? "–" : `${Math.round(x)} ms`);
  const parts = [`click to sound <b>${ms(measured.clickToSound)}</b>`, `server TTFA <b>${ms(measured.serverTtfa)}</b>`];
  if (measured.clickToSound !== null && measured.serverTtfa !== null) {
    parts.push(`player + network <b>${ms(measured.clickToSound - measured.serverTtfa)}</b>`);
  }
  parts.push(`underruns <b>${measured.underruns}</b>`);
  if (measured.target) parts.push(`buffer <b>${ms(measured.target * 1000)}</b>`);
  ui.metrics.innerHTML = parts.join(" · ");
  root.dataset.clickToSoundMs = measured.clickToSound === null ? "" : measured.clickToSound.toFixed(1);
  root.dataset.serverTtfaMs = measured.serverTtfa === null ? "" : measured.serverTtfa.toFixed(1);
  root.dataset.underruns = String(measured.underruns);
}

// --- audio output ---------------------------------------------------------------------------------

function contextToPage(contextTime) {
  // performance.now() time at which the sample at `contextTime` reaches the output
  const stamp = ctx.getOutputTimestamp ? ctx.getOutputTimestamp() : null;
  if (stamp && stamp.performanceTime) return stamp.performanceTime + (contextTime - stamp.contextTime) * 1000;
  return performance.now() + (contextTime - ctx.currentTime + (ctx.outputLatency || ctx.baseLatency || 0)) * 1000;
}

const events = {
  sound(contextTime) {
    if (clickAt !== null && measured.clickToSound === null) {
      measured.clickToSound = contextToPage(contextTime) - clickAt;
      showMetrics();
    }
  },
  position(position, buffering) {
    played = position;
    if (state === "playing" || state === "buffering") setState(buffering ? "buffering" : "playing");
    showPosition();
  },
  // The output's messages cross a thread, so one sent before a stop can arrive after it: a stopped
  // (or restarted, idle) player keeps its state.
  underrun(target) {
    if (state !== "playing" && state !== "buffering") return;
    measured.underruns += 1;
    measured.target = target;
    setState("buffering");
    showMetrics();
  },
  ended(position) {
    played = position;
    if (state !== "stopped" && state !== "idle") setState("ended");
    showPosition();
  },
};

function workletOutput(node) {
  node.port.onmessage = ({ data }) => {
    if (data.type === "played") captured.push(data.samples);
    else if (data.type === "sound") events.sound(data.frame / ctx.sampleRate);
    else if (data.type === "position") events.position(data.position, data.buffering);
    else if (data.type === "underrun") events.underrun(data.target);
    else if (data.type === "ended") events.ended(data.position);
  };
  const send = (message, transfer) => node.port.postMessage(message, transfer || []);
  return {
    kind: "worklet",
    reset: () => send({ type: "reset" }),
    chunk: (samples) => send({ type: "chunk", samples }, [samples.buffer]),
    end: () => send({ type: "end" }),
    play: () => send({ type: "play" }),
    pause: () => send({ type: "pause" }),
    seek: (position) => send({ type: "seek", position }),
  };
}

// Without AudioWorklet (a page served over plain http from another host is not a secure context):
// one AudioBufferSourceNode per chunk, each scheduled where the previous one ends.
function scheduledOutput() {
  let sources = [];
  let next = 0; // context time where the next chunk starts
  let base = { time: 0, position: 0 }; // clip position `position` plays at context time `time`
  let queued = 0; // clip samples scheduled
  let playing = true;
  let heard = false;
  let streamEnded = false;
  const schedule = (samples) => {
    const now = ctx.currentTime;
    if (next < now) {
      if (queued > 0 && !streamEnded) events.underrun(0);
      next = now + 0.02;
      base = { time: next, position: queued };
    }
    const buffer = ctx.createBuffer(1, samples.length, rate);
    buffer.copyToChannel(samples, 0);
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(gain);
    source.start(next);
    sources.push(source);
    if (window.cosyappCapturePlayback) captured.push(samples);
    if (!heard) {
      const i = samples.findIndex((x) => Math.abs(x) >= 0.5 / 32768);
      if (i >= 0) {
        heard = true;
        events.sound(next + i / rate);
      }
    }
    next += samples.length / rate;
    queued += samples.length;
  };
  const stopAll = () => {
    for (const source of sources) source.stop();
    sources = [];
    next = 0;
  };
  const from = (position) => {
    stopAll();
    queued = position;
    let at = 0;
    for (const chunk of clip) {
      if (at + chunk.length > position) schedule(chunk.subarray(Math.max(0, position - at)));
      at += chunk.length;
    }
  };
  setInterval(() => {
    if (!playing || !ctx || queued === 0) return;
    const position = Math.min(queued, base.position + Math.round((ctx.currentTime - base.time) * rate));
    if (streamEnded && position >= received) {
      playing = false;
      events.ended(received);
    } else events.position(Math.max(0, position), false);
  }, 50);
  return {
    kind: "scheduled",
    reset: () => {
      stopAll();
      queued = 0;
      heard = streamEnded = false;
      playing = true;
    },
    chunk: (samples) => playing && schedule(samples),
    end: () => (streamEnded = true),
    play: () => {
      playing = true;
      from(played >= received && streamEnded ? 0 : played);
    },
    pause: () => {
      playing = false;
      stopAll();
    },
    seek: (position) => (playing ? from(position) : (played = position)),
  };
}

// Made at load (suspended until a click resumes it), so the first Generate does not wait for the
// worklet module.
function openAudio() {
  if (!ctx) {
    ctx = new AudioContext({ sampleRate: rate, latencyHint: "interactive" });
    gain = ctx.createGain();
    gain.gain.value = Number(ui.volume.value);
    gain.connect(ctx.destination);
    ready = (async () => {
      if (!ctx.audioWorklet) return scheduledOutput();
      const url = URL.createObjectURL(new Blob([WORKLET_SOURCE], { type: "text/javascript" }));
      await ctx.audioWorklet.addModule(url);
      URL.revokeObjectURL(url);
      const capture = Boolean(window.cosyappCapturePlayback);
      const node = new AudioWorkletNode(ctx, "cosyapp-stream", {
        numberOfInputs: 0,
        outputChannelCount: [1],
        processorOptions: { capture },
      });
      node.connect(gain);
      return workletOutput(node);
    })().then((made) => {
      output = made;
      root.dataset.output = made.kind; // ready: a Generate click from now on is heard at once
    });
  }
  return ready;
}

function resumeAudio() {
  const made = openAudio();
  if (ctx.state !== "running") ctx.resume();
  return made;
}

// --- the stream -----------------------------------------------------------------------------------

function decode(base64) {
  const bytes = atob(base64);
  const view = new DataView(new ArrayBuffer(bytes.length));
  for (let i = 0; i < bytes.length; i++) view.setUint8(i, bytes.charCodeAt(i));
  const samples = new Float32Array(bytes.length >> 1);
  for (let i = 0; i < samples.length; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
  return samples;
}

function startRun(id) {
  run = id;
  taken = 0;
  clip = [];
  received = played = 0;
  ended = false;
  arrivals = [];
  captured = [];
  measured = { clickToSound: null, serverTtfa: null, doneAt: null, underruns: 0, target: measured.target };
  root.dataset.run = id;
  if (output) output.reset();
  setState("waiting");
  showPosition();
  showMetrics();
}

async function take() {
  const value = props.value;
  if (!value || !value.run || value.run === staleRun) return;
  if (value.run !== run) startRun(value.run);
  await openAudio(); // resolved at once after the first clip
  if (value.run !== run) return; // a newer run started while the audio opened
  for (; taken < value.chunks.length; taken++) {
    const samples = decode(value.chunks[taken]);
    clip.push(samples);
    received += samples.length;
    arrivals.push([clickAt === null ? null : performance.now() - clickAt, samples.length]);
    if (state === "waiting") setState("playing");
    output.chunk(samples.slice()); // a paused or stopped output keeps it for later
  }
  if (value.ttfa !== null && value.ttfa !== undefined) measured.serverTtfa = value.ttfa * 1000;
  if (value.done && !ended) {
    ended = true;
    measured.doneAt = clickAt === null ? null : performance.now() - clickAt;
    output.end();
  }
  root.dataset.received = String(received);
  root.dataset.done = String(ended);
  showPosition();
  showMetrics();
}

let taking = Promise.resolve();
watch("value", () => {
  taking = taking.then(take).catch((error) => console.error("cosyapp player:", error));
});

function stop() {
  if (output) output.pause();
  if (state !== "idle") setState("stopped");
}

document.addEventListener(
  "click",
  (event) => {
    if (!(event.target instanceof Element) || !root.isConnected) return;
    if (event.target.closest(props.start_on)) {
      if (output) output.pause();
      staleRun = run;
      clickAt = event.timeStamp;
      resumeAudio();
      setState("idle");
    } else if (event.target.closest(props.stop_on)) stop();
  },
  true,
);

ui.play.addEventListener("click", () => {
  resumeAudio();
  if (!output) return;
  if (state === "playing" || state === "buffering" || state === "waiting") {
    output.pause();
    setState("paused");
  } else {
    output.play();
    setState("playing");
  }
});
ui.seek.addEventListener("input", () => {
  dragging = true;
  ui.time.textContent = `${clock(Number(ui.seek.value))} / ${clock(received / rate)}`;
});
ui.seek.addEventListener("change", () => {
  dragging = false;
  played = Math.round(Number(ui.seek.value) * rate);
  if (output) output.seek(played);
  if (state === "ended") setState("paused");
  showPosition();
});
ui.volume.addEventListener("input", () => {
  if (gain) gain.gain.value = Number(ui.volume.value);
});

function wavFile() {
  const header = new DataView(new ArrayBuffer(44));
  const text = (at, s) => [...s].forEach((c, i) => header.setUint8(at + i, c.charCodeAt(0)));
  text(0, "RIFF");
  header.setUint32(4, 36 + 2 * received, true);
  text(8, "WAVEfmt ");
  header.setUint32(16, 16, true);
  header.setUint16(20, 1, true);
  header.setUint16(22, 1, true);
  header.setUint32(24, rate, true);
  header.setUint32(28, 2 * rate, true);
  header.setUint16(32, 2, true);
  header.setUint16(34, 16, true);
  text(36, "data");
  header.setUint32(40, 2 * received, true);
  const pcm = clip.map((chunk) => Int16Array.from(chunk, (x) => Math.round(x * 32768)));
  return new Blob([header, ...pcm], { type: "audio/wav" });
}

ui.download.addEventListener("click", () => {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(wavFile());
  link.download = "speech.wav";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
});

function base64Of(chunks) {
  let binary = "";
  for (const chunk of chunks) {
    const bytes = new Uint8Array(Int16Array.from(chunk, (x) => Math.round(x * 32768)).buffer);
    for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

root.cosyPlayer = {
  // the Stop button's own Gradio event calls this as well (player.py stop_players_js), so the player
  // stops whenever Gradio cancels the stream, whatever this page's click listener saw
  stop,
  // what happened in the current run: the bench's and the tests' window into the player
  report: () => ({
    run,
    state,
    received,
    played,
    done: ended,
    arrivals,
    output: output && output.kind,
    context: ctx && ctx.state,
    ...measured,
  }),
  // the 16-bit samples the worklet wrote to the output, or the fallback scheduled, base64
  // (window.cosyappCapturePlayback = true)
  captured: () => base64Of(captured),
};
setState("idle");
showPosition();
showMetrics();
openAudio();

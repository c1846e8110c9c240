// The streaming player's audio thread: plays the clip's samples in order as they arrive.
//
// It holds every sample of the clip (so the page can seek within what has arrived) and a read
// position. Playback starts as soon as samples are there. When the buffer runs dry before the
// stream has ended (an underrun), it outputs silence and resumes only once `target` samples are
// buffered ahead: MIN_TARGET after the first underrun, doubling with each further one up to
// MAX_TARGET, and kept for the page's later clips (a slow network stays slow).
//
// Messages in:  {type: "reset"} | {type: "chunk", samples: Float32Array} | {type: "end"}
//               | {type: "play"} | {type: "pause"} | {type: "seek", position}
// Messages out: {type: "sound", frame}      the first non-silent sample of the clip, rendered at
//                                           context frame `frame` (click-to-sound measurement)
//               {type: "position", position, buffering}  about every 50 ms while playing
//               {type: "underrun", target}  | {type: "ended"}
//               {type: "played", position, samples}  with processorOptions.capture only: every
//                                           clip sample written to the output, in order (tests)

const MIN_TARGET = 0.08 * sampleRate;
const MAX_TARGET = 2.0 * sampleRate;
const POSITION_EVERY = Math.round((0.05 * sampleRate) / 128);
const SILENT = 0.5 / 32768; // below one 16-bit step

class StreamProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    this.capture = Boolean(options.processorOptions && options.processorOptions.capture);
    this.target = 0;
    this.reset();
    this.port.onmessage = (event) => this.receive(event.data);
  }

  reset() {
    this.chunks = [];
    this.starts = []; // the clip position of each chunk's first sample
    this.total = 0;
    this.position = 0;
    this.chunk = 0; // read cursor: chunk index and offset of `position`
    this.offset = 0;
    this.ended = false;
    this.playing = true;
    this.buffering = false;
    this.heard = false;
    this.quanta = 0;
  }

  receive(message) {
    if (message.type === "reset") {
      this.reset();
    } else if (message.type === "chunk") {
      this.starts.push(this.total);
      this.chunks.push(message.samples);
      this.total += message.samples.length;
    } else if (message.type === "end") {
      this.ended = true;
    } else if (message.type === "play") {
      if (this.ended && this.position >= this.total) this.seek(0);
      this.playing = true;
    } else if (message.type === "pause") {
      this.playing = false;
    } else if (message.type === "seek") {
      this.seek(message.position);
    }
  }

  seek(position) {
    this.position = Math.max(0, Math.min(Math.round(position), this.total));
    this.buffering = false;
    let index = 0;
    while (index + 1 < this.chunks.length && this.starts[index + 1] <= this.position) index += 1;
    this.chunk = index;
    this.offset = this.position - (this.starts[index] || 0);
  }

  // Copies up to `out.length` samples from the read cursor; returns how many.
  read(out) {
    let written = 0;
    while (written < out.length && this.chunk < this.chunks.length) {
      const source = this.chunks[this.chunk];
      const n = Math.min(out.length - written, source.length - this.offset);
      out.set(source.subarray(this.offset, this.offset + n), written);
      written += n;
      this.offset += n;
      if (this.offset === source.length) {
        this.chunk += 1;
        this.offset = 0;
      }
    }
    this.position += written;
    return written;
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    if (!this.playing || this.total === 0) return true;
    const ahead = this.total - this.position;
    if (this.buffering && (ahead >= this.target || this.ended)) this.buffering = false;
    if (!this.buffering && ahead > 0) {
      const start = this.position;
      const written = this.read(out);
      if (this.capture) this.port.postMessage({ type: "played", position: start, samples: out.slice(0, written) });
      if (!this.heard) this.listen(out, written);
      if (written < out.length && !this.ended) this.underrun();
    } else if (!this.buffering && ahead === 0 && !this.ended) {
      this.underrun();
    }
    if (this.ended && this.position >= this.total) {
      this.playing = false;
      this.port.postMessage({ type: "ended", position: this.position });
    } else if (++this.quanta % POSITION_EVERY === 0) {
      this.port.postMessage({ type: "position", position: this.position, buffering: this.buffering });
    }
    return true;
  }

  listen(out, written) {
    for (let i = 0; i < written; i++) {
      if (Math.abs(out[i]) >= SILENT) {
        this.heard = true;
        this.port.postMessage({ type: "sound", frame: currentFrame + i });
        return;
      }
    }
  }

  underrun() {
    this.buffering = true;
    this.target = this.target ? Math.min(this.target * 2, MAX_TARGET) : MIN_TARGET;
    this.port.postMessage({ type: "underrun", target: this.target / sampleRate });
  }
}

registerProcessor("cosyapp-stream", StreamProcessor);

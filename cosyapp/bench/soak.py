"""Soak test: ``python -m cosyapp.bench.soak`` serves the app on loopback with the tiny demo model and runs
N concurrent clients mixing good and bad requests for a while, then prints and writes a JSON summary.

Every good answer must be correct audio (24 kHz mono 16-bit, whole token hops; the same text and
seed always give the same samples, to within MAX_LSB_DIFF: batched with different neighbours, the
flow and HiFT round differently in the last float bits, which can move a 16-bit sample by one step),
every bad one its own message; a "busy, try again" (503 or
Gradio's busy error) is allowed and counted. RSS of the process is sampled every second. The exit
status is 1 when any answer was wrong.

    python -m cosyapp.bench.soak --seconds 600 --clients 16 --out soak.json
"""

import argparse
import io
import json
import os
import random
import tempfile
import threading
import time
import wave
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

SAMPLE_RATE = 24000
SAMPLES_PER_HOP = 480  # audio always comes in whole halves of a 25 Hz token
VOICE = "zh-aishell-w0121"
TEXTS = ("Hello there.", "One two three.", "How are you today? Fine thanks.")
SEEDS = (1, 2)
MAX_LSB_DIFF = 2  # largest difference, in 16-bit steps, between two answers to the same request
MAX_TEXT_CHARS = 400
KINDS = ("api_whole", "api_stream", "gradio", "bad_json", "unknown_voice", "too_long")


class WrongAnswer(AssertionError):
    """A response that breaks the contract (not merely busy)."""


@dataclass
class Tally:
    """Outcomes per request kind, shared by the client threads."""

    ok: Counter = field(default_factory=Counter)
    busy: Counter = field(default_factory=Counter)
    wrong: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)  # the first few wrong answers
    clips: dict[tuple[str, int], bytes] = field(default_factory=dict)  # (text, seed) -> whole WAV
    lock: threading.Lock = field(default_factory=threading.Lock)

    def same_clip(self, key: tuple[str, int], data: bytes) -> None:
        """Raise WrongAnswer when ``key`` was answered before with other audio (a different length,
        or a sample more than MAX_LSB_DIFF steps away)."""
        with self.lock:
            first = self.clips.setdefault(key, data)
        a, b = (np.frombuffer(clip[44:], dtype="<i2").astype(np.int32) for clip in (first, data))
        if len(a) != len(b):
            raise WrongAnswer(f"seed {key[1]} gave {len(b)} samples for {key[0]!r}, earlier {len(a)}")
        if len(a) and int(np.abs(a - b).max()) > MAX_LSB_DIFF:
            step = int(np.abs(a - b).max())
            raise WrongAnswer(f"seed {key[1]} gave different audio for {key[0]!r} (by {step} steps)")


def pcm_samples(data: bytes, header: bool) -> int:
    """Samples of a 24 kHz mono 16-bit WAV (or raw PCM); raises WrongAnswer for anything else."""
    if header:
        with wave.open(io.BytesIO(data[:44])) as reader:
            form = (reader.getframerate(), reader.getnchannels(), reader.getsampwidth())
        if form != (SAMPLE_RATE, 1, 2):
            raise WrongAnswer(f"WAV format {form}, expected (24000, 1, 2)")
        data = data[44:]
    samples = len(data) // 2
    if len(data) % 2 or samples == 0 or samples % SAMPLES_PER_HOP:
        raise WrongAnswer(f"{len(data)} bytes of audio: not whole token hops")
    return samples


def expect_error(response: httpx.Response, status: int, words: str) -> None:
    if response.status_code != status or words not in response.json()["error"]["message"]:
        raise WrongAnswer(
            f"expected {status} with {words!r}, got {response.status_code}: {response.text[:200]}"
        )


class Client:
    """One simulated user: a thread sending requests of random kinds until the deadline."""

    def __init__(self, base: str, tally: Tally, seed: int):
        self.base = base
        self.tally = tally
        self.rng = random.Random(seed)
        self.http = httpx.Client(base_url=base, timeout=300)
        self._gradio = None

    def run(self, deadline: float) -> None:
        try:
            while time.monotonic() < deadline:
                kind = self.rng.choice(KINDS)
                try:
                    busy = getattr(self, kind)()
                except WrongAnswer as error:
                    with self.tally.lock:
                        self.tally.wrong[kind] += 1
                        if len(self.tally.examples) < 10:
                            self.tally.examples.append(f"{kind}: {error}")
                    continue
                with self.tally.lock:
                    (self.tally.busy if busy else self.tally.ok)[kind] += 1
        finally:
            self.http.close()

    def _body(self) -> dict:
        return {"input": self.rng.choice(TEXTS), "voice": VOICE, "seed": self.rng.choice(SEEDS)}

    def api_whole(self) -> bool:
        body = self._body()
        response = self.http.post("/v1/audio/speech", json=body)
        if response.status_code == 503:
            return True
        if response.status_code != 200:
            raise WrongAnswer(f"status {response.status_code}: {response.text[:200]}")
        pcm_samples(response.content, header=True)
        self.tally.same_clip((body["input"], body["seed"]), response.content)
        return False

    def api_stream(self) -> bool:
        body = {**self._body(), "stream": True, "response_format": "pcm"}
        with self.http.stream("POST", "/v1/audio/speech", json=body) as response:
            data = response.read()
        if response.status_code == 503:
            return True
        if response.status_code != 200:
            raise WrongAnswer(f"status {response.status_code}: {data[:200]!r}")
        samples = pcm_samples(data, header=False)
        whole = self.tally.clips.get((body["input"], body["seed"]))
        if whole is not None and len(whole) - 44 != 2 * samples:
            raise WrongAnswer(f"streamed {samples} samples, the whole clip has {(len(whole) - 44) // 2}")
        return False

    def gradio(self) -> bool:
        from gradio_client import Client as GradioClient
        from gradio_client.exceptions import AppError
        from gradio_client.utils import QueueError

        if self._gradio is None:
            self._gradio = GradioClient(self.base + "/", download_files=False, verbose=False)
        body = self._body()
        form = (body["input"], VOICE, None, "", 1.0, body["seed"], "")
        try:
            _, _, file = self._gradio.predict(*form, api_name="/speak_clip")
        except (AppError, QueueError) as error:  # our busy message, or Gradio's queue is full
            if "busy" in str(error).lower():
                return True
            raise WrongAnswer(f"gradio error: {error}") from None
        pcm_samples(self.http.get(file["url"]).content, header=True)
        return False

    def bad_json(self) -> bool:
        response = self.http.post(
            "/v1/audio/speech", content=b'{"input": "Hi", ', headers={"content-type": "application/json"}
        )
        expect_error(response, 400, "not valid JSON")
        return False

    def unknown_voice(self) -> bool:
        expect_error(
            self.http.post("/v1/audio/speech", json={**self._body(), "voice": "nobody"}), 404, "not found"
        )
        return False

    def too_long(self) -> bool:
        body = {**self._body(), "input": "Hello. " * (MAX_TEXT_CHARS // 7 + 1)}
        expect_error(self.http.post("/v1/audio/speech", json=body), 400, "the limit is")
        return False


def rss_kb() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def sample_rss(stop: threading.Event, samples: list[tuple[float, int]], started: float) -> None:
    while not stop.wait(1.0):
        samples.append((round(time.monotonic() - started, 1), rss_kb()))


@contextmanager
def serving_app(home: Path, max_streams: int) -> Iterator[str]:
    """The app (tiny demo model, PyTorch LM engine, CPU) under uvicorn on a free loopback port."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from cosyapp.service import build_service
    from cosyapp.settings import Settings
    from cosyapp.web.server import build_app, serve_in_thread

    settings = Settings(
        demo=True,
        engine="torch",
        device="cpu",
        max_streams=max_streams,
        max_text_chars=MAX_TEXT_CHARS,
        cache_dir=home / "cache",
        data_dir=home / "data",
    )
    with serve_in_thread(build_app(build_service(settings))) as base:
        yield base


def run_soak(
    seconds: float,
    clients: int,
    max_streams: int = 4,
    seed: int = 0,
    home: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Serve the app and run ``clients`` clients for ``seconds``; returns the summary.

    ``home`` holds the demo model and voice features (default: a fresh temporary folder).
    """
    home = home or Path(tempfile.mkdtemp(prefix="cosyapp-soak-"))
    tally = Tally()
    rss: list[tuple[float, int]] = []
    with serving_app(home, max_streams) as base:
        log(f"serving on {base}; {clients} clients for {seconds:.0f} s")
        started = time.monotonic()
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(stop, rss, started), daemon=True)
        sampler.start()
        workers = [
            threading.Thread(target=Client(base, tally, seed + i).run, args=(started + seconds,))
            for i in range(clients)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        stop.set()
        elapsed = time.monotonic() - started
        health = httpx.get(f"{base}/health").json()
    memory = [kb for _, kb in rss] or [rss_kb()]
    half = len(memory) // 2
    return {
        "seconds": round(elapsed, 1),
        "clients": clients,
        "max_streams": max_streams,
        "requests": sum(tally.ok.values()) + sum(tally.busy.values()) + sum(tally.wrong.values()),
        "ok": dict(tally.ok),
        "busy": dict(tally.busy),
        "wrong": dict(tally.wrong),
        "wrong_examples": tally.examples,
        "distinct_clips_checked": len(tally.clips),
        "rss_mb": {
            "first": round(memory[0] / 1024, 1),
            "max_first_half": round(max(memory[: max(half, 1)]) / 1024, 1),
            "max_second_half": round(max(memory[half:]) / 1024, 1),
            "last": round(memory[-1] / 1024, 1),
        },
        "rss_samples": rss,
        "health_after": {k: health[k] for k in ("status", "active_streams", "waiting", "lm_restarts")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cosyapp.bench.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--seconds", type=float, default=300.0, help="how long the clients run (default: 300)"
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    parser.add_argument("--max-streams", type=int, default=4, help="the server's stream slots (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (default: 0)")
    parser.add_argument(
        "--out", type=Path, default=Path("soak.json"), help="summary file (default: soak.json)"
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1 or args.max_streams < 1:
        parser.error("--seconds, --clients and --max-streams must be positive")
    summary = run_soak(args.seconds, args.clients, args.max_streams, args.seed)
    text = json.dumps({k: v for k, v in summary.items() if k != "rss_samples"}, indent=2)
    print(text)
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"written to {args.out}")
    return 1 if summary["wrong"] else 0


if __name__ == "__main__":
    raise SystemExit(main())

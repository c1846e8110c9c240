"""Soak test: ``python -m cosyapp.soak`` serves the app on loopback with the tiny demo model and runs
N concurrent clients mixing good and bad requests for a while, then prints and writes a JSON summary.

Every good answer must be correct audio (24 kHz mono 16-bit, whole token hops; the same text and
seed always give the same samples, to within MAX_LSB_DIFF: batched with different neighbours, the
flow and HiFT round differently in the last float bits, which can move a 16-bit sample by one step),
every bad one its own message; a "busy, try again" (503 or
Gradio's busy error) is allowed and counted. The exit status is 1 when any answer was wrong.

Memory: every client first sends one request of each kind (warm-up), then the run goes in waves; after
each, with nothing in flight, the process's live objects, tensors and RSS are sampled, and the
summary gives their median growth per wave (see cosyapp/soak/memory.py for why).

    python -m cosyapp.soak --seconds 600 --clients 16 --out soak.json
"""

import argparse
import functools
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

from cosyapp.soak.memory import footprint, steady_growth

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

    def requests(self) -> int:
        """Requests answered so far, whatever the outcome."""
        with self.lock:
            return sum(self.ok.values()) + sum(self.busy.values()) + sum(self.wrong.values())

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

    def warm_up(self) -> None:
        """One request of each kind, so every path has run once before memory is measured."""
        for kind in KINDS:
            self.send(kind)

    def run(self, deadline: float) -> None:
        """Requests of random kinds until ``deadline`` (the last one may end after it)."""
        while time.monotonic() < deadline:
            self.send(self.rng.choice(KINDS))

    def send(self, kind: str) -> None:
        """One request of ``kind``, its outcome tallied."""
        try:
            busy = getattr(self, kind)()
        except WrongAnswer as error:
            with self.tally.lock:
                self.tally.wrong[kind] += 1
                if len(self.tally.examples) < 10:
                    self.tally.examples.append(f"{kind}: {error}")
            return
        with self.tally.lock:
            (self.tally.busy if busy else self.tally.ok)[kind] += 1

    def close(self) -> None:
        self.http.close()

    def _body(self) -> dict:
        return {"input": self.rng.choice(TEXTS), "voice": VOICE, "seed": self.rng.choice(SEEDS)}

    def api_whole(self) -> bool:
        body = {**self._body(), "response_format": "wav"}
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

        from cosyapp.web.ui.events import batch_failure

        if self._gradio is None:
            self._gradio = GradioClient(self.base + "/", download_files=False, verbose=False)
        body = self._body()
        form = (body["input"], VOICE, None, "", 1.0, body["seed"], "")
        try:
            _, stats, file = self._gradio.predict(*form, api_name="/speak_clip")
            failure = batch_failure(stats)  # a request that failed inside a batch of several
            if failure is not None:
                raise AppError(failure)
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


def in_threads(work: list[Callable[[], None]]) -> None:
    """Run each of ``work`` in its own thread and wait for all."""
    threads = [threading.Thread(target=job) for job in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def quiet_footprint(base: str) -> dict[str, int]:
    """``footprint()`` once the server has no stream running or waiting."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = httpx.get(f"{base}/health").json()
        if health["active_streams"] == health["waiting"] == 0:
            break
        time.sleep(0.1)
    return footprint()


def run_soak(
    seconds: float,
    clients: int,
    max_streams: int = 4,
    seed: int = 0,
    home: Path | None = None,
    waves: int = 10,
    log: Callable[[str], None] = print,
) -> dict:
    """Serve the app, warm up, and run ``clients`` clients for ``seconds`` in ``waves``; returns the
    summary.

    ``home`` holds the demo model and voice features (default: a fresh temporary folder).
    """
    home = home or Path(tempfile.mkdtemp(prefix="cosyapp-soak-"))
    tally = Tally()
    with serving_app(home, max_streams) as base:
        log(f"serving on {base}; {clients} clients for {seconds:.0f} s in {waves} waves")
        users = [Client(base, tally, seed + i) for i in range(clients)]
        in_threads([user.warm_up for user in users])
        samples = [quiet_footprint(base) | {"requests": tally.requests()}]
        started = time.monotonic()
        for _ in range(waves):  # every client sends at least one request per wave
            deadline = time.monotonic() + seconds / waves
            in_threads([functools.partial(user.run, deadline) for user in users])
            samples.append(quiet_footprint(base) | {"requests": tally.requests()})
        elapsed = time.monotonic() - started
        for user in users:
            user.close()
        health = httpx.get(f"{base}/health").json()
    growth = steady_growth(samples)
    return {
        "seconds": round(elapsed, 1),
        "clients": clients,
        "max_streams": max_streams,
        "requests": tally.requests(),
        "ok": dict(tally.ok),
        "busy": dict(tally.busy),
        "wrong": dict(tally.wrong),
        "wrong_examples": tally.examples,
        "distinct_clips_checked": len(tally.clips),
        "growth_per_wave": growth,
        "after_each_wave": samples,  # the first after the warm-up
        "health_after": {k: health[k] for k in ("status", "active_streams", "waiting", "lm_restarts")},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosyapp.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=300.0, help="how long the clients run (default: 300)"
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default: 8)")
    parser.add_argument("--max-streams", type=int, default=4, help="the server's stream slots (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (default: 0)")
    parser.add_argument(
        "--waves", type=int, default=10, help="memory samples, one after each wave (default: 10)"
    )
    parser.add_argument(
        "--out", type=Path, default=Path("soak.json"), help="summary file (default: soak.json)"
    )
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.clients < 1 or args.max_streams < 1 or args.waves < 2:
        parser.error("--seconds, --clients and --max-streams must be positive, --waves at least 2")
    summary = run_soak(args.seconds, args.clients, args.max_streams, args.seed, waves=args.waves)
    print(json.dumps({k: v for k, v in summary.items() if k != "after_each_wave"}, indent=2))
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"written to {args.out}")
    return 1 if summary["wrong"] else 0

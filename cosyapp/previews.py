"""Voice previews: a short fixed sentence in each voice, made once per voice and model, kept on disk.

A preview goes through the process's one Pipeline like any request (as the client ``previews``,
with a fixed seed), so it counts in the request metrics when it is made and never again when it is
played. Previews are made:
- in the background by one task on the server's event loop (``start`` in the server's lifespan),
  one at a time and only while the Pipeline has nothing else to do: for each voice saved (page or
  API), for each voice the gallery lists without one, and at start for every voice that had a
  preview of another model (the model folder changed);
- on demand, when the page or the API asks for a preview not made yet; concurrent requests for one
  voice wait for the same synthesis.

Where they are kept: a saved voice's in its own folder (``preview-<model>.wav``, so deleting the
voice deletes them), every other voice's under ``<data>/previews/``. ``<model>`` is the model
folder's fingerprint (each weight file's size and time, the preview sentences' version), so a
changed model makes new previews. At most ``max_stored`` files are kept: the background work stops
there, and a preview made on demand beyond it evicts the least recently played.
"""

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
from pathlib import Path
from urllib.parse import urlencode

from cosyapp.codec import wav
from cosyapp.engine.pipeline import Pipeline
from cosyapp.engine.request import SynthesisRequest
from cosyapp.errors import VoiceNotFoundError
from cosyapp.frontend.text import script_language
from cosyapp.frontend.voices import VoiceInfo, VoiceLibrary
from cosyapp.models.checkpoint import NETWORK_FILES

log = logging.getLogger(__name__)

SENTENCES = {
    "zh": "你好，这是我的声音。很高兴认识你。",
    "en": "Hello! This is how my voice sounds.",
    "ja": "こんにちは、これが私の声です。",
    "ko": "안녕하세요, 제 목소리입니다.",
}
SENTENCES_VERSION = 1  # part of the fingerprint: new sentences or seed make new previews
SEED = 20240
CLIENT = "previews"  # fair admission counts all previews as one client
MAX_STORED = 400  # about 2.5 s of 16-bit 24 kHz audio each: ~50 MB
IDLE_POLL_S = 0.25
PAGE_PATH = "/voice-previews"  # the page's signed preview URLs (web/previews.py)


def preview_text(info: VoiceInfo, transcript: str = "") -> str:
    """The preview sentence in the voice's language; a voice saved before languages were kept gets
    the one its transcript's script is written for; English where there is none."""
    language = info.language or script_language(transcript)
    return SENTENCES.get(language, SENTENCES["en"])


def model_fingerprint(model_dir: Path) -> str:
    """16 hex digits naming the model folder's weights as the vLLM export does (each network file's
    size and modification time) and the preview sentences' version."""
    stats = []
    for name in NETWORK_FILES:
        path = model_dir / name
        if path.is_file():
            stat = path.stat()
            stats.append([name, stat.st_size, stat.st_mtime_ns])
    facts = json.dumps({"files": stats, "sentences": SENTENCES_VERSION, "seed": SEED, "text": SENTENCES})
    return hashlib.sha256(facts.encode()).hexdigest()[:16]


class VoicePreviews:
    """The previews of one process's voices, made through its Pipeline; see the module's docstring.

    ``made`` counts previews synthesised by this process. ``queue`` may be called from any thread.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        voices: VoiceLibrary,
        model_dir: Path,
        data_dir: Path,
        max_stored: int = MAX_STORED,
    ):
        self.pipeline = pipeline
        self.voices = voices
        self.fingerprint = model_fingerprint(model_dir)
        self.max_stored = max_stored
        self.shared_dir = data_dir / "previews"
        self.shared_dir.mkdir(parents=True, exist_ok=True)
        self.made = 0
        self._key = _url_key(self.shared_dir / "url-key")  # kept: URLs stay valid across restarts
        self._making: dict[str, asyncio.Future[bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: asyncio.Queue[tuple[str, str | None]] | None = None
        self._pending: set[str] = set()  # the ids in _waiting, each queued once
        self._task: asyncio.Task | None = None
        voices.on_saved.append(lambda info, owner: self.queue(info.id, owner))

    # --- where they are -----------------------------------------------------------------------

    def path(self, voice_id: str, fingerprint: str | None = None) -> Path:
        """The file of ``voice_id``'s preview for the model ``fingerprint`` (default: this one's)."""
        fingerprint = fingerprint or self.fingerprint
        if voice_id.startswith("user-"):
            return self.voices.user_dir / voice_id / f"preview-{fingerprint}.wav"
        name = hashlib.sha256(voice_id.encode()).hexdigest()[:16]  # model speakers' ids are any text
        return self.shared_dir / f"{name}-{fingerprint}.wav"

    def ready(self, voice_id: str) -> bool:
        """Whether ``voice_id``'s preview for this model is on disk."""
        return self.path(voice_id).is_file()

    def _stored(self) -> list[Path]:
        return [*self.shared_dir.glob("*.wav"), *self.voices.user_dir.glob("user-*/preview-*.wav")]

    def _others(self, voice_id: str) -> list[Path]:
        """``voice_id``'s previews of other models."""
        own = self.path(voice_id)
        return [p for p in own.parent.glob(own.name.replace(self.fingerprint, "*")) if p != own]

    # --- the page's URLs ----------------------------------------------------------------------

    def url(self, voice_id: str) -> str:
        """The page's URL of a preview: the model's fingerprint and a signature of both, so only a
        page that listed the voice can fetch it (a private voice stays its owner's)."""
        signature = self._signature(voice_id, self.fingerprint)
        query = urlencode({"voice": voice_id, "model": self.fingerprint, "sig": signature})
        return f"{PAGE_PATH}?{query}"

    def signed(self, voice_id: str, fingerprint: str, signature: str) -> bool:
        """Whether ``signature`` is this process's for ``voice_id`` and this model."""
        expected = self._signature(voice_id, fingerprint)
        return fingerprint == self.fingerprint and hmac.compare_digest(expected, signature)

    def _signature(self, voice_id: str, fingerprint: str) -> str:
        return hmac.new(self._key, f"{voice_id}\n{fingerprint}".encode(), "sha256").hexdigest()[:32]

    # --- making them --------------------------------------------------------------------------

    async def audio(self, voice_id: str, owner: str | None) -> bytes:
        """The preview of ``voice_id`` as a 16-bit WAV, made now if it is not on disk yet. ``owner``:
        the browser key it is asked for (None: the HTTP API). Raises ``VoiceNotFoundError`` for a
        voice ``owner`` cannot use, and what the Pipeline raises."""
        info = await asyncio.to_thread(self.voices.info, voice_id, owner)
        data = await asyncio.to_thread(_read_touched, self.path(voice_id))
        if data is not None:
            return data
        making = self._making.get(voice_id)
        if making is None:
            making = self._making[voice_id] = asyncio.ensure_future(self._make(info, owner))
            making.add_done_callback(lambda _: self._making.pop(voice_id, None))
        return await asyncio.shield(making)  # a caller that leaves does not cancel the others' wait

    async def _make(self, info: VoiceInfo, owner: str | None) -> bytes:
        voice = await asyncio.to_thread(self.voices.get, info.id, owner)
        request = SynthesisRequest(
            preview_text(info, voice.prompt_text), voice, seed=SEED, streaming=False, client=CLIENT
        )
        rate, samples = await self.pipeline.synthesize(request)
        data = wav(samples, rate)
        await asyncio.to_thread(self._store, info.id, data)
        self.made += 1
        return data

    def _store(self, voice_id: str, data: bytes) -> None:
        path = self.path(voice_id)
        if not path.parent.is_dir():  # the voice was deleted while its preview was made
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        for stale in self._others(voice_id):
            stale.unlink(missing_ok=True)
        files = sorted(self._stored(), key=_mtime)
        for old in files[: max(0, len(files) - self.max_stored)]:
            if old != path:
                old.unlink(missing_ok=True)

    # --- in the background --------------------------------------------------------------------

    def queue(self, voice_id: str, owner: str | None) -> None:
        """Have ``voice_id``'s preview made in the background (as ``owner`` sees it), when the
        background task runs; from any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._enqueue, voice_id, owner)

    def _enqueue(self, voice_id: str, owner: str | None) -> None:
        if self._waiting is not None and voice_id not in self._pending:
            self._pending.add(voice_id)
            self._waiting.put_nowait((voice_id, owner))

    async def start(self) -> None:
        """Start the background task on the running loop; it first queues the voices that have a
        preview of another model."""
        self._loop = asyncio.get_running_loop()
        self._waiting = asyncio.Queue()
        self._task = asyncio.create_task(self._run())
        for voice_id, owner in await asyncio.to_thread(self._changed_model):
            self._enqueue(voice_id, owner)

    async def stop(self) -> None:
        """Stop the background task (a preview being made is cancelled, and made again later)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
        self._loop = self._waiting = self._task = None
        self._pending.clear()

    def _changed_model(self) -> list[tuple[str, str | None]]:
        """(id, owner) of each voice that has a preview of another model and none of this one."""
        ids = [info.id for info in self.voices.list_voices(None) if info.kind != "user"]
        ids += sorted(p.parent.name for p in self.voices.user_dir.glob("user-*/preview-*.wav"))
        return [
            (voice_id, self.voices.owner_of(voice_id))
            for voice_id in dict.fromkeys(ids)
            if self._others(voice_id) and not self.ready(voice_id)
        ]

    async def _run(self) -> None:
        assert self._waiting is not None
        while True:
            voice_id, owner = await self._waiting.get()
            try:
                await self._background(voice_id, owner)
            except VoiceNotFoundError:
                pass  # deleted, or made private, since it was queued
            except Exception:
                log.exception("the preview of %s failed", voice_id)
            finally:
                self._pending.discard(voice_id)

    async def _background(self, voice_id: str, owner: str | None) -> None:
        """Make one queued preview once the engines are idle, unless it exists or the store is full."""
        if self.ready(voice_id) or len(await asyncio.to_thread(self._stored)) >= self.max_stored:
            return
        admission = self.pipeline.admission
        while admission.active or admission.waiting:  # users first
            await asyncio.sleep(IDLE_POLL_S)
        await self.audio(voice_id, owner)


def _url_key(path: Path) -> bytes:
    """The key that signs the page's URLs, made once and kept readable by this user only."""
    if not path.is_file():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return bytes.fromhex(path.read_text().strip())


def _read_touched(path: Path) -> bytes | None:
    """The file's bytes, its time set to now (recently played: evicted last); None if missing."""
    try:
        data = path.read_bytes()
        path.touch()
    except FileNotFoundError:
        return None
    return data


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0

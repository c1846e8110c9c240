"""The voice library behind the speaker control.

Three sources: built-in voices shipped in ``assets/voices`` (audio + transcript + licence note),
ready-made speakers from the model folder's ``spk2info.pt``, and voices users save from their own
recordings. Features of a recording are computed once and cached on disk by content hash; user voices
survive restarts and are private to the session that saved them unless saved as shared. A user
voice's folder keeps its ``meta.json`` and the recording it was made from (``prompt.wav``, 16-bit).
"""

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import uuid
import wave
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from cosyapp.codec import wav
from cosyapp.errors import VoiceError, VoiceNotFoundError
from cosyapp.frontend.features import VoiceFeatures
from cosyapp.frontend.text import script_language
from cosyapp.frontend.voice_rules import check_prompt_text, sanitize_name
from cosyapp.models.cosyvoice2 import PromptInputs

if TYPE_CHECKING:  # decoding audio needs soundfile/librosa, which serving-only machines may lack
    from cosyapp.frontend.audio import AudioSource, PromptAudio
    from cosyapp.frontend.text import TextFrontend
    from cosyapp.frontend.voice import VoiceFrontend

log = logging.getLogger(__name__)
ASSETS_VOICES = Path(__file__).resolve().parents[2] / "assets" / "voices"
MAX_CACHED_FEATURES = 512  # feature files of recordings kept on disk (~50 KB each); saved voices' stay
PROMPT_FILE = "prompt.wav"


@dataclass(frozen=True)
class VoiceInfo:
    """What the speaker control lists about a voice."""

    id: str
    name: str
    kind: str  # "builtin", "model" or "user"
    language: str = ""
    note: str = ""
    shared: bool = True
    licence: str = ""


@dataclass(frozen=True)
class Voice:
    """A voice ready for synthesis: its features and the transcript of its prompt recording.

    ``prompt_ids`` is set instead of ``prompt_text`` for ``spk2info.pt`` speakers, which store ids.
    """

    info: VoiceInfo
    features: VoiceFeatures
    prompt_text: str = ""
    prompt_ids: tuple[int, ...] | None = None

    def prompt(self, text: "TextFrontend") -> PromptInputs:
        """The model inputs of this voice: its features plus its transcript's ids, normalised by the
        rules of its language when known (a recogniser's, kept with the voice)."""
        if self.prompt_ids is not None:
            return self.features.prompt(list(self.prompt_ids))
        return self.features.prompt(text.prompt_ids(self.prompt_text, self.info.language))


def audio_hash(audio: "PromptAudio") -> str:
    """Content hash of a decoded recording (samples and rate), independent of its file format."""
    digest = hashlib.sha256(str(audio.sample_rate).encode())
    digest.update(np.ascontiguousarray(audio.samples, dtype=np.float32).tobytes())
    return digest.hexdigest()


class VoiceLibrary:
    """Lists, loads and saves voices; thread-safe. ``features_computed`` counts real extractions.

    The lock guards only the feature cache's files and the map of extractions in flight: a
    recording's features are computed outside it, so one upload never delays another request's
    voice, and two requests for the same recording wait for one extraction.
    """

    def __init__(
        self,
        data_dir: Path,
        frontend: "VoiceFrontend",
        assets_dir: Path = ASSETS_VOICES,
        spk2info: Path | None = None,
        max_cached_features: int = MAX_CACHED_FEATURES,
    ):
        self.frontend = frontend
        self.max_cached_features = max_cached_features
        self.features_dir = data_dir / "features"
        self.user_dir = data_dir / "voices"
        self.features_dir.mkdir(parents=True, exist_ok=True)
        self.user_dir.mkdir(parents=True, exist_ok=True)
        self.features_computed = 0
        self._lock = threading.Lock()
        self._computing: dict[str, Future[VoiceFeatures]] = {}  # by content hash
        self._builtin = _read_builtin(assets_dir)
        # A built-in voice, once made: its file never changes while serving, and decoding it with its
        # features for every request took 1.1-4.8 ms of a handler thread. Shared as model speakers are.
        self._builtin_voices: dict[str, Voice] = {}
        self._model = _read_spk2info(spk2info) if spk2info and spk2info.is_file() else {}
        # Called with each saved voice's listing and owner (the voice previews queue it).
        self.on_saved: list[Callable[[VoiceInfo, str | None], None]] = []

    def features_of(self, audio: "PromptAudio") -> VoiceFeatures:
        """Features of a recording, computed once per distinct content and then read from the cache.

        Raises what the voice frontend raised, to every request waiting for that recording.
        """
        key = audio_hash(audio)
        path = self.features_dir / f"{key}.safetensors"
        with self._lock:
            if path.is_file():
                os.utime(path)  # recently used: evicted last
                return VoiceFeatures.load(path)
            computing = self._computing.get(key)
            first = computing is None
            if first:
                computing = self._computing[key] = Future()
        if not first:
            return computing.result()  # another request is extracting this recording
        try:
            features = self.frontend.features(audio)
        except BaseException as error:
            with self._lock:
                del self._computing[key]
            computing.set_exception(error)
            raise
        with self._lock:
            features.save(path)
            self.features_computed += 1
            self._evict_features()
            del self._computing[key]
        computing.set_result(features)
        return features

    def _evict_features(self) -> None:
        """Keep at most ``max_cached_features`` feature files, dropping the least recently used ones
        that no saved voice needs, so unsaved recordings cannot fill the disk."""
        files = sorted(self.features_dir.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        excess = len(files) - self.max_cached_features
        if excess <= 0:
            return
        saved = {meta["features"] for meta in self._user_metas()}
        for path in files[:-1]:  # never the file just written
            if excess <= 0:
                break
            if path.stem not in saved:
                path.unlink(missing_ok=True)
                excess -= 1

    def list_voices(self, session: str | None = None) -> list[VoiceInfo]:
        """Built-in voices, model speakers, shared user voices, and ``session``'s private voices."""
        users = [meta for meta in self._user_metas() if meta["shared"] or meta["owner"] == session]
        return (
            [info for info, _, _ in self._builtin.values()]
            + [voice.info for voice in self._model.values()]
            + [_user_info(meta) for meta in sorted(users, key=lambda m: m["name"].lower())]
        )

    def info(self, voice_id: str, owner: str | None = None) -> VoiceInfo:
        """The listing of ``voice_id`` as the browser keyed ``owner`` sees it (None: as the HTTP API
        does), without loading the voice. Raises ``VoiceNotFoundError``."""
        if voice_id in self._builtin:
            return self._builtin[voice_id][0]
        if voice_id in self._model:
            return self._model[voice_id].info
        return _user_info(self._visible_meta(voice_id, owner))

    def owned_ids(self, owner: str | None) -> set[str]:
        """The ids of the voices the browser keyed ``owner`` saved, shared or not (none without one)."""
        return set() if owner is None else {m["id"] for m in self._user_metas() if m["owner"] == owner}

    def owner_of(self, voice_id: str) -> str | None:
        """The owner of a saved voice (its saver's key; None: saved through the HTTP API); None for
        any other id."""
        meta = self._user_meta(voice_id)
        return None if meta is None else meta["owner"]

    def prompt_seconds(self, voice_id: str) -> float:
        """The length of a voice's prompt recording in seconds, read from the file's header (a model
        speaker's from its prompt tokens, 25 a second); 0.0 for a voice saved without its recording."""
        if voice_id in self._model:
            return len(self._model[voice_id].features.speech_tokens) / 25
        path = (
            self._builtin[voice_id][1]
            if voice_id in self._builtin
            else self.user_dir / voice_id / PROMPT_FILE
        )
        if path.suffix != ".wav" or not path.is_file():
            return 0.0
        with wave.open(str(path)) as reader:
            return reader.getnframes() / reader.getframerate()

    def get(self, voice_id: str, session: str | None = None) -> Voice:
        """The voice ``voice_id`` as ``session`` sees it. Raises ``VoiceNotFoundError``."""
        if voice_id in self._builtin:
            if (voice := self._builtin_voices.get(voice_id)) is None:
                from cosyapp.frontend.audio import load_prompt_audio

                info, audio_path, transcript = self._builtin[voice_id]
                voice = Voice(info, self.features_of(load_prompt_audio(audio_path)), prompt_text=transcript)
                self._builtin_voices[voice_id] = voice
            return voice
        if voice_id in self._model:
            return self._model[voice_id]
        meta = self._visible_meta(voice_id, session)
        features = VoiceFeatures.load(self.features_dir / f"{meta['features']}.safetensors")
        return Voice(_user_info(meta), features, prompt_text=meta["prompt_text"])

    def save(
        self,
        name: str,
        audio: "AudioSource",
        prompt_text: str,
        session: str | None,
        shared: bool = False,
        language: str = "",
    ) -> VoiceInfo:
        """Save a user voice from a recording and its transcript (in ``language``, when known, e.g.
        as the speech recogniser heard it; else the language its script is written for); returns
        its listing.

        The voice gets a random id; its folder is named after the id, never after ``name``.
        Raises ``VoiceError`` for an unusable recording, ``PromptTextError`` for a missing or
        mismatched transcript and ``ValueError`` for an empty name.
        """
        from cosyapp.frontend.audio import load_prompt_audio

        name = sanitize_name(name)
        recording = load_prompt_audio(audio)
        prompt_text = check_prompt_text(prompt_text, recording)
        self.features_of(recording)
        meta = {
            "id": f"user-{uuid.uuid4().hex[:12]}",
            "name": name,
            "prompt_text": prompt_text,
            "owner": session,  # a shared voice stays its saver's to delete
            "shared": shared,
            "features": audio_hash(recording),
            "language": language or script_language(prompt_text),
        }
        folder = self.user_dir / meta["id"]
        folder.mkdir()
        (folder / PROMPT_FILE).write_bytes(wav(recording.samples, recording.sample_rate))
        _write_meta(folder, meta)
        info = _user_info(meta)
        for listener in self.on_saved:
            listener(info, session)
        return info

    def update(
        self, voice_id: str, owner: str | None, name: str | None = None, shared: bool | None = None
    ) -> VoiceInfo:
        """Rename a voice saved by ``owner`` and/or share it or make it private again; returns its
        new listing. Raises ``VoiceNotFoundError`` for any other id, ``VoiceError`` for an empty name."""
        meta = self._user_meta(voice_id)
        if meta is None or owner is None or meta["owner"] != owner:
            raise VoiceNotFoundError(voice_id)
        if name is not None:
            meta["name"] = sanitize_name(name)
        if shared is not None:
            meta["shared"] = shared
        _write_meta(self.user_dir / voice_id, meta)
        return _user_info(meta)

    def delete(self, voice_id: str, session: str | None) -> None:
        """Remove a user voice saved by ``session``, or with ``session`` None (the HTTP API, behind its
        key) a shared one. Raises ``VoiceNotFoundError`` for any other id."""
        meta = self._user_meta(voice_id)
        if meta is None or not (meta["shared"] if session is None else meta["owner"] == session):
            raise VoiceNotFoundError(voice_id)
        folder = self.user_dir / voice_id
        (folder / "meta.json").unlink()  # unlisted at once, whatever happens to the rest
        shutil.rmtree(folder)

    def recording(self, voice_id: str, session: str | None = None) -> "PromptAudio":
        """The recording a voice was made from, as ``session`` sees it: a saved voice's prompt as it
        was used (prepared, 16-bit), a built-in voice's file. Raises ``VoiceNotFoundError`` for an
        unknown id and ``VoiceError`` for a model speaker, which comes without one."""
        from cosyapp.frontend.audio import load_prompt_audio

        if voice_id in self._builtin:
            return load_prompt_audio(self._builtin[voice_id][1])
        if voice_id in self._model:
            raise VoiceError(f"Voice {voice_id!r} comes from the model folder without its recording.")
        self._visible_meta(voice_id, session)
        path = self.user_dir / voice_id / PROMPT_FILE
        if not path.is_file():
            raise VoiceError(f"Voice {voice_id!r} was saved before recordings were kept with voices.")
        return load_prompt_audio(path)

    def _visible_meta(self, voice_id: str, owner: str | None) -> dict:
        """A saved voice's meta when the browser keyed ``owner`` may use it (shared, or its own);
        else raises ``VoiceNotFoundError``: one rule for loading, recordings and previews."""
        meta = self._user_meta(voice_id)
        if meta is None or not (meta["shared"] or meta["owner"] == owner):
            raise VoiceNotFoundError(voice_id)
        return meta

    def _user_meta(self, voice_id: str) -> dict | None:
        if not re.fullmatch(r"user-[0-9a-f]{12}", voice_id):
            return None
        path = self.user_dir / voice_id / "meta.json"
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None

    def _user_metas(self) -> list[dict]:
        return [
            json.loads(p.read_text(encoding="utf-8")) for p in sorted(self.user_dir.glob("user-*/meta.json"))
        ]


def _write_meta(folder: Path, meta: dict) -> None:
    tmp = folder / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, ensure_ascii=False, indent=1), encoding="utf-8")
    tmp.replace(folder / "meta.json")


def _user_info(meta: dict) -> VoiceInfo:
    note = "shared voice" if meta["shared"] else "your voice (only you see it)"
    return VoiceInfo(
        id=meta["id"],
        name=meta["name"],
        kind="user",
        language=meta.get("language", ""),  # voices saved before languages were kept have none
        note=note,
        shared=meta["shared"],
    )


def _read_builtin(assets_dir: Path) -> dict[str, tuple[VoiceInfo, Path, str]]:
    """Built-in voices: ``<id>.json`` (name, language, transcript, source, licence) beside its audio."""
    voices = {}
    for path in sorted(assets_dir.glob("*.json")):
        meta = json.loads(path.read_text(encoding="utf-8"))
        note = meta["source"] + (" (synthetic voice)" if meta.get("synthetic") else "")
        info = VoiceInfo(
            id=path.stem,
            name=meta["name"],
            kind="builtin",
            language=meta["language"],
            note=note,
            licence=meta.get("licence", ""),
        )
        voices[path.stem] = (info, assets_dir / meta["audio"], meta["transcript"])
    return voices


def _read_spk2info(path: Path) -> dict[str, Voice]:
    """Zero-shot speakers saved by upstream's ``add_zero_shot_spk``; entries without a prompt are skipped."""
    voices = {}
    for spk_id, entry in torch.load(path, map_location="cpu", weights_only=True).items():
        if "flow_prompt_speech_token" not in entry or "prompt_text" not in entry:
            # SFT-style entries carry no prompt, which CosyVoice 2's LM needs to imitate a voice.
            log.warning("spk2info.pt: speaker %r has no prompt tokens/text and is not offered", spk_id)
            continue
        features = VoiceFeatures(
            speech_tokens=entry["flow_prompt_speech_token"].reshape(-1).long(),
            speech_feat=entry["prompt_speech_feat"].reshape(-1, 80).float(),
            embedding=entry["flow_embedding"].reshape(-1).float(),
        )
        info = VoiceInfo(id=f"model-{spk_id}", name=str(spk_id), kind="model", note="from the model folder")
        voices[info.id] = Voice(info, features, prompt_ids=tuple(entry["prompt_text"].reshape(-1).tolist()))
    return voices

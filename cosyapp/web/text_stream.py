"""Text that arrives in pieces (an LLM's deltas) cut into sentences as soon as each is complete.

A sentence ends at a sentence mark (``. ? ! ; :`` and their CJK forms) that is followed by a space,
a line break or more text after a closing quote; CJK marks end it at once (no space follows them),
and so does a line break. A clause that runs past ``MAX_CLAUSE`` characters with no mark is cut at
its last space or comma, so speech starts even for text without punctuation. ``flush`` hands over
what is left (the caller's flush or end).
"""

import re

MAX_CLAUSE = 160
# ASCII marks need what follows (a space, a line break) to tell "3.5" or "e.g.x" from a sentence's end.
_END = re.compile(r"[.?!;:…]+[\"'”’)\]]*(?=\s)|[。？！；：]+[”’」』）]*|\n")
_BREAK = re.compile(r"[\s,，、]")


class SentenceCutter:
    """Collects text deltas; ``push`` returns the sentences they complete, in order."""

    def __init__(self) -> None:
        self._text = ""

    def push(self, delta: str) -> list[str]:
        """Add ``delta``; returns the sentences now complete (stripped, empty ones left out)."""
        self._text += delta
        sentences = []
        while (cut := self._cut()) is not None:
            sentence, self._text = self._text[:cut].strip(), self._text[cut:]
            if sentence:
                sentences.append(sentence)
        return sentences

    def flush(self) -> list[str]:
        """The text not yet handed over, as a last sentence (none if it is blank)."""
        rest, self._text = self._text.strip(), ""
        return [rest] if rest else []

    def _cut(self) -> int | None:
        end = _END.search(self._text)
        if end is not None and end.end() <= MAX_CLAUSE:
            return end.end()
        if len(self._text) <= MAX_CLAUSE:
            return None
        breaks = [m.end() for m in _BREAK.finditer(self._text, 0, MAX_CLAUSE)]
        return breaks[-1] if breaks and breaks[-1] > 1 else MAX_CLAUSE

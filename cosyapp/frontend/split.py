"""Sentence splitting of the TTS text (docs/model.md §3.1): cut after sentence marks, cut pieces
that run too long without one, merge into sentences of about 60-80 characters (Chinese) or tokens.

Upstream's ``split_paragraph``, plus the cut of long unmarked pieces so that no sentence (one LM
request) grows past MAX_SENTENCE_LEN however the text is written.
"""

import re
from collections.abc import Callable, Sequence

from cosyapp.frontend.tags import outside_tags

# split_paragraph as upstream calls it; lengths are characters for Chinese, tokens otherwise.
MAX_LEN = 80
MIN_LEN = 60
MERGE_LEN = 20
# Not upstream: a piece with no sentence mark for this long is cut at spaces or commas, so that no
# sentence (one LM request) grows past MAX_SENTENCE_LEN however the text is written.
MAX_PIECE_LEN = 2 * MAX_LEN
MAX_SENTENCE_LEN = MIN_LEN + MAX_PIECE_LEN + MERGE_LEN
ZH_MARKS = frozenset("。？！；：、.?!;")
EN_MARKS = frozenset(".?!;:")
CLOSING_QUOTES = ('"', "”")

_BREAK_AFTER = re.compile(r"(?<=[\s,，、])")


def split_paragraph(
    text: str, marks: frozenset[str], end_mark: str, length: Callable[[str], int]
) -> list[str]:
    """Upstream's ``split_paragraph``: cut ``text`` after sentence marks, then merge to ~60-80 length.

    ``end_mark`` is appended when ``text`` does not end with one of ``marks``; ``length`` measures a
    string (characters for Chinese, tokens otherwise). Returns [] for empty text.
    """
    if not text:
        return []
    if text[-1] not in marks:
        text += end_mark
    return merge_pieces(cut_long_pieces(cut_at_marks(text, marks), MAX_PIECE_LEN, length), length)


def cut_at_marks(text: str, marks: frozenset[str]) -> list[str]:
    """Pieces of ``text``, each ending with a mark, or with a closing quote that follows a mark.

    As upstream, a mark with no text since the previous cut is dropped; if a quote follows it, the
    quote still goes onto the previous piece. Text after the last mark is dropped (callers end the
    text with a mark).
    """
    pieces: list[str] = []
    start = 0
    for i, char in enumerate(text):
        if char not in marks:
            continue
        if i > start:
            pieces.append(text[start : i + 1])
        quote = text[i + 1 : i + 2]
        if quote in CLOSING_QUOTES:
            # Upstream fails when there is no previous piece (the text starts with a mark and a quote).
            if pieces:
                pieces[-1] += quote
            else:
                pieces.append(quote)
            start = i + 2
        else:
            start = i + 1
    return pieces


def cut_long_pieces(pieces: Sequence[str], limit: int, length: Callable[[str], int]) -> list[str]:
    """``pieces`` with each one longer than ``limit`` (as ``length`` measures) cut into parts.

    Cuts go after whitespace or commas, packing as many words into a part as fit; a word longer than
    ``limit`` on its own is cut between characters, never inside a fine-grained tag. Every part is at
    most ``limit`` long, or one tag longer than it (a character is at most 4 byte-level tokens, so
    ``limit`` must be at least 4). Nothing is added or lost.
    """
    assert limit >= 4, limit
    parts: list[str] = []
    for piece in pieces:
        if length(piece) <= limit:
            parts.append(piece)
            continue
        part = ""
        for word in _BREAK_AFTER.split(piece):
            if part and length(part + word) > limit:
                parts.append(part)
                part = ""
            while length(part + word) > limit:  # part is empty: one word longer than the limit
                n = len(word)
                while length(word[:n]) > limit:
                    n //= 2
                n = outside_tags(word, n)
                parts.append(word[:n])
                word = word[n:]
            part += word
        if part:
            parts.append(part)
    return parts


def merge_pieces(pieces: Sequence[str], length: Callable[[str], int]) -> list[str]:
    """Greedy merge of ``pieces`` into sentences.

    A sentence is closed when it is longer than ``MIN_LEN`` and adding the next piece would make it
    longer than ``MAX_LEN``. A tail shorter than ``MERGE_LEN`` is glued onto the last sentence.
    """
    sentences: list[str] = []
    buffer = ""
    for piece in pieces:
        if length(buffer + piece) > MAX_LEN and length(buffer) > MIN_LEN:
            sentences.append(buffer)
            buffer = ""
        buffer += piece
    if buffer and length(buffer) < MERGE_LEN and sentences:
        sentences[-1] += buffer
    elif buffer:
        sentences.append(buffer)
    return sentences


# Blocks: how much of a text is normalised at once, so the first sentence is ready long before the
# last one of a long text (wetext takes about 0.5 ms a character).
FIRST_BLOCK_CHARS = 300
BLOCK_CHARS = 1000
# Where a block may end in raw text: after an end mark, with closing quotes, where a sentence surely
# ends: an ASCII mark needs a space after it and then no lower-case letter (not "e.g. this", not
# "3.5"); CJK marks (Chinese text only) need nothing.
_ASCII_END = r'[.!?;]["”]?\s+(?=[^\sa-z])'
_CJK_END = r'[。！？；]["”]?\s*'
# Abbreviations and initials after which a full stop does not end a sentence.
_ABBREVIATION = re.compile(r"\b(?:Mr|Mrs|Ms|Dr|St|Jr|Sr|Prof|No|vs|[A-Za-z])\.[\"”]?\s+$")


def cut_blocks(
    text: str, chinese: bool, first: int = FIRST_BLOCK_CHARS, size: int = BLOCK_CHARS
) -> list[str]:
    """``text`` cut into consecutive blocks, each ending at the first sentence end past ``first``
    characters (then ``size``) from its start; text with no sentence end stays in one block.
    ``chinese`` also counts CJK end marks. Nothing is added or lost."""
    ends = re.compile(f"{_CJK_END}|{_ASCII_END}" if chinese else _ASCII_END)
    blocks: list[str] = []
    start, target = 0, first
    for end in ends.finditer(text):
        if (
            end.end() - start >= target
            and end.end() < len(text)
            and not _ABBREVIATION.search(text, 0, end.end())
        ):
            blocks.append(text[start : end.end()])
            start, target = end.end(), size
    blocks.append(text[start:])
    return [b for b in blocks if b]

"""CosyVoice 2's special text tokens: ``<|endofprompt|>`` and the 16 fine-grained tags.

The tags ([laughter], [breath], <strong>…</strong>, ...) are written inside the text to speak and are
tokens of their own in the tokenizer (docs/model.md §3.2). They must reach it whole: wetext never
sees them (it fails on English text with a tag beside a digit, and may rewrite what it does not know),
and a cut between characters never falls inside one. Anything else in brackets is plain text and is
spoken as written. Torch-free.
"""

import re

ENDOFPROMPT = "<|endofprompt|>"
# Upstream's order, which fixes their token ids (151647 onwards, after <|endofprompt|> at 151646).
TAGS = (
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)
_TAG = re.compile("(" + "|".join(re.escape(tag) for tag in TAGS) + ")")


def split_at_tags(text: str) -> list[str]:
    """``text`` as alternating parts: plain text at even indices, a tag at each odd index.

    Joined again they give ``text``; plain parts may be empty."""
    return _TAG.split(text)


def outside_tags(text: str, cut: int) -> int:
    """The cut position nearest below ``cut`` that does not fall inside a tag of ``text`` (the tag's
    start), or, when that would be 0, the tag's end: a cut always makes progress."""
    for tag in _TAG.finditer(text):
        if tag.start() < cut < tag.end():
            return tag.start() if tag.start() > 0 else tag.end()
    return cut

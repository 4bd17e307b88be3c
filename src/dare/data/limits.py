"""Refuse over-long text before it is tokenized.

A fast tokenizer needs a few hundred bytes of memory per character it encodes (offsets, pre-tokenized pieces), so
tokenizing a 60 MB field to find out that it is longer than ``max_length`` costs tens of GB. ``encode_within`` bounds
that work in two steps before the real encoding:

1. characters: no token covers more characters than the tokenizer's longest token string, so a text longer than
   ``limit x longest`` cannot fit in ``limit`` tokens (checked without tokenizing anything);
2. a bounded tokenisation: the first ``limit x PREFIX_CHARS_PER_TOKEN`` characters (cut at a whitespace, where
   tokenizers split words, so the prefix has no more tokens than the whole) are encoded; over ``limit`` tokens
   there already means over ``limit`` for the whole text.

Only a text that passes both is encoded in full, so the largest text ever tokenized is ``limit x longest`` characters.
"""
from __future__ import annotations

import weakref
from typing import Optional

from .schema import DataError

# Characters of the prefix encoded per allowed token: natural text averages 3-5 per token, so a text that fits
# is almost never refused by the prefix step alone (and when it passes, the full encoding decides).
PREFIX_CHARS_PER_TOKEN = 8
# Used when a tokenizer does not list its vocabulary (the character check then uses this per-token bound).
UNKNOWN_LONGEST_TOKEN = 256

_longest_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer) -> int:
    """Length of the tokenizer's longest vocabulary string (special and added tokens included). A byte-level BPE
    token string has one character per byte, so this bounds the characters of text any one token covers."""
    try:
        return _longest_cache[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=0) or UNKNOWN_LONGEST_TOKEN
    except (AttributeError, NotImplementedError, TypeError):
        longest = UNKNOWN_LONGEST_TOKEN
    try:
        _longest_cache[tokenizer] = longest
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return longest


def check_characters(tokenizer, text: str, limit: int, what: str, limit_text: str) -> None:
    """Step 1 alone: a ``DataError`` when ``text`` has more characters than ``limit`` tokens can cover."""
    longest = longest_token_chars(tokenizer)
    if len(text) > limit * longest:
        raise DataError(f"{what} has {len(text):,} characters: over {limit_text} tokens even at {longest} "
                        f"characters per token (the tokenizer's longest)")


def encode_within(tokenizer, text: str, limit: Optional[int], what: str, limit_text: str,
                  add_special_tokens: bool) -> list[int]:
    """``tokenizer(text)["input_ids"]``, unless ``text`` certainly needs more than ``limit`` tokens: then a
    ``DataError`` ``"<what> ...: over <limit_text>"`` raised before the full encoding (``limit=None``: no bound)."""
    if limit is not None:
        check_characters(tokenizer, text, limit, what, limit_text)
        prefix_chars = limit * PREFIX_CHARS_PER_TOKEN
        if len(text) > prefix_chars:
            cut = max(text.rfind(" ", 0, prefix_chars), text.rfind("\n", 0, prefix_chars))
            prefix = text[:cut if cut > 0 else prefix_chars]
            count = len(tokenizer(prefix, add_special_tokens=add_special_tokens)["input_ids"])
            if count > limit:
                raise DataError(f"{what} has {len(text):,} characters, and its first {len(prefix):,} alone are "
                                f"{count} tokens: over {limit_text}")
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

"""Final-answer extraction from model completions (math tasks).

Order, first hit wins (documented in docs/rewards.md):
  1. the last ``<answer>...</answer>`` block (an unclosed trailing ``<answer>`` counts: diffusion
     samplers often cut the closing tag); a ``\\boxed{}`` inside it is preferred to its raw text;
  2. the last balanced ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces) anywhere;
  3. the text after the last ``####`` (GSM8K's gold format), up to the end of that line;
  4. only when asked (GSM8K): the last number in the completion.
"""
from __future__ import annotations

import re
from typing import Optional

_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"
_BOX_COMMANDS = ("\\boxed", "\\fbox")
# A number as written in word problems: optional sign, thousands commas, decimals.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


_BARE_TOKEN = re.compile(r"[^\s$]+")
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def boxed_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of the contents of every balanced ``\\boxed{...}`` / ``\\fbox{...}`` (and ``\\boxed 5``),
    ordered by where the box starts. One pass over the text with a stack of open braces, so 20,000 unclosed
    ``\\boxed{`` cost as much as reading them (scanning each box to the end separately was quadratic)."""
    found: list[tuple[int, int, int]] = []  # (box position, content start, content end)
    box_at: dict[int, int] = {}  # index of a box's opening brace -> the box's position
    for match in _BOX.finditer(text):
        after = match.end()
        skip = 0
        while after + skip < len(text) and text[after + skip] == " ":
            skip += 1
        brace = after + skip
        if brace < len(text) and text[brace] == "{":
            box_at[brace] = match.start()
        elif skip and brace < len(text):
            # "\boxed 5": the argument is the next token.
            token = _BARE_TOKEN.match(text, brace)
            if token:
                found.append((match.start(), token.start(), token.end()))
    if box_at:
        stack: list[int] = []
        i, n = 0, len(text)
        while i < n:
            ch = text[i]
            if ch == "\\":
                i += 2  # an escaped character ("\{" is a literal brace, as in sets \{1, 2\})
                continue
            if ch == "{":
                stack.append(i)
            elif ch == "}" and stack:
                opened = stack.pop()
                if opened in box_at:
                    found.append((box_at[opened], opened + 1, i))
            i += 1
    return [(start, end) for _, start, end in sorted(found)]


def boxed_contents(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{...}`` / ``\\fbox{...}`` (and ``\\boxed 5``) in order."""
    return [text[start:end] for start, end in boxed_spans(text)]


def last_boxed(text: str) -> Optional[str]:
    """Content of the last balanced box, or None; an empty box counts as no answer."""
    for start, end in reversed(boxed_spans(text)):
        content = text[start:end].strip()
        if content:
            return content
    return None


def last_answer_block(text: str) -> Optional[str]:
    """Content of the last ``<answer>`` block; a trailing unclosed block runs to the end."""
    start = text.rfind(_ANSWER_OPEN)
    if start == -1:
        return None
    body = text[start + len(_ANSWER_OPEN):]
    end = body.find(_ANSWER_CLOSE)
    return body if end == -1 else body[:end]


def after_hashes(text: str) -> Optional[str]:
    """Text after the last ``####`` up to the end of its line (GSM8K answer format)."""
    pos = text.rfind("####")
    if pos == -1:
        return None
    line = text[pos + 4:].strip().split("\n", 1)[0].strip()
    return line or None


def last_number(text: str) -> Optional[str]:
    """The last number in ``text`` with thousands commas removed (``"1,000.5"`` -> ``"1000.5"``)."""
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def extract_answer(text: str, *, allow_last_number: bool = False) -> Optional[str]:
    """The final answer string of a completion (see the module docstring for the order), or None."""
    block = last_answer_block(text)
    if block is not None:
        boxed = last_boxed(block)
        if boxed is not None:
            return boxed
        hashed = after_hashes(block)
        if hashed is not None:
            return hashed
        if block.strip():
            return block.strip()
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    hashed = after_hashes(text)
    if hashed is not None:
        return hashed
    if allow_last_number:
        return last_number(text)
    return None

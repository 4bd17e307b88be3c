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


def _braced(text: str, start: int) -> Optional[tuple[str, int]]:
    """Content of the ``{...}`` group opening at ``text[start]`` and the index after it, or None if
    the braces never balance (a truncated generation)."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # an escaped character ("\{" is a literal brace, as in sets \{1, 2\})
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1:i], i + 1
        i += 1
    return None


def boxed_contents(text: str) -> list[str]:
    """Contents of every balanced ``\\boxed{...}`` / ``\\fbox{...}`` (and ``\\boxed 5``) in order."""
    found: list[tuple[int, str]] = []
    for command in _BOX_COMMANDS:
        pos = text.find(command)
        while pos != -1:
            after = pos + len(command)
            # "\boxedx" is another command, not a box; "\boxed {x}" with spaces is fine.
            rest = text[after:]
            stripped = rest.lstrip(" ")
            skip = len(rest) - len(stripped)
            if stripped.startswith("{"):
                group = _braced(text, after + skip)
                if group is not None:
                    found.append((pos, group[0]))
            elif skip and stripped:
                # "\boxed 5": the argument is the next token.
                token = re.match(r"[^\s$]+", stripped)
                if token:
                    found.append((pos, token.group(0)))
            pos = text.find(command, after)
    return [content for _, content in sorted(found)]


def last_boxed(text: str) -> Optional[str]:
    """Content of the last balanced box, or None; an empty box counts as no answer."""
    boxes = [b for b in boxed_contents(text) if b.strip()]
    return boxes[-1].strip() if boxes else None


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

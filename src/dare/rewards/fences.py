"""Fenced code blocks of a completion, found in one pass (the code reward's extraction, ``code_reward.extract_code``).

The regex this replaces (```` ```[ \\t]*(tag)[^\\n]*\\n(.*?)(?:```|\\Z) ```` with DOTALL) retried a fence at every run of
backticks: 96 KB of backticks took 5.35 s in the trainer's thread, ``"```" * 64000`` 13-16 s (issue 41). Here each
character is read a bounded number of times; the blocks found are the regex's, block for block (tested on random
texts of fence-like pieces).
"""
from __future__ import annotations

import re

_TAG = re.compile(r"[ \t]*([A-Za-z0-9_+-]*)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language tag, body) of each fenced block, in order. A fence is three backticks and the rest of their line (the
    tag: its first run of letters, digits and ``_+-`` after blanks); the body runs to the next three backticks or to
    the end (the unclosed fence of a truncated generation). Backticks with no newline after them open no fence, and
    then neither can any later ones: the search stops."""
    out, i = [], 0
    while True:
        start = text.find("```", i)
        if start < 0:
            return out
        line_end = text.find("\n", start + 3)
        if line_end < 0:
            return out
        tag = _TAG.match(text, start + 3, line_end).group(1)
        close = text.find("```", line_end + 1)
        if close < 0:
            out.append((tag, text[line_end + 1:]))
            return out
        out.append((tag, text[line_end + 1:close]))
        i = close + 3


def defines(code: str, name: str) -> bool:
    r"""Whether a line of ``code`` starts (after blanks) a ``def`` or ``async def`` of ``name``: the old
    ``^\s*(?:async\s+)?def\s+name\s*\(`` with its leading ``\s*`` kept off newlines. It matches where the old one
    did (a match that ran over newlines also matches from the line after the last of them), without rescanning a run
    of blank lines from every line start in it (quadratic)."""
    return re.search(rf"^[^\S\n]*(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None

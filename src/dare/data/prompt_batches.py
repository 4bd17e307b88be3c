"""``build_prompts`` in chunks: a chunk's prompts are rendered and checked one by one, then tokenized in one call.

A fast tokenizer's per-call overhead (Python around the Rust encoder) is most of the cost of encoding a short prompt:
the bundled Sudoku train split (20,000 prompts) took 4.7 s to build one prompt at a time, 3.0 s of it in 20,000
tokenizer calls, and every RL run on it builds it at the start (``dare quickstart``, ``dare compare``, the RL
benchmark). One call per chunk encodes the same ids (a fast tokenizer's batch is its single encode per text).

The result is the per-row build's, row for row and error for error: a chunk is batched only when every row of it
renders, passes the character bound of ``dare.data.limits`` and is short enough that ``encode_within`` would encode it
whole at once; any other chunk (a row that raises, or a long row that needs the bounded prefix encoding) is built row
by row, in order, exactly as before. The length checks after encoding run in row order in both paths, so the first
bad row is the one ``on_bad_row: error`` names.
"""
from __future__ import annotations

from typing import Optional

from .limits import PREFIX_CHARS_PER_TOKEN, check_characters
from .schema import BadRowPolicy, DataError

CHUNK = 512  # prompts per tokenizer call


def batches_well(tokenizer) -> bool:
    """A transformers fast tokenizer: ``tokenizer(texts)`` encodes each text as ``tokenizer(text)`` does."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(tokenizer, PreTrainedTokenizerBase) and bool(getattr(tokenizer, "is_fast", False))


def build_prompts_in_chunks(examples: list[dict], tokenizer, cfg, budget=None, chunk: Optional[int] = CHUNK) -> list:
    """``dare.data.prompts.build_prompts`` (same arguments, same result); ``chunk=None`` builds row by row."""
    from .prompts import get_template, uses_chat_template
    tpl = get_template(cfg.template)
    chat = uses_chat_template(tokenizer, tpl, cfg.chat_template)
    policy = BadRowPolicy(cfg.on_bad_row, what="prompt")
    batched = chunk is not None and chunk > 0 and batches_well(tokenizer)
    out: list = []
    step = chunk if batched else max(len(examples), 1)
    for start in range(0, len(examples), step):
        rows = examples[start:start + step]
        ready = _rendered(rows, tokenizer, cfg, budget, tpl) if batched else None
        if ready is None:
            for ex in rows:
                _one_row(ex, tokenizer, cfg, budget, tpl, chat, policy, out)
            continue
        ids = tokenizer([text for text, _ in ready], add_special_tokens=not chat)["input_ids"]
        for ex, (text, bound), row_ids in zip(rows, ready, ids):
            try:
                _check_length(ex, row_ids, cfg, budget)
            except DataError as e:
                policy.handle(e)
                continue
            out.append(_prompted(ex, text, list(row_ids)))
    policy.summary(cfg.describe())
    return out


def _prompted(ex, text, ids):
    from .prompts import PromptedExample
    return PromptedExample(ex, text, ids)


def _render(ex, tokenizer, cfg, tpl) -> str:
    from .prompts import render_prompt
    return render_prompt(ex, tpl, tokenizer, cfg.system_prompt, cfg.chat_template, cfg.generation_prefix)


def _rendered(rows, tokenizer, cfg, budget, tpl) -> Optional[list[tuple[str, Optional[int]]]]:
    """[(text, token bound)] of every row, or None when a row raises or needs ``encode_within``'s prefix step (the
    chunk is then built row by row, which raises or refuses it in its place)."""
    from .prompts import _prompt_bound
    out = []
    for ex in rows:
        try:
            text = _render(ex, tokenizer, cfg, tpl)
            bound, what, limit_text = _prompt_bound(cfg, budget, ex)
            if bound is not None:
                check_characters(tokenizer, text, bound, what, limit_text)
                if len(text) > bound * PREFIX_CHARS_PER_TOKEN:
                    return None
        except Exception:  # noqa: BLE001 - the row-by-row build raises it again, in order
            return None
        out.append((text, bound))
    return out


def _check_length(ex, ids, cfg, budget) -> None:
    if cfg.max_prompt_tokens is not None and len(ids) > cfg.max_prompt_tokens:
        raise DataError(f"example {ex['id']} (row {ex.get('index')}): prompt has {len(ids)} tokens, "
                        f"over max_prompt_tokens={cfg.max_prompt_tokens}")
    if budget is not None and len(ids) > budget.tokens:
        raise DataError(f"example {ex['id']} (row {ex.get('index')}): prompt has {len(ids)} tokens, but "
                        f"{budget.reason} (shorten it, or on_bad_row: skip)")


def _one_row(ex, tokenizer, cfg, budget, tpl, chat, policy, out) -> None:
    """One prompt as the per-row build makes it: render, bounded encode, length checks; a ``DataError`` follows the
    row policy."""
    from .prompts import _prompt_bound, encode_prompt
    try:
        text = _render(ex, tokenizer, cfg, tpl)
        ids = encode_prompt(text, tokenizer, chat, *_prompt_bound(cfg, budget, ex))
        _check_length(ex, ids, cfg, budget)
    except DataError as e:
        policy.handle(e)
        return
    out.append(_prompted(ex, text, ids))

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


def batches_well(tokenizer) -> bool:
    """A transformers fast tokenizer: ``tokenizer(texts)`` encodes each text as ``tokenizer(text)`` does."""
    try:
        from transformers import PreTrainedTokenizerBase
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(tokenizer, PreTrainedTokenizerBase) and bool(getattr(tokenizer, "is_fast", False))


def build_in_chunks(examples: list[dict], tokenizer, cfg, budget, chunk: Optional[int], pieces) -> list:
    """``dare.data.prompts.build_prompts``'s work; ``pieces`` holds its per-row functions (``render_prompt``,
    ``encode_prompt``, ``_prompt_bound``, ``uses_chat_template``, ``get_template``, ``PromptedExample``), handed in so
    that this module imports nothing back. ``chunk=None`` (or a tokenizer that does not batch) builds row by row."""
    return _Build(pieces, examples, tokenizer, cfg, budget).run(chunk)


class _Build:
    def __init__(self, prompts, examples, tokenizer, cfg, budget):
        self.p, self.examples, self.tokenizer, self.cfg, self.budget = prompts, examples, tokenizer, cfg, budget
        self.tpl = prompts.get_template(cfg.template)
        self.chat = prompts.uses_chat_template(tokenizer, self.tpl, cfg.chat_template)
        self.policy = BadRowPolicy(cfg.on_bad_row, what="prompt")

    def run(self, chunk: Optional[int]) -> list:
        batched = chunk is not None and chunk > 0 and batches_well(self.tokenizer)
        out: list = []
        step = chunk if batched else max(len(self.examples), 1)
        for start in range(0, len(self.examples), step):
            rows = self.examples[start:start + step]
            ready = self._rendered(rows) if batched else None
            if ready is None:
                for ex in rows:
                    self._one_row(ex, out)
                continue
            ids = self.tokenizer(ready, add_special_tokens=not self.chat)["input_ids"]
            for ex, text, row_ids in zip(rows, ready, ids):
                try:
                    self._check_length(ex, row_ids)
                except DataError as e:
                    self.policy.handle(e)
                    continue
                out.append(self.p.PromptedExample(ex, text, list(row_ids)))
        self.policy.summary(self.cfg.describe())
        return out

    def _render(self, ex) -> str:
        c = self.cfg
        return self.p.render_prompt(ex, self.tpl, self.tokenizer, c.system_prompt, c.chat_template, c.generation_prefix)

    def _rendered(self, rows) -> Optional[list[str]]:
        """Every row's text, or None when a row raises or needs ``encode_within``'s prefix step (the chunk is then
        built row by row, which raises or refuses it in its place)."""
        out = []
        for ex in rows:
            try:
                text = self._render(ex)
                bound, what, limit_text = self.p._prompt_bound(self.cfg, self.budget, ex)
                if bound is not None:
                    check_characters(self.tokenizer, text, bound, what, limit_text)
                    if len(text) > bound * PREFIX_CHARS_PER_TOKEN:
                        return None
            except Exception:  # noqa: BLE001 - the row-by-row build raises it again, in order
                return None
            out.append(text)
        return out

    def _check_length(self, ex, ids) -> None:
        cfg, budget = self.cfg, self.budget
        if cfg.max_prompt_tokens is not None and len(ids) > cfg.max_prompt_tokens:
            raise DataError(f"example {ex['id']} (row {ex.get('index')}): prompt has {len(ids)} tokens, "
                            f"over max_prompt_tokens={cfg.max_prompt_tokens}")
        if budget is not None and len(ids) > budget.tokens:
            raise DataError(f"example {ex['id']} (row {ex.get('index')}): prompt has {len(ids)} tokens, but "
                            f"{budget.reason} (shorten it, or on_bad_row: skip)")

    def _one_row(self, ex, out) -> None:
        """One prompt as the per-row build makes it: render, bounded encode, length checks; a ``DataError`` follows
        the row policy."""
        try:
            text = self._render(ex)
            bound = self.p._prompt_bound(self.cfg, self.budget, ex)
            ids = self.p.encode_prompt(text, self.tokenizer, self.chat, *bound)
            self._check_length(ex, ids)
        except DataError as e:
            self.policy.handle(e)
            return
        out.append(self.p.PromptedExample(ex, text, ids))

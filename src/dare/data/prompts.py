"""Examples -> prompt text / token ids (through the tokenizer's chat template when it has one), SFT pairs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .config import DataConfig
from .limits import encode_within
from .templates import Prompt, Template, get_template


def uses_chat_template(tokenizer, template, mode: str = "auto") -> bool:
    """Whether prompts of ``template`` go through ``tokenizer``'s chat template under ``chat_template: mode``."""
    template = get_template(template)
    has = tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))
    if mode == "always":
        if not has:
            raise ValueError("chat_template: always, but the tokenizer has no chat template")
        return True
    return mode == "auto" and template.chat and has


_uses_chat = uses_chat_template  # older name, kept for callers


def render(prompt: Prompt, tokenizer=None, template: Optional[Template] = None, chat_template: str = "auto") -> str:
    """Prompt text: ``apply_chat_template(..., add_generation_prompt=True)`` + generation prefix, or the plain text."""
    if chat_template not in ("auto", "always", "never"):
        raise ValueError(f"chat_template must be auto, always or never, got {chat_template!r}")
    if uses_chat_template(tokenizer, template or get_template("reasoning"), chat_template):
        text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        return text + prompt.generation_prefix
    return prompt.plain_text()


def _prefix_override(prompt: Prompt, generation_prefix: Optional[str]) -> Prompt:
    if generation_prefix is None:
        return prompt
    plain = prompt.plain
    return Prompt(prompt.messages, generation_prefix, plain)


def render_prompt(example: dict, template="reasoning", tokenizer=None, system_prompt: Optional[str] = None,
                  chat_template: str = "auto", generation_prefix: Optional[str] = None) -> str:
    tpl = get_template(template)
    prompt = _prefix_override(tpl.build(example, system_prompt), generation_prefix)
    return render(prompt, tokenizer, tpl, chat_template)


def encode_prompt(text: str, tokenizer, chat_rendered: bool, max_tokens: Optional[int] = None, what: str = "prompt",
                  limit_text: str = "") -> list[int]:
    """The prompt's ids; with ``max_tokens``, a text that certainly has more is a ``DataError`` raised before it is
    tokenized (``dare.data.limits``), so a huge row cannot exhaust memory."""
    # A chat template already wrote any BOS it wants; a plain prompt gets the tokenizer's own specials.
    return encode_within(tokenizer, text, max_tokens, what, limit_text or f"{max_tokens}", add_special_tokens=not chat_rendered)


def build_sft_example(example: dict, template="reasoning", tokenizer=None, system_prompt: Optional[str] = None,
                      chat_template: str = "auto", generation_prefix: Optional[str] = None) -> tuple[str, str]:
    """(prompt_text, completion_text) with a gold completion in the template's answer format.

    Countdown gold answers are found by brute force over the numbers and + - * /; sudoku answers are the
    solution string; math answers are ``\\boxed{gold}`` after the worked solution when the row has one.
    The trainer appends EOS after ``completion_text``.
    """
    tpl = get_template(template)
    prompt = _prefix_override(tpl.build(example, system_prompt), generation_prefix)
    return render(prompt, tokenizer, tpl, chat_template), tpl.gold_completion(example, prompt.generation_prefix)


@dataclass(frozen=True)
class PromptBudget:
    """The longest prompt a model can take with ``gen_length`` tokens to generate (its positions minus those)."""
    tokens: int
    reason: str

    @staticmethod
    def for_model(model, gen_length: int, what: str = "gen_length") -> Optional["PromptBudget"]:
        """None when the model's config names no position limit; an error when ``gen_length`` alone exceeds it."""
        cfg = getattr(model, "hf_config", None) or {}
        positions = cfg.get("max_position_embeddings") or cfg.get("max_sequence_length")
        if not positions:
            return None
        if gen_length >= positions:
            raise ValueError(f"{what}={gen_length} leaves no room for a prompt in the model's {positions} positions")
        return PromptBudget(positions - gen_length, f"the model has {positions} positions and {what}={gen_length} "
                                                    f"leaves {positions - gen_length} for the prompt")


@dataclass
class PromptedExample:
    example: dict
    text: str
    input_ids: list[int]


def _prompt_bound(cfg: DataConfig, budget: Optional[PromptBudget], ex: dict) -> tuple[Optional[int], str, str]:
    """(token bound, what, limit text) that ``encode_prompt`` refuses a prompt over before tokenizing it."""
    limits = []
    if cfg.max_prompt_tokens is not None:
        limits.append((cfg.max_prompt_tokens, f"max_prompt_tokens={cfg.max_prompt_tokens}"))
    if budget is not None:
        limits.append((budget.tokens, f"the prompt budget ({budget.reason})"))
    tokens, text = min(limits) if limits else (None, "")
    return tokens, f"example {ex['id']} (row {ex.get('index')}): prompt", text


def build_prompts(examples: list[dict], tokenizer, cfg: DataConfig, budget: Optional[PromptBudget] = None,
                  chunk: Optional[int] = 512) -> list[PromptedExample]:
    """Render and tokenize every example; prompts over ``max_prompt_tokens`` or the model's ``budget`` follow
    ``on_bad_row`` (an error naming the row, or skipped). A fast tokenizer encodes ``chunk`` prompts per call
    (``dare.data.prompt_batches``: the same ids and the same errors, in row order); ``chunk=None``: one per call."""
    from types import SimpleNamespace

    from .prompt_batches import build_in_chunks
    pieces = SimpleNamespace(get_template=get_template, uses_chat_template=uses_chat_template,
                             render_prompt=render_prompt, encode_prompt=encode_prompt, _prompt_bound=_prompt_bound,
                             PromptedExample=PromptedExample)
    return build_in_chunks(examples, tokenizer, cfg, budget, chunk, pieces)

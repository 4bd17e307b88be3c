"""``dare generate``: decode prompts with any supported model and print the completions, nfe and tokens/s.

Every ``SamplerConfig`` field is a flag (``--gen-length 64 --block-length 8 --cache dual --threshold 0.9``);
flags that are not given keep the dataclass defaults. Prompts are text (``--prompt``, tokenised with the
checkpoint's tokenizer, optionally through its chat template with ``--chat``) or token ids (``--prompt-ids``,
no tokenizer needed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
import typing

NAME = "generate"
HELP = "decode prompts with a diffusion LM (all sampler options as flags); prints completions, nfe and tokens/s"
log = logging.getLogger(__name__)


def _ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def _finite(text: str) -> float:
    """A float flag's value: a number, not nan or inf (``--temperature nan`` would decode garbage silently)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _sampler_flags(p) -> None:
    from dare.rollout.config import CACHES, SCHEDULES, SamplerConfig
    from dare.rollout.selection import REMASKINGS
    choices = {"remasking": tuple(REMASKINGS), "cache": CACHES, "schedule": SCHEDULES}
    g = p.add_argument_group("sampler (dare.rollout.SamplerConfig fields; unset = the dataclass default)")
    hints = typing.get_type_hints(SamplerConfig)
    for f in dataclasses.fields(SamplerConfig):
        flag = "--" + f.name.replace("_", "-")
        tp = hints[f.name]
        args = [t for t in typing.get_args(tp) if t is not type(None)] or [tp]
        base = args[0]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if base is bool:
            g.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=f"(default {default})")
        elif typing.get_origin(base) is list:
            g.add_argument(flag, dest=f.name, type=_ids, default=None, help="comma-separated ids (default: the model's)")
        else:
            g.add_argument(flag, dest=f.name, type=_finite if base is float else base, default=None,
                           choices=choices.get(f.name), help=f"(default {default})")


def add_arguments(p):
    p.add_argument("--model", required=True, help="checkpoint folder, Hugging Face id, or tiny:<family>")
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], type=_ids, help="prompt token ids, e.g. 1,2,3 (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap text prompts in the tokenizer's chat template")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model folder)")
    p.add_argument("--mask-token-id", type=int, default=None, help="mask id for configs that carry none")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (per prompt: derived from it)")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--json", action="store_true", help="print one machine-readable JSON object")
    _sampler_flags(p)


def _load(args, need_tokenizer: bool):
    """(model, tokenizer or None): text prompts need the tokenizer; token-id prompts load one only if it is there."""
    from dare.models.model_spec import load_model_spec, resolve_device

    return load_model_spec(args.model, dtype=args.dtype, device=resolve_device(args.device),
                           mask_token_id=args.mask_token_id, tokenizer=args.tokenizer,
                           tokenizer_required=need_tokenizer)


def _encode(tok, text: str, chat: bool) -> list[int]:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
        try:
            what = "byte(s) " + text[e.start:e.end].encode("utf-8", "surrogateescape").hex(" ")
        except UnicodeEncodeError:  # a lone surrogate passed from Python, not from argv's bytes
            what = "character(s) " + ascii(text[e.start:e.end])
        raise ValueError(f"--prompt is not valid UTF-8 text ({what} at character {e.start})") from None
    if chat:
        if getattr(tok, "chat_template", None) is None:
            raise ValueError("--chat needs a tokenizer with a chat template")
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)
    return tok(text, add_special_tokens=False)["input_ids"]


def _check_prompts(model, prompts: list, config) -> None:
    """One-line errors for token ids the model has no embedding for and prompts longer than its positions allow."""
    from dare.data.prompts import PromptBudget

    vocab = model.arch.vocab_size
    budget = PromptBudget.for_model(model, config.gen_length, "--gen-length")
    for i, ids in enumerate(prompts):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {i}: token id(s) {bad[:5]} outside the model's vocabulary [0, {vocab})")
        if budget is not None and len(ids) > budget.tokens:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, but {budget.reason}")


def run(args) -> int:
    import torch

    from dare.rollout import SamplerConfig, generate

    if not args.prompt and not args.prompt_ids:
        raise ValueError("give at least one --prompt TEXT or --prompt-ids 1,2,3")
    if args.chat and not args.prompt:
        raise ValueError("--chat applies to text prompts (--prompt)")
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplerConfig) if getattr(args, f.name) is not None}
    from dare.models.decoding import read_decoding, sampler_defaults
    # the checkpoint's own decoding settings (dare_decoding.json), flags first
    own = read_decoding(args.model, {f.name for f in dataclasses.fields(SamplerConfig)})
    if own is not None:
        block, path = own
        taken = sampler_defaults(block.get("sampler", {}), overrides)
        if taken:
            log.info("decoding settings from %s: %s (flags override them)", path,
                     ", ".join(f"{k}={v}" for k, v in taken.items()))
        overrides = {**taken, **overrides}
    config = SamplerConfig(**overrides)
    model, tok = _load(args, need_tokenizer=bool(args.prompt))
    prompts = [_encode(tok, t, args.chat) for t in args.prompt] + list(args.prompt_ids)
    _check_prompts(model, prompts, config)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = generate(model, prompts, config, n=args.n, generator=torch.Generator().manual_seed(args.seed))
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    from dare.eval.speed import rollout_speed

    tokens = int(r.completion_mask.sum())
    valid, row_nfe = rollout_speed(r)
    texts = r.texts(tok) if tok is not None else None
    rows = []
    for i in range(r.completion_ids.shape[0]):
        n_tok = int(r.completion_mask[i].sum())
        rows.append({"prompt_index": int(r.prompt_index[i]), "sample": int(r.sample_index[i]),
                     "ids": r.completion_ids[i, :n_tok].tolist(), "text": texts[i] if texts is not None else None,
                     "num_tokens": n_tok, "valid_tokens": valid[i], "steps": int(r.num_steps[i]), "nfe": row_nfe[i],
                     "tpf": round(valid[i] / row_nfe[i], 4) if row_nfe[i] else None})
    # nfe: batched forwards of this call; nfe_per_sample / tpf: each sample's own forwards (docs/eval.md).
    summary = {"nfe": r.nfe, "nfe_per_sample": round(sum(row_nfe) / len(row_nfe), 3), "tokens": tokens,
               "valid_tokens": sum(valid), "tpf": round(sum(valid) / sum(row_nfe), 4) if sum(row_nfe) else None,
               "seconds": round(seconds, 4), "tokens_per_second": round(sum(valid) / seconds, 2) if seconds > 0 else None,
               "model": args.model, "family": model.family, "device": str(model.device),
               "config": dataclasses.asdict(config)}
    if args.json:
        print(json.dumps({"completions": rows, **summary}))
        return 0
    for row in rows:
        head = f"[prompt {row['prompt_index']} sample {row['sample']}]"
        print(f"{head} {row['text'] if row['text'] is not None else ','.join(map(str, row['ids']))}")
    print(f"nfe={r.nfe} nfe/sample={summary['nfe_per_sample']} valid_tokens={summary['valid_tokens']} "
          f"tpf={summary['tpf']} seconds={seconds:.3f} tokens/s={summary['tokens_per_second']}")
    return 0

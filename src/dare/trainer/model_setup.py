"""Build the policy (checkpoint folder, hub id or ``tiny:<family>``) and export the trained model in the family's
own Hugging Face layout (LoRA merged), FSDP-aware."""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..models import load_model
from ..models.families import get_family
from ..models.builder import build_model
from ..models.loading import parse_dtype
from ..models.lora import apply_lora, has_lora, merge_lora

log = logging.getLogger(__name__)

TINY_PREFIX = "tiny:"


def load_policy(model_cfg):
    """(model, tokenizer) for ``model.path``; ``tiny:<family>`` builds a random tiny model with the tiny tokenizer."""
    from ..models.tokenizer import load_tokenizer, tiny_tokenizer
    from ..models.tiny_model import tiny

    dtype = parse_dtype(model_cfg.dtype)
    if model_cfg.path.startswith(TINY_PREFIX):
        family = model_cfg.path[len(TINY_PREFIX):]
        tok = tiny_tokenizer()
        model = tiny(family, tokenizer=tok, seed=model_cfg.tiny_seed, dtype=dtype or torch.float32, **model_cfg.tiny_sizes)
        model.set_attn_backend(model_cfg.attn_backend)
        model.name_or_path = model_cfg.path
        return model, tok
    if model_cfg.tiny_sizes:
        raise ValueError("model.tiny_sizes only applies to model.path: tiny:<family>")
    model = load_model(model_cfg.path, dtype=dtype, attn_backend=model_cfg.attn_backend, mask_token_id=model_cfg.mask_token_id)
    # "tiny": the character tokenizer (test checkpoints such as tests/assets/fixtures/* ship no tokenizer).
    tok = tiny_tokenizer() if model_cfg.tokenizer == "tiny" else load_tokenizer(model_cfg.tokenizer or model_cfg.path)
    if len(tok) > model.arch.vocab_size:
        raise ValueError(f"the tokenizer has {len(tok)} tokens but the model's vocabulary is {model.arch.vocab_size}")
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer of {model_cfg.tokenizer or model_cfg.path} has no EOS token; SFT answers need one")
    return model, tok


def full_state_dict(model, env) -> dict:
    """Unsharded CPU state dict (on rank 0 under FSDP; a collective every rank must call)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if env.distributed:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A copy, never views of the live parameters: merging LoRA into the export must not touch the policy.
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def export_pretrained(model, tokenizer, out_dir: Path, env, lora_cfg=None) -> Path:
    """Write the trained model (LoRA merged) in its family's layout + the tokenizer; loadable with ``load_model``."""
    state = full_state_dict(model, env)
    out = Path(out_dir)
    if env.is_main:
        fresh = build_model(get_family(model.family), model.hf_config, model.adapter.mask_token_id, init=False)
        if has_lora(model):
            apply_lora(fresh, lora_cfg.r, lora_cfg.alpha, 0.0, lora_cfg.target_modules, lora_cfg.include_experts)
        missing, unexpected = fresh.load_state_dict(state, strict=False, assign=True)
        missing = [k for k in missing if not (k == "lm_head.weight" and fresh.arch.tie_word_embeddings)]
        if missing or unexpected:
            raise RuntimeError(f"export: state dict mismatch (missing {missing[:5]}, unexpected {unexpected[:5]})")
        if fresh.arch.tie_word_embeddings:
            fresh.lm_head.weight = fresh.get_input_embeddings().weight
        if has_lora(fresh):
            merge_lora(fresh)
        fresh.save_pretrained(out, tokenizer=tokenizer)
        log.info("exported the trained model to %s", out)
    env.barrier()
    return out

"""Load the policy (checkpoint folder, hub id or ``tiny:<family>``) and export the trained model in the family's
own Hugging Face layout (LoRA merged), FSDP-aware."""
from __future__ import annotations

import logging
from pathlib import Path

from ..models.builder import build_model
from ..models.families import get_family
from ..models.lora import apply_lora, has_lora, merge_lora
from ..models.model_spec import foreign_tokenizer, load_model_spec, warn_if_foreign_tokenizer  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)


def load_policy(model_cfg):
    """(model, tokenizer) for a recipe's ``model`` section (``model.path``: ``tiny:<family>``, a checkpoint folder or
    a hub id), through the loader evaluation and ``dare generate`` use (``dare.models.model_spec``)."""
    return load_model_spec(model_cfg.path, dtype=model_cfg.dtype, attn_backend=model_cfg.attn_backend,
                           mask_token_id=model_cfg.mask_token_id, tokenizer=model_cfg.tokenizer,
                           tiny_seed=model_cfg.tiny_seed, tiny_sizes=model_cfg.tiny_sizes)


def full_state_dict(model, env) -> dict:
    """Unsharded CPU state dict (on rank 0 under FSDP; a collective every rank must call)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    if env.distributed:
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A copy, never views of the live parameters: merging LoRA into the export must not touch the policy.
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def export_pretrained(model, tokenizer, out_dir: Path, env, lora_cfg=None, decoding=None) -> Path:
    """Write the trained model (LoRA merged) in its family's layout + the tokenizer; loadable with ``load_model``.
    ``decoding``: (sampler fields, prompt fields) the export carries in its dare_decoding.json
    (``dare.models.decoding``: ``dare eval`` / ``dare generate`` use them by default)."""
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
        from . import swap  # written beside and swapped in whole: the export is never half-written (swap.py)
        staged = swap.staging(out)
        fresh.save_pretrained(staged, tokenizer=tokenizer)
        if decoding is not None:
            from ..models.decoding import write_decoding
            write_decoding(staged, *decoding)
        swap.replace(staged, out)
        log.info("exported the trained model to %s", out)
    env.barrier()
    return out

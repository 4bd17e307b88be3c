"""``dare.rollout.generate``: one entry point for every family, batched, seeded per sample.

``generate(model, prompts, config, generator=None, n=1, seeds=None) -> Rollout`` decodes ``n`` samples of
every prompt together. The sampler is chosen from the model's adapter (block-causal attention -> block
diffusion, encoder-decoder -> the uniform-noise canvas sampler, otherwise masked diffusion), never from a family
name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .block import build_block_state, run_block
from .canvas import build_canvas_state, check_canvas_config, run_canvas
from .config import SamplerConfig
from .masked import build_masked_state, masked_steps, run_masked
from .selection import REMASKINGS
from .state import DecodeState, PromptBatch, PromptsLike, expand_prompts, make_prompt_batch, make_stop_ids, sample_generators


@dataclass
class Trajectory:
    """Per-step record of a rollout (MDPO, CJ-GRPO): S = the most steps any row took.

    ``states[n, s]`` is the completion before the row's step s (mask id where masked), ``x0[n, s]`` the
    prediction of that step (predicted tokens at the positions the step looked at, the state elsewhere),
    ``confidence[n, s]`` their confidences (MDPO running confidence with ``rcr``; 0 elsewhere).
    Rows that took fewer steps are padded; ``valid[n, s]`` marks real steps.
    """
    states: torch.Tensor  # [N, S, G]
    x0: torch.Tensor  # [N, S, G]
    confidence: torch.Tensor  # [N, S, G]
    num_steps: torch.Tensor  # [N]
    valid: torch.Tensor  # [N, S] bool


@dataclass
class Rollout:
    sequences: torch.Tensor  # [N, P+G] left-padded prompt + completion
    attention_mask: torch.Tensor  # [N, P+G]
    prompt_length: int  # padded prompt width P
    completion_ids: torch.Tensor  # [N, G] (positions never decoded after an early stop hold the EOS id)
    completion_mask: torch.Tensor  # [N, G] tokens up to and including the first stop token
    step_map: torch.Tensor  # [N, G] the row's denoising step that wrote each token (-1: never written)
    nfe: int  # model forward passes (one batched call = 1)
    prompt_index: torch.Tensor  # [N] input prompt of every row (samples of a prompt are adjacent)
    trajectory: Optional[Trajectory] = None
    sample_index: Optional[torch.Tensor] = None  # [N] sample number within its prompt's group
    num_steps: Optional[torch.Tensor] = None  # [N] denoising steps each row took
    seeds: Optional[list[int]] = None  # per-row sampling seeds (None for deterministic decoding)
    stop_token_ids: tuple[int, ...] = ()

    @property
    def prompt_ids(self) -> torch.Tensor:
        return self.sequences[:, :self.prompt_length]

    @property
    def prompt_mask(self) -> torch.Tensor:
        return self.attention_mask[:, :self.prompt_length]

    def texts(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Completions as text, cut at the first stop token (which is not included)."""
        return decode_completions(tokenizer, self.completion_ids, self.completion_mask, self.stop_token_ids,
                                  skip_special_tokens)


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                       stop_token_ids: Sequence[int], skip_special_tokens: bool = True) -> list[str]:
    stops = set(int(t) for t in stop_token_ids)
    out = []
    for ids, m in zip(completion_ids.tolist(), completion_mask.bool().tolist()):
        kept = [t for t, keep in zip(ids, m) if keep]
        if kept and kept[-1] in stops:
            kept = kept[:-1]
        out.append(tokenizer.decode(kept, skip_special_tokens=skip_special_tokens))
    return out


def check_config(model, config: SamplerConfig) -> None:
    """Errors for settings the model cannot use (naming the parameter)."""
    adapter = model.adapter
    if config.cache not in adapter.cache_kinds:
        kind = adapter.attention.replace("_", "-")
        raise ValueError(f"cache={config.cache!r} cannot be used with {adapter.family} ({kind} attention); "
                         f"use one of {', '.join(adapter.cache_kinds)}")
    if adapter.is_encoder_decoder:
        check_canvas_config(config)
        return
    remask = REMASKINGS[config.remasking]
    if config.eoser and not remask.prob_like:
        raise ValueError(f"eoser scales probability-like confidences; remasking={config.remasking!r} is not one")
    if adapter.is_block_causal:
        if not remask.block_models:
            raise ValueError(f"remasking={config.remasking!r} is a masked-diffusion (Dream) algorithm; block-diffusion "
                             f"models use static, dynamic, sequential, low_confidence, random, maskgit_plus, topk_margin or entropy")
        for name, bad in (("cfg_scale", config.cfg_scale > 0), ("alg_temp", bool(config.alg_temp)), ("rcr", config.rcr)):
            if bad:
                raise ValueError(f"{name} is only implemented for masked-diffusion (bidirectional) models")
    else:
        if config.editing:
            raise ValueError("editing_threshold (LLaDA2.1 token editing) needs a block-diffusion model")
        masked_steps(config)


def _needs_random(config: SamplerConfig, adapter) -> bool:
    # Uniform-noise canvases start from (and re-noise with) random tokens whatever the temperature.
    return (config.temperature > 0 or config.remasking in ("random", "origin") or bool(config.alg_temp)
            or adapter.noise == "uniform")


@torch.no_grad()
def generate(model, prompts: PromptsLike, config: Optional[SamplerConfig] = None, generator: Optional[torch.Generator] = None,
             n: int = 1, seeds: Optional[Sequence[int]] = None, attention_mask: Optional[torch.Tensor] = None) -> Rollout:
    """Decode ``n`` samples of every prompt (token-id lists, or a padded tensor + ``attention_mask``).

    Sample j of prompt i draws from its own generator seeded by (seeds[i] or a seed derived from
    ``generator``, j), so equal seeds give equal rollouts whatever else is in the batch.
    """
    config = config or SamplerConfig()
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    check_config(model, config)
    adapter = model.adapter
    device = model.device
    stop_ids = make_stop_ids(config.stop_token_ids, adapter, device)
    fill_id = adapter.eos_token_id if adapter.eos_token_id is not None else (int(stop_ids[0]) if stop_ids.numel() else adapter.pad_token_id)
    pad_id = adapter.pad_token_id if adapter.pad_token_id is not None else fill_id
    if pad_id is None:
        raise ValueError(f"{adapter.family}: the model has no pad/eos token id; set stop_token_ids")
    batch = make_prompt_batch(prompts, attention_mask, pad_id, device)
    bad = ((batch.ids == adapter.mask_token_id) & batch.mask).any(1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"prompt(s) {bad} contain the mask token id {adapter.mask_token_id}")
    num_prompts = batch.ids.shape[0]
    batch, prompt_index = expand_prompts(batch, n)
    gens, sample_seeds = (sample_generators(num_prompts, n, generator, seeds, device) if _needs_random(config, adapter)
                          else (None, None))
    was_training = model.training
    model.eval()
    try:
        if adapter.is_encoder_decoder:
            st = build_canvas_state(batch, config, stop_ids, gens, config.record_trajectory)
            run_canvas(model, st, config)
        elif adapter.is_block_causal:
            st = build_block_state(batch, config, adapter.mask_token_id, pad_id, stop_ids, gens, config.record_trajectory)
            run_block(model, st, config)
        else:
            st = build_masked_state(batch, config, adapter.mask_token_id, stop_ids, gens, config.record_trajectory)
            run_masked(model, st, config)
    finally:
        model.train(was_training)
    return _assemble(st, batch, prompt_index, n, fill_id, sample_seeds)


def _assemble(st: DecodeState, batch: PromptBatch, prompt_index: torch.Tensor, n: int, fill_id: int, seeds) -> Rollout:
    G = st.gen_length
    cols = st.completion_cols()
    comp = st.x.gather(1, cols)
    comp = comp.masked_fill(comp == st.mask_id, fill_id)  # never decoded (the row stopped before)
    stop = torch.isin(comp, st.stop_ids)
    first = torch.where(stop.any(1), stop.float().argmax(1), torch.full_like(prompt_index, G))
    completion_mask = torch.arange(G, device=comp.device)[None] <= first[:, None]
    N = comp.shape[0]
    return Rollout(
        sequences=torch.cat([batch.ids, comp], dim=1),
        attention_mask=torch.cat([batch.mask, torch.ones((N, G), dtype=torch.bool, device=comp.device)], dim=1).long(),
        prompt_length=batch.ids.shape[1],
        completion_ids=comp,
        completion_mask=completion_mask.long(),
        step_map=st.step_map.gather(1, cols),
        nfe=st.nfe,
        prompt_index=prompt_index,
        trajectory=st.trajectory(),
        sample_index=torch.arange(n, device=comp.device).repeat(N // n),
        num_steps=st.row_steps.clone(),
        seeds=seeds,
        stop_token_ids=tuple(st.stop_ids.tolist()),
    )

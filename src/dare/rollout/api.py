"""``dare.rollout.generate``: one entry point for every family, batched, seeded per sample.

``generate(model, prompts, config, generator=None, n=1, seeds=None) -> Rollout`` decodes ``n`` samples of
every prompt together. The sampler is chosen from the model's adapter (block-causal attention -> block
diffusion, encoder-decoder -> the uniform-noise canvas sampler, otherwise masked diffusion), never from a family
name.

Inpainting: ``hints [N * n, gen_length]`` (token ids, -1 = none) writes tokens into each sample's completion before
decoding. The masked-diffusion and block samplers treat them as committed context, like the prompt: never eligible
for unmasking, never re-masked (RCR) or edited (LLaDA2.1), not counted in a block's transfer budget, masked with the
prompt in the unconditional branch of classifier-free guidance; the rollout's ``hint_mask`` says where they are.
Without hints every decode is unchanged (bit for bit).
"""
from __future__ import annotations

import contextlib
from typing import Optional, Sequence

import torch

from ..models import lean
from .block import block_schedule, build_block_state, run_block
from .canvas import build_canvas_state, check_canvas_config, run_canvas
from .config import Record, SamplerConfig
from .masked import build_masked_state, masked_blocks, masked_steps, run_masked
from .result import Rollout
from .selection import REMASKINGS
from .speculative import run_linear_spec
from .state import DecodeState, PromptBatch, PromptsLike, expand_prompts, make_prompt_batch, make_stop_ids, sample_generators


def check_config(model, config: SamplerConfig) -> None:
    """Errors for settings the model cannot use (naming the parameter)."""
    adapter = model.adapter
    if config.cache not in adapter.cache_kinds:
        kind = adapter.attention.replace("_", "-")
        raise ValueError(f"cache={config.cache!r} cannot be used with {adapter.family} ({kind} attention); "
                         f"use one of {', '.join(adapter.cache_kinds)}")
    if config.compile:
        if not hasattr(model, "decoding"):
            raise ValueError(f"compile=True compiles the native decoder's cached steps; {type(model).__name__} has none")
        problem = lean.compile_problem()  # looked up at call time: tests stand in for the probe
        if problem is not None:
            raise ValueError(f"compile=True needs torch.compile to build kernels on this machine (a C++ compiler and the "
                             f"Python headers); it could not: {problem}")
    if config.any_order and adapter.attention != "bidirectional":
        raise ValueError(f"any_order is a masked-diffusion (bidirectional) decoding; {adapter.family} is "
                         f"{adapter.attention.replace('_', '-')}")
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
        for name, bad in (("cfg_scale", config.cfg_scale > 0), ("alg_temp", bool(config.alg_temp)), ("rcr", config.rcr),
                          ("ass_blocks", config.ass_blocks > 1)):
            if bad:
                raise ValueError(f"{name} is only implemented for masked-diffusion (bidirectional) models")
    else:
        if config.editing:
            raise ValueError("editing_threshold (LLaDA2.1 token editing) needs a block-diffusion model")
        if config.sub_block_length is not None:
            raise ValueError("sub_block_length (sub-blocks of a block-causal model's block) needs a block-diffusion "
                             "model; masked-diffusion models decode semi-autoregressive blocks of block_length")
        if config.cache in ("block", "causal") and config.cfg_scale > 0:
            raise ValueError(f"cfg_scale cannot be used with cache={config.cache!r}: the unconditional branch would "
                             f"need a cache of its own")
        if not config.speculative:  # its blocks open where the last one's accepted tokens end
            masked_blocks(config)


def _needs_random(config: SamplerConfig, adapter) -> bool:
    # Uniform-noise canvases start from (and re-noise with) random tokens whatever the temperature.
    return (config.temperature > 0 or config.remasking in ("random", "origin") or bool(config.alg_temp)
            or adapter.noise == "uniform")


def steps_per_block(model, config: SamplerConfig) -> int:
    """Denoising steps of one block in the sampler's schedule (a schedule step s is block s // it, step s % it)."""
    if model.adapter.is_encoder_decoder:  # the canvas sampler's passes stop adaptively: no fixed schedule to pause in
        raise ValueError(f"pausing (until_step) is not supported by the canvas sampler of {model.adapter.family}")
    if model.adapter.is_block_causal:
        return int(block_schedule(config).numel())
    if config.ass_blocks > 1:  # CJ-GRPO's variable-size ASS blocks have no single steps-per-block
        raise ValueError("pausing (until_step) a decode with rollout.sampler.ass_blocks > 1 is not supported")
    return masked_steps(config)[1]


def _pause_point(model, config: SamplerConfig, until_step: Optional[int], resuming: bool, record: Record = Record()):
    if until_step is None and not resuming:
        return None
    for name, bad in (("recording a trajectory", record.trajectory), ("recording entropies", record.entropy),
                      ("rcr", config.rcr), ("speculative", config.speculative),
                      ("editing_threshold", config.editing)):
        if bad:
            raise ValueError(f"{name} cannot be combined with pausing or resuming a rollout (its per-block state "
                             f"is not carried over)")
    if until_step is None:
        return None
    if until_step < 0:
        raise ValueError(f"until_step must be >= 0, got {until_step}")
    spb = steps_per_block(model, config)
    return (until_step // spb, until_step % spb)


@torch.no_grad()
def generate(model, prompts: PromptsLike, config: Optional[SamplerConfig] = None, generator: Optional[torch.Generator] = None,
             n: int = 1, seeds: Optional[Sequence[int]] = None, attention_mask: Optional[torch.Tensor] = None,
             until_step: Optional[int] = None, hints: Optional[torch.Tensor] = None,
             record: Optional[Record] = None) -> Rollout:
    """Decode ``n`` samples of every prompt (token-id lists, or a padded tensor + ``attention_mask``).

    Sample j of prompt i draws from its own generator seeded by (seeds[i] or a seed derived from
    ``generator``, j), so nothing about a sample's decoding depends on the other rows; only the float rounding of
    the batched forward does (docs/samplers.md: what is bitwise reproducible and what is not). ``until_step`` pauses
    the decode where the schedule reaches that step (block ``until_step // steps_per_block``, its step
    ``until_step % steps_per_block``; rows decode blocks in lock step, so every row pauses at the same point):
    the rollout is partial and ``resume`` continues it. ``hints [num_prompts * n, gen_length]``: tokens fixed in
    each sample's completion before decoding (-1: none; see the module docstring). ``record``: what the rollout
    records besides its completions (``Record``: the trajectory, the commit entropies; default nothing).
    """
    config = config or SamplerConfig()
    record = record or Record()
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    check_config(model, config)
    record.check(config)
    pause = _pause_point(model, config, until_step, resuming=False, record=record)
    adapter = model.adapter
    device = model.device
    batch = make_prompt_batch(prompts, attention_mask, _special_ids(adapter, config, device)[2], device)
    bad = ((batch.ids == adapter.mask_token_id) & batch.mask).any(1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"prompt(s) {bad} contain the mask token id {adapter.mask_token_id}")
    num_prompts = batch.ids.shape[0]
    if hints is not None:
        if config.speculative:
            raise ValueError("hints cannot be used with speculative decoding: its verify writes every position")
        hints = _check_hints(hints, adapter, num_prompts * n, config.gen_length, device)
    batch, prompt_index = expand_prompts(batch, n)
    gens, sample_seeds = (sample_generators(num_prompts, n, generator, seeds, device) if _needs_random(config, adapter) else (None, None))
    return _decode(model, config, batch, prompt_index, n, gens, sample_seeds, pause, hints=hints, record=record)


def _check_hints(hints: torch.Tensor, adapter, rows: int, gen_length: int, device) -> torch.Tensor:
    """The hint canvas on ``device``, with errors naming what is wrong."""
    if adapter.is_encoder_decoder:
        raise ValueError(f"hints (tokens fixed in the canvas) are not supported by the uniform-noise canvas sampler of "
                         f"{adapter.family}: every pass re-draws each canvas position it does not accept by the "
                         f"entropy bound of the whole canvas, so it has no committed positions to hold them")
    if not isinstance(hints, torch.Tensor) or hints.dim() != 2 or tuple(hints.shape) != (rows, gen_length):
        got = tuple(hints.shape) if isinstance(hints, torch.Tensor) else type(hints).__name__
        raise ValueError(f"hints must be a [num_prompts * n, gen_length] = [{rows}, {gen_length}] tensor of token ids "
                         f"(-1 = no hint), got {got}")
    if hints.dtype.is_floating_point or hints.dtype == torch.bool:
        raise ValueError(f"hints must hold integer token ids, got dtype {hints.dtype}")
    hints = hints.long().to(device)
    bad = ((hints < -1) | (hints == adapter.mask_token_id)).any(1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"hints of row(s) {bad} hold the mask token id {adapter.mask_token_id} or an id below -1")
    return hints


@torch.no_grad()
def resume(model, partial: Rollout, config: Optional[SamplerConfig] = None, n: int = 1,
           seeds: Optional[Sequence[int]] = None, generator: Optional[torch.Generator] = None,
           until_step: Optional[int] = None) -> Rollout:
    """Continue a paused rollout: every row of ``partial`` continues ``n`` times (its continuations adjacent, each
    with its own generator from ``seeds[row]`` as ``generate`` seeds prompts) from the state it paused in, with the
    same sampler ``config``; ``until_step`` pauses again. Branching a decode into a tree is ``resume`` with n > 1.

    The exact caches of finished blocks (block models' ``block``, masked models' ``block`` / ``causal``) and uncached
    decoding continue exactly as if never paused (greedy decoding gives the same tokens); a prefix / dual cache is
    refreshed at the resumed step."""
    config = config or SamplerConfig()
    if partial.paused_at is None:
        raise ValueError("resume needs a paused rollout: generate(..., until_step=...) or resume(..., until_step=...)")
    if n < 1:
        raise ValueError(f"n (continuations per row) must be >= 1, got {n}")
    check_config(model, config)
    pause = _pause_point(model, config, until_step, resuming=True)
    if pause is not None and pause <= tuple(partial.paused_at):
        raise ValueError(f"until_step={until_step} is not after the point the rollout paused at {partial.paused_at}")
    device = model.device
    mask = partial.prompt_mask.bool().to(device)
    rows = PromptBatch(partial.prompt_ids.to(device), mask, mask.long().sum(1))
    batch, row_index = expand_prompts(rows, n)
    gens, sample_seeds = (sample_generators(rows.ids.shape[0], n, generator, seeds, device) if _needs_random(config, model.adapter)
                          else (None, None))
    return _decode(model, config, batch, partial.prompt_index.to(device)[row_index], n, gens, sample_seeds, pause,
                   (partial, row_index))


def _special_ids(adapter, config: SamplerConfig, device):
    """(stop ids, fill id for never-decoded positions, pad id)."""
    stop_ids = make_stop_ids(config.stop_token_ids, adapter, device)
    fill_id = adapter.eos_token_id if adapter.eos_token_id is not None else (int(stop_ids[0]) if stop_ids.numel() else adapter.pad_token_id)
    pad_id = adapter.pad_token_id if adapter.pad_token_id is not None else fill_id
    if pad_id is None:
        raise ValueError(f"{adapter.family}: the model has no pad/eos token id; set stop_token_ids")
    return stop_ids, fill_id, pad_id


def _decode(model, config: SamplerConfig, batch: PromptBatch, prompt_index, n: int, gens, seeds, pause,
            partial=None, hints: Optional[torch.Tensor] = None, record: Record = Record()) -> Rollout:
    adapter = model.adapter
    stop_ids, fill_id, pad_id = _special_ids(adapter, config, batch.ids.device)
    if adapter.is_encoder_decoder:
        if record.entropy:
            raise ValueError("recording entropies: the uniform-noise canvas sampler commits no tokens (it accepts by "
                             "entropy_bound and re-noises the rest)")
        st = build_canvas_state(batch, config, stop_ids, gens, record.trajectory)
    elif adapter.is_block_causal:
        st = build_block_state(batch, config, adapter.mask_token_id, pad_id, stop_ids, gens, record.trajectory)
    else:
        st = build_masked_state(batch, config, adapter.mask_token_id, stop_ids, gens, record.trajectory)
    if hints is not None:
        st.place_hints(hints)
    if record.entropy:
        st.entropy_map = torch.zeros(st.x.shape, dtype=torch.float32, device=st.x.device)
    if partial is not None:
        src, row_index = partial
        cols = st.completion_cols()
        st.x.scatter_(1, cols, src.completion_ids.to(st.x.device)[row_index])
        st.step_map.scatter_(1, cols, src.step_map.to(st.x.device)[row_index])
        st.row_steps = src.num_steps.to(st.x.device)[row_index].clone()
        if src.row_nfe is not None:  # a resumed row's NFE counts its forwards before the pause too
            st.row_nfe = src.row_nfe.to(st.x.device)[row_index].clone()
        st.finished = src.finished.to(st.x.device)[row_index].clone()
        st.start = tuple(src.paused_at)
        if src.hint_mask is not None:  # the hints stay fixed in the continuation
            st.hint = torch.zeros_like(st.is_prompt).scatter_(1, cols, src.hint_mask.to(st.x.device)[row_index].bool())
    st.pause = pause
    was_training = model.training
    model.eval()
    # Weights are fixed while the sampler runs: the model may snapshot them (DiffusionLM.decoding).
    decoding = model.decoding(compile=config.compile) if hasattr(model, "decoding") else contextlib.nullcontext()
    try:
        with decoding:
            run = (run_canvas if adapter.is_encoder_decoder else run_block if adapter.is_block_causal
                   else run_linear_spec if config.speculative else run_masked)
            run(model, st, config)
    finally:
        model.train(was_training)
    return _assemble(st, batch, prompt_index, n, fill_id, seeds)


def _assemble(st: DecodeState, batch: PromptBatch, prompt_index: torch.Tensor, n: int, fill_id: int, seeds) -> Rollout:
    G = st.gen_length
    cols = st.completion_cols()
    comp = st.x.gather(1, cols)
    if st.paused_at is None:
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
        entropy_map=st.entropy_map.gather(1, cols) if st.entropy_map is not None else None,
        nfe=st.nfe,
        prompt_index=prompt_index,
        trajectory=st.trajectory(),
        sample_index=torch.arange(n, device=comp.device).repeat(N // n),
        num_steps=st.row_steps.clone(),
        row_nfe=st.row_nfe.clone(),
        seeds=seeds,
        stop_token_ids=tuple(st.stop_ids.tolist()),
        paused_at=st.paused_at,
        finished=st.finished.clone() if st.paused_at is not None else None,
        hint_mask=st.hint.gather(1, cols) if st.hint is not None else None,
    )

"""The entropy-bound canvas sampler of uniform-noise encoder-decoder models (DiffusionGemma).

The completion is decoded one canvas (``block_length`` tokens) at a time. Per canvas: the causal encoder appends
the clean context to its KV cache (the prompt, then each finished canvas: ``cache="block"``; ``cache="none"``
re-encodes the whole context for every canvas), the canvas starts as uniform random tokens, and every pass

1. runs the decoder on the canvas (fed the previous pass's processed logits: self-conditioning), reading the cache;
2. scales the logits by the pass's temperature (linear schedule ``t_min .. t_max``, or the constant ``temperature``),
   samples a denoised canvas from them and takes their argmax;
3. accepts the k lowest-entropy positions with ``sum(entropy) - max(entropy) <= entropy_bound`` (the sampled token
   there) and re-noises every other position with a fresh uniform random token;
4. stops the canvas early when the argmax canvas is stable for ``stability_threshold`` passes and the mean entropy is
   below ``confidence_threshold``.

The canvas's tokens are the last pass's argmax; a row stops after the canvas holding a stop token. This is
transformers' ``DiffusionGemmaGenerationMixin.generate`` step for step, with dare's batching: every row draws from
its own generator in transformers' order (initial canvas, then per pass the categorical draw and the re-noising
draw), so a row decoded in a batch gives exactly what ``generate`` gives for that prompt alone under the same seed;
left padding is exact (per-row positions, padded keys masked); rows that finished a canvas early sit out the
remaining passes. ``step_map`` records the last pass that changed each token's argmax; the trajectory records every
pass (the canvas before it, its argmax, the argmax's probability).
"""
from __future__ import annotations

import copy
import math
from typing import Optional

import torch

from ..models.canvas import FULL, SLIDING, decoder_masks, encoder_masks
from ..models.masks import positions_from_padding
from .config import SamplerConfig
from .selection import filter_logits
from .state import DecodeState, PromptBatch


def canvas_steps(cfg: SamplerConfig) -> tuple[int, int]:
    """(number of canvases, passes per canvas), with errors naming the parameter."""
    C, G = cfg.block_length, cfg.gen_length
    n = math.ceil(G / C)
    if cfg.steps_per_block is not None:
        return n, cfg.steps_per_block
    if cfg.steps % n:
        raise ValueError(f"steps={cfg.steps} (total) cannot be split over the {n} canvases of block_length={C} for "
                         f"gen_length={G}; set steps_per_block (DiffusionGemma's max_denoising_steps)")
    return n, cfg.steps // n


def check_canvas_config(cfg: SamplerConfig) -> None:
    """Errors for masked-diffusion options that have no meaning for the canvas sampler."""
    bad = [("threshold", cfg.threshold is not None), ("factor", cfg.factor is not None),
           ("editing_threshold", cfg.editing), ("rcr", cfg.rcr), ("cfg_scale", cfg.cfg_scale > 0),
           ("alg_temp", bool(cfg.alg_temp)), ("eoser", cfg.eoser), ("schedule", cfg.schedule != "even"),
           ("eos_early_stop", cfg.eos_early_stop), ("remasking", cfg.remasking != "low_confidence"),
           ("suppress_eos_confidence", cfg.suppress_eos_confidence),
           ("sub_block_length", cfg.sub_block_length is not None)]
    names = [n for n, b in bad if b]
    if names:
        raise ValueError(f"{', '.join(names)}: masked-diffusion sampler option(s) with no meaning for the uniform-noise "
                         f"canvas sampler (it accepts by entropy_bound and re-noises the rest; see docs/samplers.md)")
    canvas_steps(cfg)


def build_canvas_state(batch: PromptBatch, cfg: SamplerConfig, stop_ids, gens, record) -> DecodeState:
    n, _ = canvas_steps(cfg)
    N, P = batch.ids.shape
    dev = batch.ids.device
    W = P + n * cfg.block_length
    x = torch.cat([batch.ids, torch.full((N, W - P), -1, dtype=torch.long, device=dev)], 1)
    valid = torch.cat([batch.mask, torch.ones(N, W - P, dtype=torch.bool, device=dev)], 1)
    is_prompt = torch.zeros(N, W, dtype=torch.bool, device=dev)
    is_prompt[:, :P] = batch.mask
    gen_start = torch.full((N,), P, dtype=torch.long, device=dev)
    return DecodeState(x, valid, positions_from_padding(valid), is_prompt, gen_start, cfg.gen_length, -1, stop_ids,
                       gens, record)


def _rows_of(cache, idx: torch.Tensor):
    """A read-only view of ``cache`` holding batch rows ``idx`` (for passes that only some rows run)."""
    sub = copy.copy(cache)
    sub.layers = []
    for layer in cache.layers:
        part = copy.copy(layer)
        if getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", True):
            part.keys, part.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)
        sub.layers.append(part)
    return sub


def _none_if_full(masks: dict) -> dict:
    """An all-True decoder mask is passed as None (what transformers' generate does without padding)."""
    return {k: (None if bool(m.all()) else m) for k, m in masks.items()}


class CanvasEncoder:
    """The encoder cache of the rows still decoding, and the positions / documents of its columns."""

    def __init__(self, model, st: DecodeState, reuse: bool):
        self.model, self.st, self.reuse = model, st, reuse
        self.cache = None
        self.rows = None
        self.encoded = 0  # buffer columns [0, encoded) are in the cache
        self.sw = model.sliding_window

    def keep(self, rows: torch.Tensor) -> None:
        if self.cache is not None and self.reuse and rows.numel() != self.rows.numel():
            self.cache.batch_select_indices(torch.searchsorted(self.rows, rows))
        self.rows = rows

    def context(self, rows: torch.Tensor, upto: int) -> int:
        """Encode buffer columns ``[encoded, upto)`` (everything before the canvas); returns the forwards run."""
        self.keep(rows)
        st = self.st
        if not self.reuse or self.cache is None:
            self.cache, self.encoded = self.model.new_cache(), 0
        c0 = self.encoded
        if c0 >= upto:
            return 0
        counts = {k: v + upto - c0 for k, v in self.model.cached_keys(self.cache).items()}
        pos, doc = st.pos[rows, :upto], self._doc(rows, upto)
        masks = encoder_masks(pos[:, c0:], doc[:, c0:], pos, doc, self.sw, counts)
        self.model.encode(st.x[rows, c0:upto], pos[:, c0:], self.cache, masks)
        self.encoded = upto
        return 1

    def _doc(self, rows, upto):
        v = self.st.valid[rows, :upto]
        return torch.where(v, torch.zeros_like(v, dtype=torch.long), torch.full_like(v, -1, dtype=torch.long))

    def decoder_inputs(self, rows: torch.Tensor, c0: int, c1: int):
        """(cache view, masks, positions) of canvas ``[c0, c1)`` for ``rows`` (a subset of the cached rows)."""
        st = self.st
        cache = self.cache if rows.numel() == self.rows.numel() else _rows_of(self.cache, torch.searchsorted(self.rows, rows))
        counts = self.model.cached_keys(cache)
        pos = st.pos[rows, c0:c1]
        doc = torch.zeros_like(pos)
        start = pos[:, :1].expand_as(pos)
        masks = decoder_masks(pos, doc, start, st.pos[rows, :c0], self._doc(rows, c0), self.sw, counts)
        return cache, _none_if_full(masks), pos


def _temperature(cfg: SamplerConfig, remaining: int, steps: int):
    """transformers' LinearTemperatureScheduleLogitsProcessor in its own float32 tensor arithmetic."""
    if cfg.t_min is None:
        return cfg.temperature if cfg.temperature > 0 else None
    cur = torch.tensor(remaining, dtype=torch.int32)
    return cfg.t_min + ((cfg.t_max - cfg.t_min) * (cur / steps))


class CanvasStop:
    """transformers' StableAndConfidentStoppingCriteria, per row: stop when the argmax canvas equals each of the last
    ``stability`` ones (0: no stability condition) and the mean token entropy is below ``confidence``."""

    def __init__(self, stability: Optional[int], confidence: Optional[float], rows: int, length: int, device):
        self.confidence = confidence
        self.history = None
        if stability:
            self.history = torch.full((stability, rows, length), -1, dtype=torch.long, device=device)

    def __call__(self, run: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        """Stop flags of rows ``run`` (local indices) after a pass with ``argmax`` / ``entropy`` ``[len(run), L]``."""
        if self.confidence is None:
            return torch.zeros(run.numel(), dtype=torch.bool, device=argmax.device)
        stable = torch.ones(run.numel(), dtype=torch.bool, device=argmax.device)
        if self.history is not None:
            h = self.history[:, run]
            stable = (h == argmax[None]).all(-1).all(0)
            self.history[:, run] = torch.cat([h[1:], argmax[None]], 0)
        return stable & (entropy.mean(-1) < self.confidence)


def _accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """Lowest-entropy positions whose entropy sum minus their largest entropy stays within ``bound``."""
    sorted_h, order = torch.sort(entropy, dim=-1, descending=False)
    keep = torch.cumsum(sorted_h, dim=-1) - sorted_h <= bound
    return torch.scatter(torch.zeros_like(keep), -1, order, keep)


def _randint(gens, rows_local, V: int, C: int, device) -> torch.Tensor:
    return torch.stack([torch.randint(0, V, (1, C), generator=gens[i], device=device)[0] for i in rows_local])


def run_canvas(model, st: DecodeState, cfg: SamplerConfig) -> None:
    n_canvas, steps = canvas_steps(cfg)
    C, V = cfg.block_length, model.adapter.vocab_size
    P = int(st.gen_start[0])
    enc = CanvasEncoder(model, st, reuse=cfg.cache == "block")
    sc_dtype = model.get_input_embeddings().weight.dtype
    for b in range(n_canvas):
        act = st.active()
        if act.numel() == 0:
            break
        c0, c1 = P + b * C, P + (b + 1) * C
        st.count_forward(act, enc.context(act, c0))
        gens = st.row_gens(act)
        dev = st.x.device
        canvas = _randint(gens, range(act.numel()), V, C, dev)  # transformers draws it even for a given canvas
        argmax = canvas.clone()
        sc = None
        done = torch.zeros(act.numel(), dtype=torch.bool, device=dev)
        stop = CanvasStop(cfg.stability_threshold, cfg.confidence_threshold, act.numel(), C, dev)
        for remaining in range(steps, 0, -1):
            run = (~done).nonzero().flatten()
            if run.numel() == 0:
                break
            rows = act[run]
            cache, masks, pos = enc.decoder_inputs(rows, c0, c1)
            logits = model.denoise(canvas[run], pos, cache, masks, None if sc is None else sc[run].to(sc_dtype))
            st.count_forward(rows)
            temp = _temperature(cfg, remaining, steps)
            processed = filter_logits(logits / temp if temp is not None else logits, cfg.top_k, cfg.top_p)
            probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
            if temp is not None:
                sampled = torch.stack([torch.multinomial(probs[i].view(-1, probs.shape[-1]), 1, generator=gens[int(j)])[:, 0]
                                       for i, j in enumerate(run)])
            else:
                sampled = processed.argmax(-1)
            new_argmax = processed.argmax(-1)
            entropy = torch.distributions.Categorical(logits=processed).entropy()
            accept = _accept(entropy, cfg.entropy_bound)
            noise = _randint(gens, run.tolist(), V, C, dev)
            new_canvas = torch.where(accept, sampled, canvas[run])
            new_canvas = torch.where(~accept, noise, new_canvas)
            conf = probs.gather(-1, new_argmax[..., None])[..., 0]
            changed = new_argmax != argmax[run] if remaining < steps else torch.ones_like(accept)
            st.x[rows, c0:c1] = canvas[run]  # the trajectory's state: the canvas this pass denoised
            st.commit(rows, c0, new_canvas, changed, x0=new_argmax, score=conf, predicted=torch.ones_like(accept))
            done[run] = stop(run, new_argmax, entropy)
            canvas[run], argmax[run] = new_canvas, new_argmax
            sc = processed if sc is None else sc.index_copy(0, run, processed)
        st.x[act, c0:c1] = argmax
        if cfg.block_stop:
            st.finish_rows_with_stop(act, final_only=False)
    st.finished[:] = True

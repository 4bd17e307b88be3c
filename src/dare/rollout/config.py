"""``SamplerConfig``: every knob of every diffusion sampler, typed and validated (part of recipe configs).

Field names are the public API (they mirror the reference samplers' parameters; see
docs/samplers.md for the mapping). Validation that does not depend on the model happens here;
checks that need the model (a cache kind its attention cannot use, gen_length vs block_length for
masked models) happen in ``dare.rollout.generate``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from .schedule import ass_block_steps
from .selection import REMASKINGS

log = logging.getLogger(__name__)
_SAID: set = set()  # (steps, gen_length) pairs already reported, so a config copied per batch is reported once

CACHES = ("none", "prefix", "dual", "block", "causal")
SCHEDULES = ("even", "ass", "linear")


@dataclass
class SamplerConfig:
    gen_length: int = 256
    block_length: int = 32
    # At most one of: total steps split evenly over blocks (LLaDA), or steps per block (block diffusion).
    # Neither = steps = gen_length (one token per step).
    steps: Optional[int] = None
    steps_per_block: Optional[int] = None
    temperature: float = 0.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    remasking: str = "low_confidence"
    alg_temp: Optional[float] = None
    eps: float = 1e-3
    cfg_scale: float = 0.0
    cache: str = "none"
    threshold: Optional[float] = None
    factor: Optional[float] = None
    editing_threshold: Optional[float] = None
    max_post_steps: int = 0
    eos_early_stop: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    suppress_eos_confidence: bool = False
    # --- additions (see docs/samplers.md) ---------------------------------------------------------
    # After each finished block, finish rows whose completion already holds a stop token. This never
    # changes a completion (finished blocks are final); False decodes every block like the LLaDA/Dream
    # references, True is what the SDAR (stopping criteria) and LLaDA2.0 references do.
    block_stop: bool = True
    # Block-diffusion models: decode each block in sub-blocks of this many positions, left to right (a step commits
    # only masks of the first sub-block that has any; attention stays over the whole block). Fast-dLLM v2's
    # ``small_block_size``. None: the whole block at once.
    sub_block_length: Optional[int] = None
    # LLaDA2.1 editing: masks committed per step when fewer than that pass `threshold`.
    num_to_transfer: int = 1
    # LLaDA2.0: steps per block are capped at gen_length // minimal_topk.
    minimal_topk: int = 1
    # MDPO running-confidence remasking: fill every mask each step, re-mask the lowest running confidences.
    rcr: bool = False
    # Tokens per step: "even" (LLaDA split; Dream's algorithms use their eps time grid), CJ-GRPO's ascending step
    # size "ass" (step i commits 2^i tokens, floor(log2 block) steps per block), or RND1's "linear" (after step j of
    # N, floor(M (N - j) / N) of the block's M masks are left: schedule.linear_split).
    schedule: str = "even"
    # CJ-GRPO's multi-block ASS (its ``block_num``): with schedule="ass" and block_length = gen_length, decode
    # the completion in this many variable-size blocks -- the first takes ASS steps 0..S-n, each later block one
    # step (masked-diffusion models; see schedule.ass_block_steps). 1 = one block.
    ass_blocks: int = 1
    # CJ-GRPO EOS early rejection: the confidence of a predicted stop token is scaled by gamma(step),
    # rising from eoser_gamma_min at step 0 to eoser_gamma_max.
    eoser: bool = False
    eoser_gamma_min: float = 0.01
    eoser_gamma_max: float = 1.0
    # Cached steps (prefix / dual cache) of the native dense families run their layer stack as one torch.compile'd
    # graph (dare.models.lean; 1.1-1.2x per single-sequence dual-cache decode on a CPU, after a one-off compile of
    # ~10-30 s per shape). Fused kernels round differently, so a compiled decode is judged by its tokens, not its
    # bits; off by default.
    compile: bool = False
    # d2-AnyOrder's decoding (dare.diffusion.anyorder; masked-diffusion models fine-tuned any-order): a masked position
    # sees the prompt, the decoded tokens and itself -- never another mask -- and decoded tokens attend causally in
    # decoding order. Its trajectory likelihood is then one forward (docs/algorithms/d2_anyorder.md).
    any_order: bool = False
    # Nemotron-Labs-Diffusion's linear speculative decoding (models whose weights also run causally; with
    # cache="causal"): each block is drafted bidirectionally, ``threshold`` or all masks at once per forward, then
    # verified causally; the longest agreeing prefix plus one token is kept (dare.rollout.speculative).
    speculative: bool = False
    # --- DiffusionGemma's canvas sampler (uniform-noise encoder-decoder models; transformers' parameter names) ----
    # Each pass accepts the k lowest-entropy positions with sum(entropy) - max(entropy) <= entropy_bound and re-noises
    # the rest with uniform random tokens; the canvas's tokens are the last pass's argmax.
    entropy_bound: float = 0.1
    # Linear temperature schedule t_min + (t_max - t_min) * remaining_steps / steps (t_max at the first pass); unset:
    # the constant ``temperature`` (0 = greedy denoiser). transformers' generate defaults are 0.4 / 0.8.
    t_min: Optional[float] = None
    t_max: Optional[float] = None
    # Adaptive stop of a canvas: the argmax canvas unchanged for stability_threshold passes and the mean entropy
    # below confidence_threshold (both set, or neither: every pass runs). transformers' defaults: 1 and 0.005.
    stability_threshold: Optional[int] = None
    confidence_threshold: Optional[float] = None

    # Keys recipes used to set, with what replaced them (the typed config's error says so instead of "unknown key").
    REMOVED_KEYS: ClassVar[dict] = {
        k: "what a rollout records is asked by the method that trains on it (its `record`: a dare.rollout.Record; "
           "MDPO records the trajectory, EGSPO the commit entropies), not set in the sampler; delete the key"
        for k in ("record_trajectory", "record_entropy")}

    def __post_init__(self):
        if self.gen_length <= 0:
            raise ValueError(f"gen_length must be positive, got {self.gen_length}")
        if self.block_length <= 0:
            raise ValueError(f"block_length must be positive, got {self.block_length}")
        if self.steps is not None and self.steps_per_block is not None:
            raise ValueError("set only one of steps (total, split over blocks) or steps_per_block")
        if self.steps is None and self.steps_per_block is None:
            self.steps = self.gen_length  # one token per step: the quality setting of every reference
        for name in ("steps", "steps_per_block"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.remasking not in REMASKINGS:  # the registry: a strategy added with register_remasking is valid here
            raise ValueError(f"remasking={self.remasking!r} is not one of {', '.join(REMASKINGS)}")
        if self.cache not in CACHES:
            raise ValueError(f"cache={self.cache!r} is not one of {', '.join(CACHES)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.sub_block_length is not None and (self.sub_block_length <= 0 or self.block_length % self.sub_block_length):
            raise ValueError(f"sub_block_length={self.sub_block_length} must be positive and divide "
                             f"block_length={self.block_length}")
        if self.ass_blocks < 1:
            raise ValueError(f"ass_blocks must be >= 1, got {self.ass_blocks}")
        if self.ass_blocks > 1:
            if self.schedule != "ass" or self.block_length != self.gen_length:
                raise ValueError(f"ass_blocks={self.ass_blocks} (CJ-GRPO's variable-size ASS blocks) sets the block "
                                 f"structure itself: use schedule='ass' and block_length = gen_length")
            ass_block_steps(self.gen_length, self.ass_blocks)  # at most floor(log2 gen_length) blocks
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.editing_threshold is not None and not 0.0 <= self.editing_threshold <= 1.0:
            raise ValueError(f"editing_threshold must be in [0, 1], got {self.editing_threshold}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.factor is not None and self.factor <= 0:
            raise ValueError(f"factor must be positive, got {self.factor}")
        if self.alg_temp is not None and self.alg_temp < 0:
            raise ValueError(f"alg_temp must be >= 0, got {self.alg_temp}")
        if not 0.0 < self.eps < 1.0:
            raise ValueError(f"eps must be in (0, 1), got {self.eps}")
        if self.cfg_scale < 0:
            raise ValueError(f"cfg_scale must be >= 0, got {self.cfg_scale}")
        if self.max_post_steps < 0:
            raise ValueError(f"max_post_steps must be >= 0, got {self.max_post_steps}")
        if self.num_to_transfer < 1:
            raise ValueError(f"num_to_transfer must be >= 1, got {self.num_to_transfer}")
        if self.minimal_topk < 1:
            raise ValueError(f"minimal_topk must be >= 1, got {self.minimal_topk}")
        if not 0.0 <= self.eoser_gamma_min <= self.eoser_gamma_max:
            raise ValueError(f"need 0 <= eoser_gamma_min <= eoser_gamma_max, got {self.eoser_gamma_min}, {self.eoser_gamma_max}")
        if self.threshold is not None and self.factor is not None:
            raise ValueError("set only one of threshold (confidence-threshold decoding) or factor (factor decoding)")
        if self.remasking == "dynamic" and self.threshold is None:
            raise ValueError("remasking='dynamic' needs a threshold")
        if self.steps is not None and self.steps > self.gen_length and (self.steps, self.gen_length) not in _SAID:
            _SAID.add((self.steps, self.gen_length))
            log.warning("sampler steps=%d > gen_length=%d: every step commits at least one token, so decoding takes at "
                        "most %d steps", self.steps, self.gen_length, self.gen_length)
        if self.remasking in ("static", "sequential") and (self.threshold is not None or self.factor is not None):
            raise ValueError(f"remasking={self.remasking!r} commits a fixed number of tokens per step; "
                             f"threshold/factor need remasking='dynamic' or 'low_confidence'")
        if self.remasking == "origin" and (self.threshold is not None or self.factor is not None or self.rcr):
            raise ValueError("remasking='origin' (Dream's random-time unmasking) cannot be combined with threshold, factor or rcr")
        if self.rcr and (self.threshold is not None or self.factor is not None or self.editing_threshold is not None):
            raise ValueError("rcr (running-confidence remasking) needs the fixed step schedule: unset threshold, factor and editing_threshold")
        if self.rcr and self.eos_early_stop:
            raise ValueError("rcr can re-mask committed tokens, so eos_early_stop cannot be used with it")
        if self.editing_threshold is not None and self.threshold is None:
            raise ValueError("editing_threshold (LLaDA2.1 token editing) needs threshold (the mask-to-token threshold)")
        if self.editing_threshold is not None and (self.factor is not None or self.schedule != "even"):
            raise ValueError("editing_threshold (LLaDA2.1 token editing) uses threshold + num_to_transfer; unset factor and schedule")
        if self.any_order and (self.cache != "none" or self.cfg_scale > 0 or self.rcr or self.editing):
            raise ValueError("any_order decodes with its own attention mask every step: it needs cache='none', "
                             "cfg_scale=0 and no rcr / editing_threshold (a re-masked token would leave the decoding order)")
        if self.rcr and self.cache == "causal":  # its first step would re-mask the seeded position
            raise ValueError("rcr (running-confidence remasking) cannot be used with cache='causal': the seeded first "
                             "token of a block has no running confidence")
        if self.speculative and (self.cache != "causal" or self.cfg_scale > 0 or self.rcr or self.any_order
                                 or self.factor is not None or self.editing):
            raise ValueError("speculative (linear speculative decoding) drafts against the causal cache: it needs "
                             "cache='causal' and no cfg_scale, rcr, any_order, factor or editing")
        self._check_canvas_fields()

    def _check_canvas_fields(self) -> None:
        if self.entropy_bound <= 0:
            raise ValueError(f"entropy_bound must be > 0, got {self.entropy_bound}")
        if (self.t_min is None) != (self.t_max is None):
            raise ValueError("set both t_min and t_max (the linear temperature schedule) or neither")
        if self.t_min is not None and not 0.0 <= self.t_min < self.t_max:
            raise ValueError(f"need 0 <= t_min < t_max, got t_min={self.t_min}, t_max={self.t_max}")
        if (self.stability_threshold is None) != (self.confidence_threshold is None):
            raise ValueError("set both stability_threshold and confidence_threshold (the adaptive canvas stop) or neither")
        if self.stability_threshold is not None and self.stability_threshold < 0:
            raise ValueError(f"stability_threshold must be >= 0, got {self.stability_threshold}")
        if self.confidence_threshold is not None and self.confidence_threshold <= 0:
            raise ValueError(f"confidence_threshold must be > 0, got {self.confidence_threshold}")

    # --- derived values ---------------------------------------------------------------------------
    @property
    def editing(self) -> bool:
        return self.editing_threshold is not None

    @property
    def parallel(self) -> bool:
        """True when the number of tokens per step is decided by confidences, not by the schedule."""
        return self.threshold is not None or self.factor is not None or self.editing


@dataclass(frozen=True)
class Record:
    """What a decode records besides its completions: a request of whoever reads the rollout (the method that trains
    on it: ``Algorithm.record``), not a decoding setting, so it is no part of ``SamplerConfig``.

    ``trajectory``: every step's state, prediction and confidences (``Rollout.trajectory``; MDPO).
    ``entropy``: for every committed token, the entropy (nats) of the model's own predictive distribution it was
    committed from: softmax of the step's logits at temperature 1, before top-k / top-p (``Rollout.entropy_map``;
    EGSPO picks its training steps by it). Masked and block samplers without re-masking, editing or speculation."""
    trajectory: bool = False
    entropy: bool = False

    def check(self, sampler: SamplerConfig) -> None:
        """A clear error when ``sampler`` cannot record what is asked."""
        if self.entropy and (sampler.rcr or sampler.editing_threshold is not None or sampler.speculative):
            raise ValueError("recording entropies records one per committed token; rcr, editing_threshold and "
                             "speculative decoding re-mask, rewrite or verify committed tokens")
        if self.trajectory and sampler.speculative:
            raise ValueError("recording a trajectory cannot be used with speculative decoding: its blocks are not "
                             "denoising steps")

"""``SamplerConfig``: every knob of every diffusion sampler, typed and validated (part of recipe configs).

Field names are the public API (they mirror the reference samplers' parameters; see
docs/samplers.md for the mapping). Validation that does not depend on the model happens here;
checks that need the model (a cache kind its attention cannot use) happen in ``generate``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

REMASKING = ("low_confidence", "random", "maskgit_plus", "topk_margin", "entropy", "origin", "static", "dynamic", "sequential")
CACHES = ("none", "prefix", "dual", "block")


@dataclass
class SamplerConfig:
    gen_length: int = 256
    block_length: int = 32
    # At most one of: total steps split evenly over blocks (LLaDA), or steps per block (block diffusion).
    # Neither = steps = gen_length.
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
    record_trajectory: bool = False

    def __post_init__(self):
        if self.gen_length <= 0:
            raise ValueError(f"gen_length must be positive, got {self.gen_length}")
        if self.block_length <= 0:
            raise ValueError(f"block_length must be positive, got {self.block_length}")
        if self.steps is not None and self.steps_per_block is not None:
            raise ValueError("set only one of steps (total, split over blocks) or steps_per_block")
        if self.steps is None and self.steps_per_block is None:
            self.steps = self.gen_length  # one token per step: the quality setting of every reference
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking={self.remasking!r} is not one of {', '.join(REMASKING)}")
        if self.cache not in CACHES:
            raise ValueError(f"cache={self.cache!r} is not one of {', '.join(CACHES)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

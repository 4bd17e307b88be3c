"""Batched diffusion samplers for every family (see ``generate`` and docs/samplers.md)."""
from .api import check_config, generate, resume, steps_per_block
from .result import Rollout, Trajectory, decode_completions
from .config import Record, SamplerConfig
from .selection import REMASKINGS, Remasking, register_remasking
from .tree import TreeRollout, generate_tree

__all__ = ["SamplerConfig", "Record", "Rollout", "Trajectory", "generate", "resume", "steps_per_block", "decode_completions", "check_config",
           "REMASKINGS", "Remasking", "register_remasking", "TreeRollout", "generate_tree"]

"""Batched diffusion samplers for every family (see ``generate`` and docs/samplers.md)."""
from .api import Rollout, Trajectory, check_config, decode_completions, generate
from .config import SamplerConfig
from .selection import REMASKINGS, Remasking, register_remasking

__all__ = ["SamplerConfig", "Rollout", "Trajectory", "generate", "decode_completions", "check_config",
           "REMASKINGS", "Remasking", "register_remasking"]

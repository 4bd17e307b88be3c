"""Batched diffusion samplers for every family (see ``generate``)."""
from .config import SamplerConfig

__all__ = ["SamplerConfig"]

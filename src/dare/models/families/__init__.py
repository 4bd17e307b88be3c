"""Model families. Importing this package registers every supported family."""
from .base import FAMILIES, Family, UnsupportedModelError, detect_family, get_family, register_family, supported_description
from . import llada, lladamoe, dream, sdar, llada2, diffusion_gemma  # noqa: F401  (registration side effects)

__all__ = ["FAMILIES", "Family", "UnsupportedModelError", "detect_family", "get_family", "register_family", "supported_description"]

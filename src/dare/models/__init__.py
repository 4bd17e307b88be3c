"""Native model layer: every dLLM family from its published layout, no remote code."""
from .adapter import FamilyAdapter
from .arch import ModelArch, MoESpec
from .cache import KVCache
from .families import FAMILIES, UnsupportedModelError, detect_family, get_family
from .loading import CheckpointError, load_model, parse_dtype, save_pretrained
from .masks import TokenLayout
from .model import DiffusionLM, ModelOutput
from .tiny_model import tiny

__all__ = [
    "FamilyAdapter", "ModelArch", "MoESpec", "KVCache", "FAMILIES", "UnsupportedModelError", "detect_family",
    "get_family", "CheckpointError", "load_model", "parse_dtype", "save_pretrained", "TokenLayout", "DiffusionLM",
    "ModelOutput", "tiny", "load_tokenizer",
]


def __getattr__(name):  # lazy: tokenizers / tiny pull in transformers
    if name in ("load_tokenizer", "tiny_tokenizer"):
        from . import tokenizer
        return getattr(tokenizer, name)
    raise AttributeError(name)

"""Native model layer: every dLLM family from its published layout, no remote code.

Family specs (``families``) say what each family is; ``builder`` makes their models; ``loading`` / ``checkpoint``
read and write published checkpoints; ``model_spec`` loads a model named by a spec string (``tiny:<family>``, a
folder, a hub id) for the trainer, evaluation and ``dare generate``.
"""
from .adapter import FamilyAdapter
from .arch import ModelArch, MoESpec
from .builder import build_model
from .cache import KVCache
from .checkpoint import CheckpointError, save_pretrained
from .families import FAMILIES, FamilySpec, UnsupportedModelError, detect_family, get_family, register_family
from .loading import load_model, parse_dtype
from .masks import TokenLayout
from .model import DiffusionLM
from .model_spec import load_model_spec
from .outputs import LogitsRequest, ModelOutput
from .tiny_model import tiny
from .tokenizer import load_tokenizer, tiny_tokenizer

__all__ = [
    "FamilyAdapter", "ModelArch", "MoESpec", "KVCache", "FAMILIES", "FamilySpec", "UnsupportedModelError",
    "detect_family", "get_family", "register_family", "build_model", "CheckpointError", "load_model", "parse_dtype",
    "save_pretrained", "load_model_spec", "TokenLayout", "DiffusionLM", "LogitsRequest", "ModelOutput", "tiny", "load_tokenizer", "tiny_tokenizer",
]

"""``ModelConfig``: the ``model:`` section of a recipe."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    # Native module names (the same for every family; LLaDA2 adds qkv_proj). See docs/models.md.
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj",
                                                                "gate_proj", "up_proj", "down_proj"])


@dataclass
class ModelConfig:
    # A checkpoint folder, a Hugging Face id, or "tiny:<family>" for a random tiny model (tests, quickstart).
    path: str = "tiny:llada"
    tokenizer: Optional[str] = None  # defaults to ``path``
    dtype: str = "float32"
    attn_backend: str = "auto"
    mask_token_id: Optional[int] = None
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self):
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if self.attn_backend not in ("auto", "sdpa", "flex", "flash_attn"):
            raise ValueError(f"attn_backend must be auto, sdpa, flex or flash_attn, got {self.attn_backend!r}")

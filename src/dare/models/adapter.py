"""What the samplers and trainers need to know about a model family, in one object.

The rollout engine and the training loop never branch on a family name: they ask the adapter for the
mask token, the stop tokens, whether logits are shifted, how attention is masked and how the family corrupts
(``noise``: the absorbing mask token of masked diffusion, or DiffusionGemma's uniform random tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from . import masks


@dataclass
class FamilyAdapter:
    family: str
    mask_token_id: int
    eos_token_id: Optional[int]
    pad_token_id: Optional[int]
    bos_token_id: Optional[int] = None
    # Dream is AR-initialised: the prediction for position i is the logit row i-1.
    shift_logits: bool = False
    # "encoder_decoder" (DiffusionGemma): a causal encoder reads the clean context into a KV cache, a bidirectional
    # decoder denoises one canvas (block) at a time reading it; see dare/models/canvas.py.
    attention: Literal["bidirectional", "block_causal", "encoder_decoder"] = "bidirectional"
    # Block-causal models: the block size the checkpoint was trained with (SDAR config key; LLaDA2 default 32);
    # encoder-decoder models: the canvas length.
    block_size: Optional[int] = None
    # Extra stop tokens (e.g. <|im_end|> / <|eot_id|> of chat checkpoints).
    stop_token_ids: list[int] = field(default_factory=list)
    # "mask": corrupted positions hold ``mask_token_id``; "uniform": they hold uniform random tokens of
    # ``[0, vocab_size)`` and the family has no mask token (``mask_token_id`` is -1). ``vocab_size`` (the model's
    # embedding rows) is also where LLaDA2.1's editing SFT draws its replacement tokens from.
    noise: Literal["mask", "uniform"] = "mask"
    vocab_size: Optional[int] = None
    # Logits are ``c * tanh(z / c)`` of the LM head's output (Gemma's final soft-capping); None = raw.
    logit_softcap: Optional[float] = None
    # The same weights also run causally, row i predicting token i + 1 (Nemotron-Labs-Diffusion's AR mode, trained
    # by its AR loss): the masked sampler's ``cache="causal"`` stores the context with it and seeds each block.
    causal_mode: bool = False

    @property
    def is_block_causal(self) -> bool:
        return self.attention == "block_causal"

    @property
    def is_encoder_decoder(self) -> bool:
        return self.attention == "encoder_decoder"

    @property
    def cache_kinds(self) -> tuple[str, ...]:
        # Approximate Fast-dLLM caches only make sense for bidirectional models; block models have an exact one
        # (encoder-decoder: "block" reuses the encoder cache across canvases, "none" re-encodes the context per canvas).
        if self.is_encoder_decoder:
            return ("none", "block")
        # block-causal: "dual" is the exact cache of finished blocks plus Fast-dLLM v2's approximate one inside a block
        if self.is_block_causal:
            return ("none", "block", "dual")
        # bidirectional, unshifted: also the exact caches of finished blocks ("causal" where the weights run causally)
        exact = () if self.shift_logits else ("block", "causal") if self.causal_mode else ("block",)
        return ("none", "prefix", "dual") + exact

    @property
    def attn_block_size(self) -> Optional[int]:
        """Block size the attention rule uses (None = one block = fully bidirectional)."""
        return self.block_size if self.is_block_causal else None

    @property
    def all_stop_ids(self) -> list[int]:
        ids = list(self.stop_token_ids)
        if self.eos_token_id is not None and self.eos_token_id not in ids:
            ids.insert(0, self.eos_token_id)
        return ids

    def prediction_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits aligned with the token they predict ([B, L, V]); Dream shifts right by one (row 0 reuses itself)."""
        if not self.shift_logits:
            return logits
        return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)

    def prediction_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Which raw logit row predicts each position (for computing logits only where a loss needs them)."""
        return (positions - 1).clamp_min(0) if self.shift_logits else positions

    # --- masks -------------------------------------------------------------------------------------
    def inference_mask(self, position_ids: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Dense bool mask for a (padded) inference batch: bidirectional or block-causal over absolute positions."""
        layout = masks.TokenLayout.plain(position_ids, valid)
        return masks.dense_mask(layout, layout, self.attn_block_size)

    def packed_layout(self, position_ids: torch.Tensor) -> masks.TokenLayout:
        """Packed training row(s): documents start where position ids restart at 0; no cross-document attention."""
        return masks.TokenLayout.plain(position_ids, doc=masks.doc_ids_from_positions(position_ids))

    def block_diffusion_layout(self, position_ids: torch.Tensor, packed: bool = True) -> masks.TokenLayout:
        """The ``[x_t ; x_0]`` training layout of block-diffusion models (length 2L, positions repeated)."""
        doc = masks.doc_ids_from_positions(position_ids) if packed else None
        return masks.block_diffusion_layout(position_ids, doc)

"""Blocks of a completion: the attention blocks its tokens fall in (the block-ELBO methods and SPG)."""
from __future__ import annotations

import torch


def completion_blocks(prompt_len: int, length: int, block_size: int) -> list[torch.Tensor]:
    """Completion indices ``0..length-1`` grouped by absolute block ``(prompt_len + k) // block_size``."""
    if length == 0:
        return []
    ids = (prompt_len + torch.arange(length)) // block_size
    return [torch.nonzero(ids == b).flatten() for b in torch.unique(ids)]

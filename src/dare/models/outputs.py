"""What a model forward returns, and for which rows: ``LogitsRequest`` in, ``ModelOutput`` out.

One request object says which rows of a forward get logits and/or final hidden states (B = batch, L = input
length, V = vocabulary, H = hidden size):

* ``rows``: ``None`` (every row), a ``slice`` of ``[0, L)`` (the same rows for every sequence: a sampler's block) or
  per-row positions ``[B, n]`` (long). Native models then compute the last layer's queries, attention and MLP only
  for those rows (every row still gives its keys and values): logits ``[B, n, V]``.
* ``keep``: bool ``[B, n]`` over the selected rows (``n = L`` when ``rows`` is None): only the kept rows, packed
  ``[k, V]`` in row-major order (``x[keep]``); native models run the last MLP, the final norm and the LM head for them
  alone (a sampler's still-masked positions, or the positions a loss reads).
* ``logits`` / ``hidden``: which of the two to return (the chunked log-probs read the hidden states and apply
  ``model.lm_head`` themselves, so they ask for ``LogitsRequest.hidden_states()``).

Every selection gives the rows exactly the bits they get in the full forward (tests/models/test_fused.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

# Rows of a forward: a slice of [0, L), or per-row positions [B, n] (long).
QuerySel = Union[slice, torch.Tensor]


@dataclass(frozen=True)
class LogitsRequest:
    rows: Optional[QuerySel] = None
    keep: Optional[torch.Tensor] = None
    logits: bool = True
    hidden: bool = False

    def __post_init__(self):
        if isinstance(self.rows, torch.Tensor) and (self.rows.dim() != 2 or self.rows.is_floating_point()
                                                    or self.rows.dtype == torch.bool):
            raise ValueError(f"LogitsRequest.rows must be a slice or per-row positions [batch, n] (long), got a "
                             f"{self.rows.dtype} tensor of shape {list(self.rows.shape)}")
        if self.keep is not None and (self.keep.dtype != torch.bool or self.keep.dim() != 2):
            raise ValueError(f"LogitsRequest.keep must be a bool mask [batch, rows], got a {self.keep.dtype} tensor "
                             f"of shape {list(self.keep.shape)}")
        if not (self.logits or self.hidden):
            raise ValueError("LogitsRequest asks for neither logits nor hidden states")

    @classmethod
    def hidden_states(cls, rows: Optional[QuerySel] = None) -> "LogitsRequest":
        """Final hidden states only (no LM head): for chunked linear + cross-entropy with ``model.lm_head``."""
        return cls(rows=rows, logits=False, hidden=True)

    def num_rows(self, length: int) -> int:
        """n: how many rows per sequence ``rows`` selects of a forward over ``length`` positions."""
        if self.rows is None:
            return length
        if isinstance(self.rows, slice):
            return len(range(length)[self.rows])
        return self.rows.shape[1]

    def check(self, batch: int, length: int) -> None:
        """Errors for a request that does not fit a forward over ``[batch, length]``."""
        n = self.num_rows(length)
        if isinstance(self.rows, torch.Tensor) and self.rows.shape[0] != batch:
            raise ValueError(f"LogitsRequest.rows must be [batch, n] with batch = {batch}, got {list(self.rows.shape)}")
        if self.keep is not None and tuple(self.keep.shape) != (batch, n):
            raise ValueError(f"LogitsRequest.keep must be [batch, selected rows] = {[batch, n]}, got "
                             f"{list(self.keep.shape)}")


ALL_LOGITS = LogitsRequest()


@dataclass
class ModelOutput:
    # [B, L, V] (every row), [B, n, V] (``request.rows``) or [k, V] (``request.keep``); None when not requested.
    logits: Optional[torch.Tensor]
    # Final hidden states (after the last norm), the same rows as ``logits``; None unless ``request.hidden``.
    hidden_states: Optional[torch.Tensor] = None

"""What a rollout returns: the decoded batch (``Rollout``) and, on request, its per-step record (``Trajectory``).

Its own module so the decode state (``state.py``) builds a ``Trajectory`` without importing the entry point
(``api.py``) that imports it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class Trajectory:
    """Per-step record of a rollout (MDPO, CJ-GRPO): S = the most steps any row took.

    ``states[n, s]`` is the completion before the row's step s (mask id where masked), ``x0[n, s]`` the
    prediction of that step (predicted tokens at the positions the step looked at, the state elsewhere),
    ``confidence[n, s]`` their confidences (MDPO running confidence with ``rcr``; 0 elsewhere).
    Rows that took fewer steps are padded; ``valid[n, s]`` marks real steps.
    """
    states: torch.Tensor  # [N, S, G]
    x0: torch.Tensor  # [N, S, G]
    confidence: torch.Tensor  # [N, S, G]
    num_steps: torch.Tensor  # [N]
    valid: torch.Tensor  # [N, S] bool


@dataclass
class Rollout:
    sequences: torch.Tensor  # [N, P+G] left-padded prompt + completion
    attention_mask: torch.Tensor  # [N, P+G]
    prompt_length: int  # padded prompt width P
    completion_ids: torch.Tensor  # [N, G] (positions never decoded after an early stop hold the EOS id)
    completion_mask: torch.Tensor  # [N, G] tokens up to and including the first stop token
    step_map: torch.Tensor  # [N, G] the row's denoising step that wrote each token (-1: never written)
    nfe: int  # model forward passes (one batched call = 1)
    prompt_index: torch.Tensor  # [N] input prompt of every row (samples of a prompt are adjacent)
    trajectory: Optional[Trajectory] = None
    # [N, G] float: entropy of the distribution each token was committed from (0: never written); ``Record.entropy``
    entropy_map: Optional[torch.Tensor] = None
    sample_index: Optional[torch.Tensor] = None  # [N] sample number within its prompt's group
    num_steps: Optional[torch.Tensor] = None  # [N] denoising steps each row took
    # [N] model forwards each row took part in (its NFE: what it costs decoded alone, whatever shared its batch)
    row_nfe: Optional[torch.Tensor] = None
    seeds: Optional[list[int]] = None  # per-row sampling seeds (None for deterministic decoding)
    stop_token_ids: tuple[int, ...] = ()
    # A paused rollout (``generate(until_step=...)``): the schedule point (block, step in block) where decoding
    # stopped; completions keep the mask id where nothing is committed yet; ``finished`` = rows already done.
    paused_at: Optional[tuple[int, int]] = None
    finished: Optional[torch.Tensor] = None
    # [N, G] bool: completion positions that held a hint (``generate(hints=...)``), given, not decoded; None: no hints
    hint_mask: Optional[torch.Tensor] = None

    @property
    def prompt_ids(self) -> torch.Tensor:
        return self.sequences[:, :self.prompt_length]

    @property
    def prompt_mask(self) -> torch.Tensor:
        return self.attention_mask[:, :self.prompt_length]

    def valid_lengths(self) -> torch.Tensor:
        """[N] completion tokens before the first stop token (the stop token itself not counted): the numerator of
        tokens per forward (TPF, docs/eval.md)."""
        G = self.completion_ids.shape[1]
        stops = torch.tensor(self.stop_token_ids, dtype=self.completion_ids.dtype, device=self.completion_ids.device)
        hit = torch.isin(self.completion_ids, stops)
        return torch.where(hit.any(1), hit.float().argmax(1), torch.full_like(hit[:, 0], G, dtype=torch.long)).long()

    def rows(self, idx: torch.Tensor) -> "Rollout":
        """The rollout of rows ``idx`` (repeats allowed): every per-row tensor field indexed, the rest kept."""
        N = self.completion_ids.shape[0]
        picked = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == N:
                picked[f.name] = v[idx]
        return dataclasses.replace(self, **picked)

    def texts(self, tokenizer, skip_special_tokens: bool = True) -> list[str]:
        """Completions as text, cut at the first stop token (which is not included)."""
        return decode_completions(tokenizer, self.completion_ids, self.completion_mask, self.stop_token_ids,
                                  skip_special_tokens)


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                       stop_token_ids: Sequence[int], skip_special_tokens: bool = True) -> list[str]:
    stops = set(int(t) for t in stop_token_ids)
    out = []
    for ids, m in zip(completion_ids.tolist(), completion_mask.bool().tolist()):
        kept = [t for t, keep in zip(ids, m) if keep]
        if kept and kept[-1] in stops:
            kept = kept[:-1]
        out.append(tokenizer.decode(kept, skip_special_tokens=skip_special_tokens))
    return out

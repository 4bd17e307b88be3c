"""TraceRL's diffusion value model (Wang et al. 2025; ``Gen-Verse/dLLM-RL``: ``train/init_sdar_value_model.py``,
``train/train_sdar_value.py``, ``train/train_sdar_policy.py``, ``configs/rl_sdar_with_value.yaml``).

**Model.** A copy of the policy's network whose last hidden states go through a linear head ``H -> 1`` (no bias,
zero-initialised, so every value starts at 0 and the first advantages are TraceRL's plain ones). It reads the same
replayed states as the policy: the value of a token is read where its prediction is made (the token's own row, the
previous row for Dream's shifted logits), i.e. in the state just before the step that decoded it.

**Returns and advantages** (``trace_returns_advantages``, ``compute_returns_and_advantages_from_fragments``): the
trace steps of a sample are its replay groups in time order (``ReplayPlan.transition``). The outcome reward r (the
group z-scored reward) is given to the tokens of the last step, so the step rewards are ``r*_s = r`` at the last step
and 0 before; ``V*_s`` is the mean old value of step s's tokens. Step-level GAE:
``R*_s = r*_s + g R*_{s+1}``, ``d*_s = r*_s - V*_s + g V*_{s+1}``, ``A*_s = d*_s + g l A*_{s+1}``; token level
``R_j = r_j + g R*_{s+1}``, ``A_j = (r_j - V_j) + g V*_{s+1} + g l A*_{s+1}``. With g = l = 1 (the configs) this is
``R_j = r`` and ``A_j = r - V_j``: a token-wise baseline.

**Value loss** (``forward_process`` of ``train_sdar_value.py``): ``0.5 max((V - R)^2, (V_clip - R)^2)`` with
``V_clip = V_old + clip(V - V_old, -eps, eps)`` (eps = the policy's clip, 0.2; ``losses.clipped_value_loss``), weighted per token like the policy
surrogate (each (sample, round) row summed over its targets and divided by the response length on block models).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..models import LogitsRequest


class ValueModel(nn.Module):
    """The policy's network (a copy) with a zero-initialised ``value_head``; ``forward`` returns per-position values."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.arch.hidden_size, 1, bias=False, device=lm.device, dtype=lm.dtype)
        nn.init.zeros_(self.value_head.weight)
        if not lm.arch.tie_word_embeddings:  # the LM head is never used: keep it out of the optimizer
            lm.lm_head.weight.requires_grad_(False)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> "ValueModel":
        """A value model initialised from the policy as it is now (the references' ``value_base_model``)."""
        return cls(copy.deepcopy(policy))

    @property
    def model(self):
        """The backbone (decoder layers): what ``dare.trainer.distributed.shard_model`` shards layer by layer."""
        return self.lm.model

    @property
    def adapter(self):
        return self.lm.adapter

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor, *, attention_mask=None, position_ids=None,
                layout=None) -> torch.Tensor:
        """Values ``[B, L]`` (fp32, zero elsewhere) at the ``targets [B, L]`` positions, read from the rows that
        predict them (``adapter.prediction_rows``), as ``score_targets`` reads log-probs."""
        out = self.lm(input_ids, attention_mask=attention_mask, position_ids=position_ids, layout=layout,
                      request=LogitsRequest.hidden_states())
        b, col = targets.nonzero(as_tuple=True)
        rows = self.adapter.prediction_rows(col)
        values = self.value_head(out.hidden_states[b, rows]).squeeze(-1).float()
        dense = torch.zeros(targets.shape, dtype=torch.float32, device=values.device)
        return dense.index_put((b, col), values)


def view_values(value_model: nn.Module, view) -> torch.Tensor:
    """Values of a ``View``'s targets mapped to its slots (``[B, K]``, zero outside the targets)."""
    dense = value_model(view.input_ids, view.targets, attention_mask=view.attention_mask,
                        position_ids=view.position_ids, layout=view.layout)
    return dense.gather(1, view.score_index) if view.score_index is not None else dense


def trace_returns_advantages(rewards: torch.Tensor, old_values: torch.Tensor, steps: torch.Tensor,
                             gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token returns and advantages ``[B, L]`` from outcome ``rewards [B]``, ``old_values [B, L]`` and each token's
    trace step ``steps [B, L]`` (any increasing ids; -1 = not trained: return and advantage 0)."""
    B, L = steps.shape
    dev = old_values.device
    tok = steps >= 0
    step_rank = torch.full((B, L), -1, dtype=torch.long)  # dense ranks 0 .. S_b - 1 of each row's steps
    for i in range(B):
        if bool(tok[i].any()):
            step_rank[i, tok[i].cpu()] = torch.unique(steps[i][tok[i]].cpu(), return_inverse=True)[1]
    rank = step_rank.clamp_min(0).to(dev)
    S = int(step_rank.max().item()) + 1 if bool(tok.any()) else 0
    if S == 0:
        zero = torch.zeros(B, L, device=dev)
        return zero, zero
    w = tok.to(dev).double()
    count = torch.zeros(B, S, dtype=torch.float64, device=dev).scatter_add_(1, rank, w)
    v_sum = torch.zeros(B, S, dtype=torch.float64, device=dev).scatter_add_(1, rank, old_values.double() * w)
    exists = count > 0
    v_star = torch.where(exists, v_sum / count.clamp_min(1.0), torch.zeros_like(v_sum))
    last = (step_rank.max(dim=1).values).to(dev)  # each row's last trace step (-1: a row without targets)
    steps = torch.arange(S, device=dev)[None]
    r_star = torch.where(steps == last[:, None], rewards.double().to(dev)[:, None], torch.zeros(B, S, dtype=torch.float64, device=dev))
    # Backward recursions over the step axis; the step after a row's last one has R* = V* = A* = 0.
    R_next = torch.zeros(B, S + 1, dtype=torch.float64, device=dev)
    V_next = torch.zeros(B, S + 1, dtype=torch.float64, device=dev)
    A_next = torch.zeros(B, S + 1, dtype=torch.float64, device=dev)
    V_next[:, :S] = v_star
    for s in range(S - 1, -1, -1):
        R_next[:, s] = r_star[:, s] + gamma * R_next[:, s + 1]
        delta = r_star[:, s] - v_star[:, s] + gamma * V_next[:, s + 1]
        A_next[:, s] = delta + gamma * lam * A_next[:, s + 1]
    nxt = (rank + 1).clamp_max(S)
    r_tok = torch.where(rank == last[:, None], rewards.double().to(dev)[:, None], torch.zeros(B, L, dtype=torch.float64, device=dev))
    returns = r_tok + gamma * R_next.gather(1, nxt)
    adv = (r_tok - old_values.double()) + gamma * V_next.gather(1, nxt) + gamma * lam * A_next.gather(1, nxt)
    zero = torch.zeros(B, L, dtype=torch.float64, device=dev)
    return torch.where(tok.to(dev), returns, zero).float(), torch.where(tok.to(dev), adv, zero).float()

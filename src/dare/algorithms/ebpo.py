"""EBPO: block-level ELBO policy optimisation for block-diffusion models (LLaDA2.1, Bie et al. 2026; algorithms.md 12).

⚠ Paper-level only (dFactory ships SFT code only); choices are documented in docs/algorithms/ebpo.md and follow
DARE's port (``ebpo_actor_mixin.py``, ``_forward_process_ebpo``) where the paper is silent.

Likelihood: the composite block ELBO ``B = sum_n w_n sum_b ELBO_b(t_n)`` of the completion (up to the first EOS;
post-EOS positions always masked, i.e. marginalised). Blocks are the model's attention blocks over absolute
positions (``adapter.block_size``; the prompt's tail may share the first completion block and is never masked).
For each of ``num_mc`` noise levels ``t_n = (n + u)/N`` (stratified, one uniform offset u per sequence) every block
is noised at once: block b with n_b completion tokens gets ``m = min(floor(t_n n_b) + 1, n_b)`` masked tokens (at
least one, so every block contributes), each weighted ``n_b / m`` (LLaDA's count form of the 1/t weight), and
``w_n = 1/N``. One forward per t_n computes all K block terms with the ``[x_t ; x_0]`` layout: noisy block b sees
itself and the clean blocks before it, exactly ``log p(y^b | z_n^b, y^{<b}, x)`` ("vectorised likelihood").

Loss: ESPO's sequence-level clipped ratio ``rho = exp((B_theta - B_old)/L)`` (length-normalised: the safe default
of the spec; DARE's port uses the raw composite difference), optional KL on the raw composite ELBO / L, and the
exact two-pass backward (memory O(1) in ``num_mc``). Noise keyed by (iteration, uid) is shared by the current,
old and reference policies (the antithetic principle). Block-causal models, and uniform-noise encoder-decoder models
(DiffusionGemma) whose blocks are the canvases, counted from the completion start, with corrupted positions holding
uniform random tokens (the same count weights: docs/algorithms/uniform_noise.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .base import StepContext, cost
from .batch import RLBatch, View
from .common.blocks import completion_blocks
from .common.elbo import SequenceRatioAlgorithm, elbo_view, random_subset
from .grpo import AdvantageMode, GRPOConfig
from .paper import PaperSettings
from .registry import register_algorithm


@dataclass
class EBPOConfig(GRPOConfig):
    name: str = "ebpo"
    num_mc: int = cost(16, "mc_samples")  # noise levels t_n = forwards per sequence and inner iteration
    clip_low: float = 0.2
    kl_estimator: Literal["k1", "k2", "k3"] = "k2"
    advantage: AdvantageMode = "mean_std"
    advantage_eps: float = 1e-6
    two_pass_backward: bool = True  # memory O(1) in num_mc; needs a deterministic forward (no dropout)

    def __post_init__(self):
        super().__post_init__()
        if self.num_mc < 1:
            raise ValueError(f"num_mc must be >= 1, got {self.num_mc}")


def ebpo_masks(ctx: StepContext, batch: RLBatch, iteration: int, n: int):
    """(masked ``[N, B, Lc]``, weight ``[N, B, Lc]`` = n_b/(m N) on masked tokens, t ``[N, B]``)."""
    bs = ctx.adapter.block_size
    offset = not ctx.adapter.is_encoder_decoder  # canvases start at the completion; attention blocks at position 0
    if not bs:
        raise ValueError("ebpo needs the model's block size (model.adapter.block_size)")
    valid = batch.completion_mask.bool().cpu()
    prompt_len = batch.prompt_mask.bool().sum(-1).cpu()
    B, Lc = valid.shape
    masked = torch.zeros(n, B, Lc, dtype=torch.bool)
    weight = torch.zeros(n, B, Lc)
    t = torch.zeros(n, B)
    for i, uid in enumerate(batch.uid.tolist()):
        blocks = completion_blocks(int(prompt_len[i]) * offset, int(valid[i].sum()), bs)
        u = float(torch.rand((), generator=ctx.generator(iteration, uid, "ebpo_t"), dtype=torch.float64))
        for k in range(n):
            g = ctx.generator(iteration, uid, k)
            t[k, i] = tk = (k + u) / n
            for pos in blocks:
                nb = pos.numel()
                m = min(int(tk * nb) + 1, nb)
                chosen = random_subset(pos, m, g)
                masked[k, i, chosen] = True
                weight[k, i, chosen] = nb / (m * n)
    dev = batch.completion_ids.device
    return masked.to(dev), weight.to(dev), t.to(dev)


@register_algorithm
class EBPO(SequenceRatioAlgorithm):
    """Composite block ELBO: every block noised at each stratified level t_n, one [x_t ; x_0] forward per level."""
    name = "ebpo"
    paper = PaperSettings(
        lr=1e-6, grad_clip=1.0, temperature=1.0,
        published_code=False,
        source="no published training code (LLaDA2.1; dFactory ships SFT only): DARE's unified RL settings (scripts/make_paper_recipes.py)")
    config_class = EBPOConfig
    supports: ClassVar[tuple[str, ...]] = ("block_causal", "encoder_decoder")

    @property
    def mc_samples(self) -> int:
        return self.config.num_mc

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        masked, weight, t = ebpo_masks(ctx, batch, iteration, self.config.num_mc)
        return [elbo_view(ctx, batch, masked[k], weight[k], 0, {"t": t[k], "noise_key": (iteration, k)})
                for k in range(self.config.num_mc)]

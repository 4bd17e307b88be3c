"""SPG -- Sandwiched Policy Gradient (Wang et al. 2025; algorithms.md section 7; reference facebookresearch/SPG).

Masking (``forward_type``; ``num_t`` draws per sample and inner iteration, each one forward). With ``block_random``
(the default): pick a block ``b*`` among the ``block_length`` blocks that hold completion tokens (up to the first
EOS); keep earlier blocks clean, mask a uniform count ``m ~ U{max(1, floor(n min_t)) .. min(floor(n max_t), n)}`` of
the n valid tokens of ``b*``, mask every later block; post-EOS positions are always masked; the prompt and the earlier
blocks are masked i.i.d. with ``p_mask_prompt`` (a regulariser, as in d1). ``block_all`` masks ``b*`` entirely,
``random`` masks a uniform count of the whole completion, ``all`` is d1's all-masked view.

Bounds, over the scored tokens of draw j (masked completion tokens up to the first EOS):

* ELBO (positive advantages): ``mean_j [ mean_{k masked in z_j} logp_k(z_j) ]``;
* EUBO (upper bound, for A <= 0): ``q_k = mean_j [ p_k(z_j)^beta_e 1[k masked in z_j] / t_j ]`` with the empirical
  mask ratio ``t_j = #masked / #completion``, ``U = (1/beta_e) mean_{k: q_k > 0} log q_k`` (computed in log space);
* ``logp_estimation``: ``eubo``, ``mix`` (``w U + (1 - w) ELBO``, default), ``elbo`` or ``zero`` for negatives.

Loss: no ratio, clipping or KL (``beta != 0`` is an error); length-weighted sequence policy gradient
``L = -sum_i A_i len_i Lhat_i / sum_i len_i`` with ``Lhat_i`` the ELBO if ``A_i > 0`` else the negative-branch bound,
``A = r - mean``. Inner iterations reuse the rollouts with fresh masks and no importance correction. Defaults follow
``spg/slurm_scripts/spg_mix/*`` + ``train.yaml`` (mu 4, num_t 2, block 32, p 0.15, mix 0.5, beta_e 1.5).

Block-diffusion models: the blocks are the model's own attention blocks (``adapter.block_size`` over absolute
positions, so the first completion block may share the prompt's tail; ``block_length`` is the masked models'
semi-autoregressive block). The masks are drawn the same way over x_t and every view is scored over the
``[x_t ; x_0]`` layout: each masked token of block b is predicted from x_t's block b and the clean blocks before it,
so b* is scored exactly as the block sampler meets it (clean prefix, partly masked block) and every later block by
d1's block estimate. ELBO and EUBO are the same per-token functions of those log-probs. Uniform-noise models
(DiffusionGemma): the blocks are the canvases (``adapter.block_size`` from the completion start), corrupted positions
hold uniform random tokens; the ELBO and EUBO are bounds over the corruption indicators, so they keep their form
(docs/algorithms/uniform_noise.md). The masked prompt is the
condition of every block (both halves); the p-masked tokens of earlier blocks are masked (and scored) in x_t only,
since the block NELBO conditions on the clean prefix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from .base import StepContext, cost
from .batch import LogLik, RLBatch, View
from .common.blocks import completion_blocks
from .common.scoring import score_views
from .common.views import completion_view
from .grpo import GRPOAlgorithm, GRPOConfig
from .paper import GridAdjust, PaperSettings
from .registry import register_algorithm

ForwardType = Literal["all", "random", "block_all", "block_random"]


@dataclass
class SPGConfig(GRPOConfig):
    name: str = "spg"
    inner_iterations: int = cost(4, "iterations")
    forward_type: ForwardType = "block_random"
    num_t: int = cost(2, "mc_samples")  # masked draws (forwards) per sample and inner iteration
    min_t: float = 0.0
    max_t: float = 1.0
    block_length: int = 32  # masked models: the rollout's semi-autoregressive block (block models: adapter.block_size)
    p_mask_prompt: float = 0.15  # 0 disables prompt / earlier-block masking (use_mask_prompt: false)
    logp_estimation: Literal["elbo", "eubo", "mix", "zero"] = "mix"
    mix_weight: float = 0.5
    eubo_beta: float = 1.5

    def __post_init__(self):
        super().__post_init__()
        if self.beta != 0.0:
            raise ValueError(f"spg has no KL term (the reference raises NotImplementedError); set beta to 0, got {self.beta}")
        if self.num_t < 1:
            raise ValueError(f"num_t must be >= 1, got {self.num_t}")
        if not 0.0 <= self.min_t <= self.max_t <= 1.0:
            raise ValueError(f"need 0 <= min_t <= max_t <= 1, got min_t={self.min_t}, max_t={self.max_t}")
        if self.block_length < 1:
            raise ValueError(f"block_length must be >= 1, got {self.block_length}")
        if not 0.0 <= self.p_mask_prompt <= 1.0:
            raise ValueError(f"p_mask_prompt must be in [0, 1], got {self.p_mask_prompt}")
        if self.eubo_beta <= 0:
            raise ValueError(f"eubo_beta must be > 0, got {self.eubo_beta}")
        if not 0.0 <= self.mix_weight <= 1.0:
            raise ValueError(f"mix_weight must be in [0, 1], got {self.mix_weight}")


def _uniform_count(n: int, lo_frac: float, hi_frac: float, gen: torch.Generator) -> int:
    """SPG's mask count for n tokens: uniform in {max(1, floor(n lo)) .. min(floor(n hi), n)}."""
    lo = max(int(n * lo_frac), 1)
    hi = max(min(int(n * hi_frac), n), lo)  # max_t * n < 1 would give an empty range; mask one token then
    return int(torch.randint(lo, hi + 1, (1,), generator=gen))


def _choose(positions: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    return positions[torch.randperm(positions.numel(), generator=gen)[:count]]


def block_spans(length: int, block_length: int, prompt_len: int = 0, block_size=None) -> list[tuple[int, int]]:
    """The completion's blocks as ``[start, end)`` over its first ``length`` positions (at least one, maybe empty).

    Masked models (``block_size`` None): consecutive ``block_length`` blocks from the completion start. Block models:
    the model's attention blocks over absolute positions (the first one may begin inside the prompt).
    """
    if block_size:
        spans = [(int(pos[0]), int(pos[-1]) + 1) for pos in completion_blocks(prompt_len, length, block_size)]
    else:
        spans = [(b * block_length, min((b + 1) * block_length, length)) for b in range(math.ceil(length / block_length))]
    return spans or [(0, 0)]


def spg_masks(ctx: StepContext, cfg: SPGConfig, batch: RLBatch, iteration: int):
    """Per draw j: (prompt mask ``[B, P]``, completion mask ``[B, Lc]``, chosen block ``[B]`` or -1)."""
    prompt_real = batch.prompt_mask.bool().cpu()
    valid = batch.completion_mask.bool().cpu()
    B, Lc = valid.shape
    block_size = ctx.adapter.block_size if ctx.adapter.is_block_causal else None
    if ctx.adapter.is_block_causal and not block_size:
        raise ValueError("spg on a block-diffusion model needs the model's block size (model.adapter.block_size)")
    block_length = ctx.adapter.block_size if ctx.adapter.is_encoder_decoder else cfg.block_length  # canvases
    out = [(torch.zeros_like(prompt_real), torch.zeros(B, Lc, dtype=torch.bool), torch.full((B,), -1, dtype=torch.long))
           for _ in range(cfg.num_t)]
    idx = torch.arange(Lc)
    for i, uid in enumerate(batch.uid.tolist()):
        L = int(valid[i].sum())
        spans = block_spans(L, block_length, int(prompt_real[i].sum()), block_size)
        n_blocks = len(spans)
        # Distinct blocks for the draws while num_t <= n_blocks (the reference permutes the blocks too).
        block_order = torch.randperm(n_blocks, generator=ctx.generator(iteration, uid, "spg_blocks"))
        for j in range(cfg.num_t):
            g = ctx.generator(iteration, uid, j)
            comp = ~valid[i].clone()  # post-EOS positions are always masked
            regular = torch.zeros(Lc, dtype=torch.bool)  # clean context eligible for p-masking (besides the prompt)
            if cfg.forward_type == "all":
                comp[:] = True
            elif cfg.forward_type == "random":
                comp[_choose(idx[valid[i]], _uniform_count(L, cfg.min_t, cfg.max_t, g), g)] = True
            else:
                b = int(block_order[j % n_blocks])
                start, end = spans[b]
                comp[end:] = True  # later blocks (and the invalid tail of b*)
                regular[:start] = True
                if cfg.forward_type == "block_all":
                    comp[start:end] = True
                else:
                    comp[_choose(idx[start:end], _uniform_count(end - start, cfg.min_t, cfg.max_t, g), g)] = True
                out[j][2][i] = b
            if cfg.p_mask_prompt > 0:
                n_p = int(prompt_real[i].sum())
                out[j][0][i, prompt_real[i]] = torch.rand(n_p, generator=g) < cfg.p_mask_prompt
                comp |= regular & (torch.rand(Lc, generator=g) < cfg.p_mask_prompt)
            out[j][1][i] = comp
    dev = batch.completion_ids.device
    return [(p.to(dev), c.to(dev), b.to(dev)) for p, c, b in out]


def spg_bounds(logp: torch.Tensor, scored: torch.Tensor, valid: torch.Tensor, eubo_beta: float):
    """(ELBO ``[B]``, EUBO ``[B]``) from per-draw token log-probs ``logp [J, B, Lc]`` and scored masks ``[J, B, Lc]``."""
    n_scored = scored.sum(-1)  # [J, B]
    elbo = ((logp * scored).sum(-1) / n_scored.clamp_min(1)).mean(0)
    t_hat = n_scored.float() / valid.sum(-1).clamp_min(1).float()  # empirical mask ratio per draw
    # log q_k = log mean_j [ p_jk^beta / t_j ] over the draws that mask k (exact log-space form of the reference).
    terms = eubo_beta * logp - torch.log(t_hat.clamp_min(1e-8))[..., None]
    hit = scored.any(0)  # q_k > 0
    terms = torch.where(scored, terms, torch.full_like(terms, float("-inf")))
    terms = torch.where(hit[None], terms, torch.zeros_like(terms))  # keep logsumexp finite where no draw masks k
    log_q = torch.logsumexp(terms, dim=0) - math.log(logp.shape[0])
    eubo = (log_q * hit).sum(-1) / hit.sum(-1).clamp_min(1) / eubo_beta
    return elbo, eubo


@register_algorithm
class SPG(GRPOAlgorithm):
    """Block-random masks; ELBO (mean masked-token logp) for A > 0, EUBO / mix upper bound for A <= 0; no ratio."""
    name = "spg"
    paper = PaperSettings(
        lr=3e-6, grad_clip=0.2, temperature=0.9, lora={"r": 128, "alpha": 64},
        published_code=True,
        source="facebookresearch/SPG spg/slurm_scripts/train.yaml (lr, max_grad_norm, use_peft); spg_mix/sudoku_new_base_spg_mix_beta1.0_weight0.5.sbatch (NUM_ITER=4, --temperature 0.3, --eubo_beta 1.0)",
        per_task={"sudoku": {"temperature": 0.3, "algorithm": {"inner_iterations": 4, "eubo_beta": 1.0}}})
    grid = GridAdjust("SPG's EUBO beta per task (spg_mix scripts: 1.5 gsm8k/math, 2.0 countdown, 1.0 sudoku); "
                      "train.micro_batch_size a quarter of the task's: SPG scores a micro-batch's 16 draws in one forward "
                      "(16 sequences per forward at math, 32 at countdown), and at the task's micro-batch the 64-128 "
                      "sequences' activations would not fit beside LLaDA2.0-mini's states (dare plan)",
                      per_task={"math": {"eubo_beta": 1.5}, "code": {"eubo_beta": 1.5}, "countdown": {"eubo_beta": 2.0},
                                "sudoku": {"eubo_beta": 1.0}}, micro_batch_divisor=4)
    config_class = SPGConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")

    @property
    def needs_old_logp(self) -> bool:
        return False  # no ratio: inner iterations reuse rollouts without importance correction

    @property
    def needs_reference(self) -> bool:
        return False

    @property
    def mc_samples(self) -> int:
        return self.config.num_t

    def corrupt(self, ctx: StepContext, batch: RLBatch, iteration: int) -> list[View]:
        prompt, comp, valid = batch.prompt_ids, batch.completion_ids, batch.completion_mask.bool()
        uid = batch.uid
        views = []
        for j, (pm, cm, block) in enumerate(spg_masks(ctx, self.config, batch, iteration)):
            scored = cm & valid
            t_hat = scored.sum(-1).float() / valid.sum(-1).clamp_min(1).float()
            views.append(completion_view(ctx, batch, ctx.corrupt(comp, cm, uid, iteration, j, "completion"), scored,
                                         prompt_input=ctx.corrupt(prompt, pm, uid, iteration, j, "prompt",
                                                                  valid=batch.prompt_mask),
                                         info={"block": block, "t_hat": t_hat, "prompt_masked": pm}))
        return views

    def log_likelihood(self, ctx: StepContext, model, batch: RLBatch, views: list[View], *, with_entropy: bool = False) -> LogLik:
        """Value ``[B, 2]``: column 0 the ELBO (positive branch), column 1 the negative-branch bound."""
        cfg = self.config
        logps, scored = [], []
        # One forward for all draws (``score_views``): num_t forwards of one graph would hold every layer's unsharded
        # gradient under FSDP2 until the last draw's backward (LLaDA2.0-mini: 32.5 GiB per GPU, ``dare plan``).
        for v, (lp, _) in zip(views, score_views(model, views, ctx.chunk_size)):
            logps.append(lp.gather(1, v.score_index))
            scored.append(v.targets.gather(1, v.score_index))
        logp, scored = torch.stack(logps), torch.stack(scored)
        valid = batch.completion_mask.bool().to(logp.device)
        elbo, eubo = spg_bounds(logp, scored, valid, cfg.eubo_beta)
        neg = {"eubo": eubo, "mix": cfg.mix_weight * eubo + (1.0 - cfg.mix_weight) * elbo, "elbo": elbo,
               "zero": torch.zeros_like(elbo)}[cfg.logp_estimation]
        return LogLik(torch.stack([elbo, neg], dim=1))

    def loss(self, ctx: StepContext, batch: RLBatch, current: LogLik, iteration: int):
        value = current.value
        adv = batch.advantages.values.to(value.device).float()
        positive = adv > 0  # the reference's reward_mask
        bound = torch.where(positive, value[:, 0], value[:, 1])
        length = self.loss_mask(batch).sum(-1).to(value.device)  # completion length, 0 for filtered groups
        loss = -(adv * length * bound).sum() / max(ctx.norms["tokens"], 1.0)
        seqs = max(ctx.norms["seqs"], 1.0)
        active = batch.active.float().to(value.device)
        metrics = {"elbo": float((value[:, 0].detach() * active).sum()) / seqs,
                   "neg_bound": float((value[:, 1].detach() * active).sum()) / seqs,
                   "positive_frac": float((positive.float() * active).sum()) / seqs}
        return loss, metrics

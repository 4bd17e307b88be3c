"""Loss-parity cases of IGPO (facebookresearch/igpo ``trainer_igpo.py``; docs/loss_parity.md).

``IGPOTrainer.compute_loss`` takes the per-token log-probs from ``_get_per_token_logps_grpo`` (replaced by the leaf),
the stored old / reference log-probs of the inner iteration ``_step % num_iterations`` and the loss mask
``masked_token_mask`` that ``_generate_and_score_completions`` built: under the released ``d1_masking`` every
completion position, with the entropy filter applied to the hint positions. That filter is a block inside the
750-line generation function; ``source_block`` runs its exact lines on the case's hint mask and old-policy entropies.

* ``igpo``: the released configuration (GSPO sequence ratio, mu 4, clip 0.2 / 0.2, beta 0.01, entropy keep 0.2) on a
  batch with hinted rollouts; dare in its ``score_hints`` mode (the reference's treatment of hints).
* ``igpo_hints_unscored``: dare's default (hints never scored) with the token ratio (``use_gspo`` false): the
  reference loss on a mask without any hint position is exactly dare's loss on the generated tokens.

Completions have no stop token: the reference scores post-EOS positions and dare does not (a documented deviation).
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch

from loss_parity_lib import (case, centred, load_reference, log_probs, perturbed, record, repository, rl_inputs,
                             source_block, trainer)

IGPO = repository("igpo", "facebookresearch/igpo")

REL = "trainer_igpo.py"
SEQ_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "group")


def _hints(g: torch.Generator, B: int, L: int) -> torch.Tensor:
    hint = torch.rand(B, L, generator=g) < 0.5
    hint[1] = False  # rollouts without hints (the group's own) in every case
    hint[4] = False
    return hint


def _inputs(g: torch.Generator, x: dict, mu: int):
    B, L = x["completion_ids"].shape
    logp = log_probs(g, B, L).requires_grad_()
    old, ref_lp = perturbed(g, logp.detach(), scale=0.1), perturbed(g, logp.detach(), scale=0.1)
    others = [perturbed(g, logp.detach()) for _ in range(mu)]  # the other iterations' stored values: never read
    adv = centred(torch.randn(B, generator=g, dtype=torch.float64), x["group"])
    return logp, old, ref_lp, others, adv


def _run(mod, x: dict, logp, old, ref_lp, others, adv, token_mask, inpaint, mu: int, itr: int, use_gspo: bool):
    B, L = x["completion_ids"].shape
    old_all, ref_all = torch.stack(others), torch.stack(list(reversed(others)))
    old_all[itr], ref_all[itr] = old, ref_lp
    tr = trainer(mod.IGPOTrainer, _step=itr, num_iterations=mu, beta=0.01,
                 args=SimpleNamespace(num_iterations=mu, use_gspo=use_gspo, epsilon_low=0.2, epsilon_high=0.2),
                 _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                 control=SimpleNamespace(should_evaluate=False),
                 _get_per_token_logps_grpo=lambda model, ids, keep, steps, seeds, masks: (
                     logp.unsqueeze(0), None, torch.zeros(1, B, L)))
    inputs = {**{k: x[k] for k in SEQ_KEYS}, "inpaint_masks": inpaint, "timesteps": [128] * mu,
              "mask_seeds": [42] * mu, "masked_token_mask": token_mask, "old_per_token_logps": old_all,
              "ref_per_token_logps": ref_all, "advantages": adv}
    return tr.compute_loss(None, inputs)


@case("igpo", IGPO)
def igpo(ref):
    mod = load_reference(ref.file(REL), "igpo")
    x = rl_inputs(seed=31, eos_rows=0)
    g = x.pop("generator")
    B, L = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    mu, itr = 4, 1
    logp, old, ref_lp, others, adv = _inputs(g, x, mu)
    hint = _hints(g, B, L)
    entropy = torch.rand(B, L, generator=g)  # the rollout policy's entropies (the same at every iteration)
    inpaint = torch.cat([torch.ones(B, P, dtype=torch.bool), hint], 1)  # fixed positions: the prompt and the hints
    # d1_masking: every completion position is masked at every iteration; then the authors' own filter
    masked = torch.ones(mu, B, L, dtype=torch.uint8)
    block = source_block(ref.file(REL), "# Apply entropy-based filtering for inpainted tokens",
                         "# Decode completions and compute rewards", torch=torch, inpaint_masks=inpaint,
                         logits_to_keep=L, masked_token_mask=masked, all_per_token_entropy=entropy.expand(mu, B, L),
                         self=SimpleNamespace(num_iterations=mu,
                                              args=SimpleNamespace(entropy_clipping_ratio_inpaint=0.2)))
    loss = _run(mod, x, logp, old, ref_lp, others, adv, block["filtered_masked_token_mask"], inpaint, mu, itr,
                use_gspo=True)
    config = dict(inner_iterations=mu, clip_low=0.2, clip_high=0.2, beta=0.01, kl_estimator="k3",
                  kl_target="reference", aggregation="token_mean", sequence_ratio=True, score_hints=True,
                  hint_entropy_keep=0.2)
    return record("igpo", config, {**{k: x[k] for k in SEQ_KEYS}, "advantages": adv, "old_logp": old,
                                   "ref_logp": ref_lp, "hint_mask": hint, "entropy": entropy},
                  {"logp": logp}, loss,
                  ref.meta(REL, "_generate_and_score_completions (entropy filter block, l.1764-1827) -> "
                                "IGPOTrainer.compute_loss (GSPO ratio, clip, k3 KL, token mean)"),
                  runner="igpo", note="inner iteration 1 of 4; dare's score_hints mode is the reference's treatment "
                                      "of hints (masked and scored, entropy-filtered)")


@case("igpo_hints_unscored", IGPO)
def igpo_hints_unscored(ref):
    mod = load_reference(ref.file(REL), "igpo_hints_unscored")
    x = rl_inputs(seed=32, eos_rows=0)
    g = x.pop("generator")
    B, L = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    mu, itr = 4, 2
    logp, old, ref_lp, others, adv = _inputs(g, x, mu)
    hint = _hints(g, B, L)
    inpaint = torch.cat([torch.ones(B, P, dtype=torch.bool), hint], 1)
    generated = (~hint).to(torch.uint8).expand(mu, B, L).contiguous()  # no hint position in the loss
    loss = _run(mod, x, logp, old, ref_lp, others, adv, generated, inpaint, mu, itr, use_gspo=False)
    config = dict(inner_iterations=mu, clip_low=0.2, clip_high=0.2, beta=0.01, kl_estimator="k3",
                  kl_target="reference", aggregation="token_mean", sequence_ratio=False, score_hints=False)
    return record("igpo", config, {**{k: x[k] for k in SEQ_KEYS}, "advantages": adv, "old_logp": old,
                                   "ref_logp": ref_lp, "hint_mask": hint}, {"logp": logp}, loss,
                  ref.meta(REL, "IGPOTrainer.compute_loss (token ratio: use_gspo false) with a loss mask of the "
                                "generated positions"),
                  runner="igpo", note="dare's default never scores hints; with the token ratio that is the "
                                      "reference's loss on the generated positions alone")

"""Loss-parity cases of JustGRPO and d-TreeRPO (docs/loss_parity.md).

JustGRPO: the authors' ``logprob_loss`` (LeapLabTHU/JustGRPO ``grpo.py``) runs one forward per completion position
and back-propagates each position's term at once; a stand-in model returns, for the state of position t (read from
the number of trailing masks), logits whose log-softmax at the completion token is the leaf, and a stand-in
accelerator records the back-propagated terms (their sum is the loss). The advantages come from the authors'
``compute_group_advantages`` on the rewards.

d-TreeRPO: the authors' ``DTreeRPOTrainer.compute_loss`` (THU-BPM/d-TreeRPO ``dtreerpo_trainer.py``) scores every
segment from its parent's state (``get_logits`` of the parent ids) and adds the self-distillation term, which reads the
parent's log-probabilities of *every* child's token. The stand-in ``get_logits`` therefore returns, per parent state
and position, one distribution holding each child's token at its leaf log-prob (siblings never share a token at a
position here, so each leaf is one entry), with the rest of the mass on token ``OTHER``.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from loss_parity_lib import repository, case, load_reference, log_probs, perturbed, record, rl_inputs, trainer
from tests.algorithms.parity_io import EOS, FILLER, MASK_ID, OTHER, VOCAB, embed_logp

JUSTGRPO = repository("justgrpo", "LeapLabTHU/JustGRPO")
DTREERPO = repository("dtreerpo", "THU-BPM/d-TreeRPO")

SEQ_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


@case("justgrpo", JUSTGRPO)
def justgrpo(ref):
    rel = "grpo.py"
    mod = load_reference(ref.file(rel), "justgrpo")
    n_prompts, G, P, L = 2, 4, 4, 6
    x = rl_inputs(seed=31, n_groups=n_prompts, group=G, prompt_len=P, gen_len=L)
    g = x.pop("generator")
    B = n_prompts * G
    # The reference repeats the prompt batch G times (row r holds prompt r % n_prompts): reorder the groups so.
    order = torch.arange(B).view(n_prompts, G).t().reshape(-1)
    x = {k: v[order] for k, v in x.items()}
    x["group"] = torch.arange(B) % n_prompts
    x["rewards"] = torch.rand(B, generator=g, dtype=torch.float64).round(decimals=1)
    x["rewards"][0] = x["rewards"][n_prompts]  # a tie within a group
    logp = log_probs(g, B, L).requires_grad_()
    comp = x["completion_ids"]
    gen = torch.cat([x["prompt_ids"], comp], 1)
    logits_all = embed_logp(logp, comp)  # [B, L, V]

    def model(ids):  # the state of position t: t completion tokens, then L - t masks
        t = L - int((ids[0, P:] == MASK_ID).sum())
        out = torch.full((B, P + L, VOCAB), FILLER, dtype=torch.float64)
        out[:, P + t] = logits_all[:, t]
        return SimpleNamespace(logits=out)

    terms = []

    def backward(t):
        terms.append(t)
        t.backward(retain_graph=True)

    acc = SimpleNamespace(gather=lambda v: v, backward=backward)
    adv = mod.compute_group_advantages(x["rewards"], G)
    valid = (adv != 0).sum()
    mod.logprob_loss(model, {"advantages": adv, "generated_ids": gen, "prompt_len": P, "rewards": x["rewards"]},
                     valid, eps=0.2, gain=1.0, temperature=1.0, accelerator=acc, gen_length=L, mask_id=MASK_ID)
    loss = torch.stack(terms).sum()
    logp.grad = None  # record() differentiates the summed terms again
    config = dict(inner_iterations=1, clip_low=0.2, clip_high=None, beta=0.0, advantage="mean_std", advantage_eps=1e-4,
                  aggregation="seq_mean_token_sum_norm", valid_eps=1e-5, post_tokens=None)
    inputs = {**{k: x[k] for k in SEQ_KEYS}, "group": x["group"], "rewards": x["rewards"]}
    return record("justgrpo", config, inputs, {"logp": logp}, loss,
                  ref.meta(rel, "compute_group_advantages, logprob_loss (one backward per position)"),
                  runner="token_grpo",
                  note="every position of every row is scored (the reference scores all gen_length positions; dare's "
                       "post_tokens=null with every position written); prompts unpadded (the reference passes no "
                       "attention mask)")


def _tree_segments(g: torch.Generator, P: int, L: int):
    """Two parents (an all-masked root state and a partial one) with three children each; siblings commit different
    tokens at every position they share. Returns parent ids, child ids, group ids [6] and token tables."""
    from tests.algorithms.parity_io import FIRST_TOKEN
    prompt = torch.randint(FIRST_TOKEN, VOCAB, (P,), generator=g)
    partial = torch.full((L,), MASK_ID)
    partial[[0, 3]] = torch.tensor([FIRST_TOKEN, FIRST_TOKEN + 1])
    parents = [torch.full((L,), MASK_ID), partial]
    rows_p, rows_c, groups = [], [], []
    for gi, parent in enumerate(parents):
        masked = (parent == MASK_ID).nonzero().flatten()
        for c in range(3):
            child = parent.clone()
            pick = masked[torch.randperm(masked.numel(), generator=g)[:4]]
            child[pick] = FIRST_TOKEN + 2 + 3 * ((pick + c) % 3) + c  # distinct across siblings at a position
            if gi == 1 and c == 0:
                child[pick[0]] = EOS  # an early stop: later positions drop out of the completion mask
            rows_p.append(torch.cat([prompt, parent]))
            rows_c.append(torch.cat([prompt, child]))
            groups.append(gi)
    return torch.stack(rows_p), torch.stack(rows_c), torch.tensor(groups)


def _parent_logits(parent_ids: torch.Tensor, child_ids: torch.Tensor, groups: torch.Tensor, logp: torch.Tensor,
                   P: int) -> torch.Tensor:
    """``[B, P + L, V]`` logits of every row's parent state: at each completion position of a parent, its children's
    tokens carry their leaf log-probs (every position: the reference's cross-entropy reads all of them)."""
    B, T = parent_ids.shape
    L = T - P
    out = []
    for r in range(B):
        sib = (groups == groups[r]).nonzero().flatten()
        rows = [torch.full((P, VOCAB), FILLER, dtype=torch.float64)]
        for j in range(L):
            lp = torch.full((VOCAB,), FILLER, dtype=torch.float64)
            mass = torch.zeros((), dtype=torch.float64)
            for s in sib.tolist():
                tok = int(child_ids[s, P + j])
                if parent_ids[s, P + j] == MASK_ID and tok != MASK_ID:
                    lp = lp.index_put((torch.tensor([tok]),), logp[s, j].reshape(1))
                    mass = mass + logp[s, j].exp()
            rows.append(lp.index_put((torch.tensor([OTHER]),), torch.log(1 - mass).reshape(1))[None])
        out.append(torch.cat(rows))
    return torch.stack(out)


@case("dtreerpo", DTREERPO)
def dtreerpo(ref):
    rel = "dtreerpo/dtreerpo_trainer.py"
    mod = load_reference(ref.file(rel), "dtreerpo")
    g = torch.Generator().manual_seed(41)
    P, L = 3, 7
    parent_ids, child_ids, groups = _tree_segments(g, P, L)
    B = parent_ids.shape[0]
    # per-token transition log-probs; siblings' entries at a position are one distribution: keep their mass < 1
    logp = log_probs(g, B, L, low=-3.0, high=-1.3).requires_grad_()
    old, ref_lp = perturbed(g, logp.detach()), perturbed(g, logp.detach())
    adv = torch.tensor([0.8, -0.3, 0.5, 0.25, -0.6, 0.35], dtype=torch.float64)
    step, horizon = 6, 10
    args = SimpleNamespace(epsilon=0.4, beta=0.05, cfg_scale=0.0, mask_id=MASK_ID, max_steps=horizon,
                           enable_self_distillation_loss=True, self_distillation_lambda_max=0.5,
                           self_distillation_gamma=2.0, self_distillation_tau_max=2.0, self_distillation_beta=0.7)
    table = _parent_logits(parent_ids, child_ids, groups, logp, P)  # row r: the logits of r's parent state

    def get_logits(model, ids, *args):  # any batch of parent states (the segments', or one per group for SD)
        return table[[int((parent_ids == row).all(1).nonzero()[0]) for row in ids]]

    tr = trainer(mod.DTreeRPOTrainer, args=args, beta=0.05, state=SimpleNamespace(global_step=step),
                 accelerator=SimpleNamespace(device=torch.device("cpu")),
                 processing_class=SimpleNamespace(eos_token_id=EOS), log=lambda *a, **k: None, get_logits=get_logits)
    inputs = {"parent_ids": parent_ids, "child_ids": child_ids, "prompt_length": P, "old_local_logps": old,
              "ref_local_logps": ref_lp, "local_advantages": adv, "group_ids": groups}
    loss = tr.compute_loss(None, inputs)
    comp, parent = child_ids[:, P:], parent_ids[:, P:]
    stop = comp == EOS
    first = torch.where(stop.any(1), stop.float().argmax(1), torch.full((B,), L))
    cmask = torch.arange(L)[None] <= first[:, None]
    config = dict(inner_iterations=2, clip_low=0.4, clip_high=None, beta=0.05, kl_estimator="k3", kl_target="reference",
                  aggregation="seq_mean_token_mean", self_distillation=True, sd_lambda_max=0.5, sd_gamma=2.0,
                  sd_tau_max=2.0, sd_beta=0.7, sd_horizon=horizon)
    x = {"prompt_ids": parent_ids[:, :P], "prompt_mask": torch.ones(B, P, dtype=torch.bool), "completion_ids": comp,
         "completion_mask": cmask, "parent_ids": parent, "group": groups, "tree_advantages": adv, "old_logp": old,
         "ref_logp": ref_lp, "global_step": torch.tensor(step)}
    return record("dtreerpo", config, x, {"logp": logp}, loss,
                  ref.meta(rel, "DTreeRPOTrainer.compute_loss (+ _get_local_transition_logps, self-distillation)"),
                  runner="dtreerpo",
                  note="one compute_loss call with every segment of two parents (the reference trains one parent's "
                       "children per call; dare normalises over the step); prompts unpadded")


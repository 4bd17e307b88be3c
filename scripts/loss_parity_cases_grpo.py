"""Loss-parity cases of the TRL-trainer methods: d1, wd1, Coupled-GRPO, SPG (4 modes), ESPO (docs/loss_parity.md).

Each function imports the authors' trainer module, makes a trainer object without ``__init__`` holding the
hyperparameters its ``compute_loss`` reads, replaces the model forward (``_get_per_token_logps`` or ``get_logits``)
by the leaf log-probs, and runs the authors' ``compute_loss``. Where the method's likelihood estimator is the point
(Coupled-GRPO's view combination, SPG's bounds, ESPO's ELBO) the authors' own mask sampler draws the masks (their
``forward_process``, seeded), the authors' estimator code combines the per-view log-probs, and the masks are saved
so that dare's estimator scores the same views.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from loss_parity_lib import repository, case, centred, load_reference, log_probs, perturbed, record, rl_inputs, trainer
from tests.algorithms.parity_io import MASK_ID, completion_hidden

D1 = repository("d1", "dllm-reasoning/d1")
WD1 = repository("wd1", "xiaohangt/wd1")
DIFFUCODER = repository("diffucoder", "apple/ml-diffucoder")
SPG = repository("spg", "facebookresearch/SPG")
ESPO = repository("espo", "ML-GSAI/ESPO")
GDPO = repository("gdpo", "KevinRojas1499/GDPO")

SEQ_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "group")


def _seq(x: dict, sel=slice(None)) -> dict:
    return {k: x[k][sel] for k in SEQ_KEYS}


def _advantages(g: torch.Generator, group: torch.Tensor) -> torch.Tensor:
    adv = centred(torch.randn(group.shape[0], generator=g, dtype=torch.float64), group)
    adv[0] = 0.0  # one zero advantage (SPG routes it to the negative branch)
    return adv


@case("d1", D1)
def d1(ref):
    rel = "diffu-grpo/diffu_grpo_trainer.py"
    mod = load_reference(ref.file(rel), "d1")
    x = rl_inputs(seed=11)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    logp = log_probs(g, B, Lc).requires_grad_()
    old, ref_lp = perturbed(g, logp.detach()), perturbed(g, logp.detach())
    adv = _advantages(g, x["group"])
    mu, itr = 2, 1  # the second inner iteration: the stored old/ref log-probs of index 1 are used
    tr = trainer(mod.DiffuGRPOTrainer, _step=itr, args=SimpleNamespace(num_iterations=mu), num_iterations=mu,
                 beta=0.04, epsilon=0.5, _get_per_token_logps=lambda model, ids, keep, seeds: logp.unsqueeze(0))
    other = perturbed(g, logp.detach())  # iteration 0's stored values: must not be read
    inputs = {**_seq(x), "mask_seeds": [0, 1], "advantages": adv,
              "old_per_token_logps": torch.stack([other, old]), "ref_per_token_logps": torch.stack([other, ref_lp])}
    loss = tr.compute_loss(None, inputs)
    config = dict(inner_iterations=mu, clip_low=0.5, clip_high=None, beta=0.04, kl_estimator="k3",
                  kl_target="reference", aggregation="token_mean")
    return record("d1", config, {**_seq(x), "advantages": adv, "old_logp": old, "ref_logp": ref_lp},
                  {"logp": logp}, loss, ref.meta(rel, "DiffuGRPOTrainer.compute_loss"), runner="token_grpo")


@case("wd1", WD1)
def wd1(ref):
    rel = "wd1/trainers/rev_grpo_trainer.py"
    mod = load_reference(ref.file(rel), "wd1")
    x = rl_inputs(seed=12)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    logp = log_probs(g, B, Lc).requires_grad_()
    adv = _advantages(g, x["group"])
    mu = 2
    tr = trainer(mod.RevDiffuGRPOTrainer, _step=1, args=SimpleNamespace(num_iterations=mu))
    # The reference takes the softmax over its per-device batch, which its configs make one group (batch = G), and
    # averages the per-batch losses over gradient accumulation and devices: one call per group, then the mean.
    losses = []
    for grp in torch.unique(x["group"]):
        sel = x["group"] == grp
        tr._get_per_token_logps = lambda model, ids, keep, seeds, sel=sel: logp[sel].unsqueeze(0)
        losses.append(tr.compute_loss(None, {**_seq(x, sel), "mask_seeds": [0, 1], "advantages": adv[sel]}))
    loss = torch.stack(losses).mean()
    config = dict(inner_iterations=mu, beta=0.0, advantage="mean")
    return record("wd1", config, {**_seq(x), "rewards": adv}, {"logp": logp}, loss,
                  ref.meta(rel, "RevDiffuGRPOTrainer.compute_loss (one call per group, mean over groups)"),
                  runner="token_grpo", note="rewards are zero-mean per group, so dare's advantage r - mean(r) equals them")


def _view_logits(leaf: torch.Tensor, x: dict) -> torch.Tensor:
    """``[B, P + Lc, V]`` logits of one forward: the leaf log-probs embedded at the completion positions."""
    return completion_hidden(leaf, x["prompt_ids"].shape[1], x["completion_ids"])


def _completion_masked(noisy: torch.Tensor, gen_len: int) -> torch.Tensor:
    return noisy[..., -gen_len:] == MASK_ID


@case("coupled_grpo", DIFFUCODER)
def coupled_grpo(ref):
    """The authors' whole per-token estimator: their ``forward_process`` draws t and the complementary masks, their
    ``selective_log_softmax`` combines the all-masked, t and 1-t views, their ``compute_loss`` takes the result."""
    rel = "src/open_r1/coupled_grpo.py"
    mod = load_reference(ref.file(rel), "coupled_grpo")
    x = rl_inputs(seed=13)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    views = log_probs(g, 3, B, Lc).requires_grad_()  # per-token log-probs of the all-masked, t and 1-t views
    old, ref_lp = perturbed(g, torch.zeros(B, 2, Lc) - 1.0), perturbed(g, torch.zeros(B, 2, Lc) - 1.0)
    adv = _advantages(g, x["group"])
    mu, itr = 2, 1
    drawn = {}

    def forward_process(*args, **kwargs):  # the authors' sampler; keep what it drew
        noisy, weights, v1 = mod.DiffuGRPOTrainer.forward_process(tr, *args, **kwargs)
        drawn.update(v1=v1[:, -Lc:].clone(), t=1.0 / weights[1])
        return noisy, weights, v1

    def get_logits(model, batch):  # [3B, P + Lc] -> logits of the leaf views
        assert batch.shape[0] == 3 * B
        return torch.cat([_view_logits(views[v], x) for v in range(3)])

    tr = trainer(mod.DiffuGRPOTrainer, _step=itr, args=SimpleNamespace(num_iterations=mu), num_iterations=mu,
                 beta=0.01, epsilon_low=0.5, epsilon_high=0.5, processing_class=SimpleNamespace(mask_token_id=MASK_ID),
                 forward_process=forward_process, get_logits=get_logits)
    import random
    random.seed(13)
    torch.manual_seed(13)
    inputs = {**_seq(x), "mask_seeds": [0, 1], "advantages": adv, "old_per_token_logps": old,
              "ref_per_token_logps": ref_lp}
    loss = tr.compute_loss(None, inputs)
    t = torch.full((B,), float(drawn["t"]), dtype=torch.float32)
    config = dict(inner_iterations=mu, clip_low=0.5, clip_high=0.5, beta=0.01, kl_estimator="k3",
                  kl_target="reference", aggregation="token_mean", full_mask_view=True)
    return record("coupled_grpo", config, {**_seq(x), "advantages": adv, "old_logp": old[:, itr],
                                           "ref_logp": ref_lp[:, itr], "v1": drawn["v1"], "t": t},
                  {"logp_views": views}, loss,
                  ref.meta(rel, "DiffuGRPOTrainer.compute_loss -> _get_per_token_logps (forward_process, "
                                "selective_log_softmax)"), runner="coupled_grpo",
                  note="logp_views[v] are the per-token log-probs of view v (all masked, t, 1-t); the reference "
                       "draws one t per call, so every sample shares it")


def _spg_case(ref, mode: str):
    """SPG's ``compute_loss`` -> ``_get_per_seq_logps``: the authors' block_random sampler draws num_t masked views
    (prompt and earlier blocks masked with p = 0.15), their bounds (ELBO / EUBO / mix / zero) and their loss."""
    rel = "spg/spg_trainer.py"
    mod = load_reference(ref.file(rel), f"spg_{mode}")
    x = rl_inputs(seed=14)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    J = 2
    draws = log_probs(g, J, B, Lc).requires_grad_()
    adv = _advantages(g, x["group"])
    drawn = {}

    def forward_process(*args, **kwargs):
        noisy, block_mask = mod.SPGTrainer.forward_process(tr, *args, **kwargs)
        drawn["noisy"] = noisy.clone()  # [B, num_t, P + Lc]
        return noisy, block_mask

    def get_logits(model, batch, prompt_index, cfg_scale, mask_id, prompt_mask=None):
        return torch.stack([_view_logits(draws[j], x) for j in range(J)], dim=1)  # [B, num_t, P + Lc, V]

    args = SimpleNamespace(num_iterations=1, forward_type="block_random", num_t=J, min_t=0.0, max_t=1.0,
                           block_length=4, use_mask_prompt=True, p_mask_prompt=0.15, mask_id=MASK_ID, cfg_scale=0.0,
                           logp_estimation=mode, eubo_beta=1.5, mix_weight=0.5)
    tr = trainer(mod.SPGTrainer, _step=0, args=args, beta=0.0, forward_process=forward_process, get_logits=get_logits)
    torch.manual_seed(14)
    loss = tr.compute_loss(None, {**_seq(x), "mask_seeds": [0], "advantages": adv, "reward_mask": adv > 0})
    noisy = drawn["noisy"].transpose(0, 1) == MASK_ID  # [J, B, P + Lc]
    config = dict(inner_iterations=1, beta=0.0, forward_type="block_random", num_t=J, min_t=0.0, max_t=1.0,
                  block_length=4, p_mask_prompt=0.15, logp_estimation=mode, eubo_beta=1.5, mix_weight=0.5)
    return record("spg", config, {**_seq(x), "advantages": adv, "prompt_masked": noisy[..., :P],
                                  "completion_masked": noisy[..., P:]},
                  {"logp_draws": draws}, loss, ref.meta(rel, "SPGTrainer.compute_loss -> _get_per_seq_logps"),
                  runner="spg", note=f"logp_estimation={mode}; logp_draws[j] are the per-token log-probs of draw j")


for _mode in ("elbo", "eubo", "mix", "zero"):
    case(f"spg_{_mode}", SPG)(lambda ref, _mode=_mode: _spg_case(ref, _mode))


@case("espo", ESPO)
def espo(ref):
    """ESPO's ``compute_loss`` -> ``_get_elbo_mc``: the authors' stratified sampler (module ``forward_process``)
    draws the masks, their ELBO weights the main (1/p) and complement (1/(L/(L+1) - p)) passes, their loss takes the
    sequence-level ratio exp((B - B_old)/L) and k2 KL. Completions without padding: the reference scores the whole
    generation length (dare scores up to the first EOS; docs/algorithms/espo.md)."""
    rel = "espo/espo_trainer.py"
    mod = load_reference(ref.file(rel), "espo")
    x = rl_inputs(seed=15, eos_rows=0)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    n, mu, itr = 2, 2, 1
    passes = log_probs(g, n, 2, B, Lc, low=-1.5).requires_grad_()  # [mc, main/complement, B, Lc]
    elbo_scale = torch.full((B, mu), -0.8 * Lc, dtype=torch.float64)
    old, ref_lp = perturbed(g, elbo_scale, 1.5), perturbed(g, elbo_scale, 1.5)
    adv = _advantages(g, x["group"])
    sampler, drawn, calls = mod.forward_process, [], []

    def forward_process(batch, prompt_index, mask_id, seed=None):
        noisy, p_mask = sampler(batch, prompt_index, mask_id, seed=seed)
        drawn.append(_completion_masked(noisy, Lc))
        return noisy, p_mask

    def get_logits(model, batch):
        k = len(calls)
        calls.append(k)
        # float32 like the reference's autocast cross_entropy, whose output it writes into a float32 buffer
        return _view_logits(passes[k // 2, k % 2], x).float()

    mod.forward_process = forward_process
    tr = trainer(mod.ESPOTrainer, _step=itr + 1, args=SimpleNamespace(num_iterations=mu, gradient_accumulation_steps=1),
                 num_iterations=mu, num_mc=n, beta=0.01, epsilon_low=0.2, epsilon_high=0.2,
                 processing_class=SimpleNamespace(mask_token_id=MASK_ID), get_logits=get_logits)
    torch.manual_seed(15)
    seeds = torch.arange(mu * n).view(1, mu, n)
    loss = tr.compute_loss(None, {**_seq(x), "mask_seeds": seeds, "advantages": adv, "old_per_token_logps": old,
                                  "ref_per_token_logps": ref_lp})
    main = torch.stack(drawn)  # [mc, B, Lc]
    config = dict(inner_iterations=mu, clip_low=0.2, clip_high=None, beta=0.01, kl_estimator="k2",
                  kl_target="reference", num_mc=n, antithetic=True)
    return record("espo", config, {**_seq(x), "advantages": adv, "old_logp": old[:, itr:itr + 1],
                                   "ref_logp": ref_lp[:, itr:itr + 1], "main_masked": main, "counts": main.sum(-1)},
                  {"logp_passes": passes}, loss, ref.meta(rel, "ESPOTrainer.compute_loss -> _get_elbo_mc, _get_elbo"),
                  runner="espo", note="logp_passes[j, 0/1] are the per-token log-probs of MC sample j's main and "
                                      "complement passes")


@case("gdpo", GDPO)
def gdpo(ref):
    """GDPO's ``compute_loss`` -> ``NumericalIntegrationEstimator('gauss-3').get_log_likelihood``: the authors' own
    sampler (``forward_process``: exactly int(t L) positions by ``randperm``) draws each node's mask, their estimator
    weights each node's cross-entropy by 1/t and the rule's weight, their loss takes exp((B - B_old)/L) clipped at
    0.5. Completions without padding: the authors score the whole canvas (dare up to the first EOS), and a 12-token
    canvas so that every node masks at least one token (int(0.113 * 12) = 1)."""
    est_rel, rel = "gdpo/likelihood_estimators.py", "gdpo/gdpo_trainer.py"
    estimators = load_reference(ref.file(est_rel), "gdpo_estimators")
    mod = load_reference(ref.file(rel), "gdpo")
    x = rl_inputs(seed=16, eos_rows=0, gen_len=12)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    mu, itr = 2, 1
    nodes = log_probs(g, 3, B, Lc, low=-1.5).requires_grad_()  # per-token log-probs of the three node views
    elbo_scale = torch.full((mu, B), -0.8 * Lc, dtype=torch.float64)
    old = perturbed(g, elbo_scale, 1.5)
    adv = _advantages(g, x["group"])
    est = estimators.get_estimator("gauss-3")
    sampler, drawn = est.forward_process, []

    def forward_process(batch, p_mask, prompt_index, mask_id):
        # the authors' mask id (LLaDA's 126336, get_log_likelihood's default): their get_loss finds the masked
        # positions by it; the stand-in logits do not read the noisy ids
        noisy, p = sampler(batch, p_mask, prompt_index, mask_id)
        drawn.append(noisy[:, -Lc:] == mask_id)
        return noisy, p

    def get_logits(model, batch, prompt_index, cfg_scale, mask_id, attn_mask=None):
        return _view_logits(nodes[len(drawn) - 1], x)

    est.forward_process, est.get_logits = forward_process, get_logits
    tr = trainer(mod.GDPOTrainer, _step=itr, args=SimpleNamespace(num_iterations=mu), num_iterations=mu, beta=0.0,
                 epsilon=0.5, logp_estimator=est, model=SimpleNamespace(device=torch.device("cpu")),
                 control=SimpleNamespace(should_evaluate=False), _metrics={"train": {"clip_ratio": []}},
                 accelerator=SimpleNamespace(gather_for_metrics=lambda t: t))
    loss = tr.compute_loss(None, {**_seq(x), "mask_seeds": torch.tensor([5, 6]), "advantages": adv,
                                  "old_logps": old})
    config = dict(inner_iterations=mu, clip_low=0.5, clip_high=None, beta=0.0, quadrature="gauss-3", mc_per_node=1,
                  advantage="mean")
    return record("gdpo", config, {**_seq(x), "advantages": adv, "old_logp": old[itr][:, None],
                                   "node_masked": torch.stack(drawn)},
                  {"logp_nodes": nodes}, loss,
                  ref.meta(rel, "GDPOTrainer.compute_loss -> NumericalIntegrationEstimator.get_log_likelihood, get_loss"),
                  runner="gdpo", note="logp_nodes[n] are the per-token log-probs of node n's view (t ascending)")

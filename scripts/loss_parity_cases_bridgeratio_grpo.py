"""Loss-parity cases of BridgeRatio-GRPO against DARE's own code (yjyddq/DARE, commit 6d4791f; docs/loss_parity.md).

The reference runs as DARE's ``llada_dp_actor_bridgeratio_grpo.update_policy`` does for one micro-batch: DARE's
``_forward_process_coupled_grpo`` draws each sample's three paths (all masked; masked below t; the complement),
the Coupled-GRPO actor's ``_forward_micro_batch`` turns the logits of each path into its path score (its own
cross-entropy, ``/ p_mask``, ``/ response_length``) for the current and the old policy, the BridgeRatio actor's
``_scale_bridge_path_scores`` applies the score scale, verl's ``compute_grpo_outcome_advantage`` makes the advantages
from the rewards, and ``compute_policy_loss_bridgeratio`` (-> ``estimate_bridge_log_ratio``) gives the loss. The
model is replaced by logits whose log-softmax at each completion token is the leaf (``embed_logp``). Completions
have no stop token: the reference scores positions after the end with zero logits and dare does not (documented).
"""
from __future__ import annotations

import random

import numpy
import torch

from loss_parity_lib import case, load_reference, log_probs, record, repository, rl_inputs, trainer
from tests.algorithms.parity_io import MASK_ID, VOCAB, embed_logp

DARE = repository("dare", "yjyddq/DARE")
JACKKNIFE_SPREAD, CUMULANT_SPREAD = 0.3, 0.15
CORE, ACTOR, BRIDGE = ("verl/trainer/ppo/dllm_core_algos.py", "verl/workers/actor/llada_dp_actor_coupled_grpo.py",
                       "verl/workers/actor/llada_dp_actor_bridgeratio_grpo.py")


def _modules(ref):
    """DARE's dllm_core_algos with verl's real core_algos (and its torch_functional) under its star import."""
    public = lambda m: {k: v for k, v in vars(m).items() if not k.startswith("_")}  # noqa: E731
    tf = load_reference(ref.file("verl/utils/torch_functional.py"), "dare_torch_functional")
    core = load_reference(ref.file("verl/trainer/ppo/core_algos.py"), "dare_core_algos",
                          {"verl.utils.torch_functional": public(tf)})
    dllm = load_reference(ref.file(CORE), "dare_dllm_core_algos", {"verl.trainer.ppo.core_algos": public(core)})
    actor = load_reference(ref.file(ACTOR), "dare_coupled_actor")
    bridge = load_reference(ref.file(BRIDGE), "dare_bridge_actor")
    return core, dllm, actor, bridge


def _path_scores(actor_mod, per_view: torch.Tensor, micro: dict, prompt_len: int) -> torch.Tensor:
    """The Coupled-GRPO actor's per-path scores ``[B, 3, Lc]`` when path i's logits carry ``per_view[i]``."""
    comp = micro["responses"]
    calls = iter(range(per_view.shape[0]))

    def get_logits(model, packed_input, cu_seqlens, max_seqlen, prompt_len, cfg_scale=0.0, MASK_TOKEN_ID=0):
        i = next(calls)
        rows = [torch.cat([torch.zeros(prompt_len[b], VOCAB), embed_logp(per_view[i][b].float(), comp[b])])
                for b in range(comp.shape[0])]
        return torch.cat(rows).unsqueeze(0)

    actor = trainer(actor_mod.DLLMDataParallelPPOActor, _get_logits=get_logits, actor_module=None,
                    MASK_TOKEN_ID=MASK_ID)
    _, _, scores = actor_mod.DLLMDataParallelPPOActor._forward_micro_batch(
        actor, micro, temperature=1.0, n_l=1, mc_num=per_view.shape[0])
    return scores


def _bridge_case(ref, seed: int, correction: str, score_scale: str, spread: float, lowered=()):
    """``lowered``: samples whose old per-token log-probs sit 0.3 lower (their ratio far above 1: with a
    negative advantage, the dual clip acts)."""
    core, dllm, actor_mod, bridge = _modules(ref)
    x = rl_inputs(seed=seed, eos_rows=0)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    seq = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    attention = torch.ones_like(seq)
    random.seed(seed)
    torch.manual_seed(seed)
    drawn = [dllm._forward_process_coupled_grpo(seq[b:b + 1], attention[b], P, seed=seed, MASK_TOKEN_ID=MASK_ID)
             for b in range(B)]
    perturbed_seq, mask_indices, p_mask = (torch.stack([d[k] for d in drawn]) for k in range(3))  # [B, 3, L]
    micro = {"input_ids": seq, "responses": x["completion_ids"], "attention_mask": attention,
             "perturbed_seq": perturbed_seq, "mask_indices": mask_indices, "p_mask": p_mask}
    views = log_probs(g, 3, B, Lc).requires_grad_()  # current policy: per-token log-probs of each path's logits
    old_views = (views.detach() + spread * torch.randn(3, B, Lc, generator=g, dtype=torch.float64)).clamp(max=-0.01)
    for b in lowered:
        old_views[:, b] -= 0.3
    response_mask = x["completion_mask"].float()
    scaler = trainer(bridge.DLLMDataParallelPPOActor, bridge_ratio_score_scale=score_scale)
    scale = bridge.DLLMDataParallelPPOActor._scale_bridge_path_scores
    with torch.no_grad():
        old = scale(scaler, _path_scores(actor_mod, old_views, micro, P), response_mask, Lc)
    cur = scale(scaler, _path_scores(actor_mod, views, micro, P), response_mask, Lc)
    token_rewards = torch.zeros(B, Lc, dtype=torch.float64)
    token_rewards[:, -1] = x["rewards"]
    adv, _ = core.compute_grpo_outcome_advantage(token_rewards, response_mask, numpy.array(x["group"].tolist()))
    loss, *_ = dllm.compute_policy_loss_bridgeratio(
        old_l_theta_paths=old, l_theta_paths=cur, advantages=adv, response_mask=response_mask, cliprange=0.2,
        cliprange_low=0.2, cliprange_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-mean", correction=correction,
        detach_correction=True, ratio_log_clip=None)
    v1 = mask_indices[:, 1, P:]
    t = torch.where(v1, p_mask[:, 1, P:], 1.0 - p_mask[:, 2, P:]).amax(1)  # each sample's t (float32, as drawn)
    config = dict(inner_iterations=2, clip_low=0.2, clip_high=0.2, dual_clip=3.0, correction=correction,
                  score_scale=score_scale, advantage="mean_std_unbiased", advantage_eps=1e-6)
    return record("bridgeratio_grpo", config, {**{k: x[k] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                                    "completion_mask", "group", "rewards")},
                                               "old_logp": old[:, :, 0].detach().double(), "v1": v1, "t": t.float()},
                  {"logp_views": views}, loss,
                  ref.meta(CORE, "compute_policy_loss_bridgeratio -> estimate_bridge_log_ratio; "
                                 "_forward_process_coupled_grpo; llada_dp_actor_coupled_grpo._forward_micro_batch; "
                                 "llada_dp_actor_bridgeratio_grpo._scale_bridge_path_scores; "
                                 "core_algos.compute_grpo_outcome_advantage"),
                  runner="bridgeratio_grpo",
                  note=f"correction {correction}, score scale {score_scale}; logp_views[k] are the per-token "
                       f"log-probs of path k (all masked, t, 1-t); old paths {spread} apart"
                       + (f", samples {list(lowered)} 0.3 lower" if lowered else ""),
                  doc={"authors": f"`{CORE}` `_forward_process_coupled_grpo` (draws each sample's t and paths), "
                                  f"`{ACTOR}` `_forward_micro_batch` (path scores of the current and old logits), "
                                  f"`{BRIDGE}` `_scale_bridge_path_scores`, `core_algos.compute_grpo_outcome_advantage`, "
                                  f"`compute_policy_loss_bridgeratio` -> `estimate_bridge_log_ratio` (correction "
                                  f"{correction}, {score_scale} scale, dual clip 3)",
                       "dare": "`BridgeRatioGRPO.corrupt` (with the reference's t and masks), `log_likelihood` (path "
                               "scores), `advantages`, `loss` (`bridge_log_ratio`)"})


@case("bridgeratio_grpo", DARE)
def bridgeratio_none(ref):
    return _bridge_case(ref, 81, "none", "token", 0.4)


@case("bridgeratio_grpo_delta", DARE)
def bridgeratio_delta(ref):
    return _bridge_case(ref, 82, "delta", "token", 0.4)


@case("bridgeratio_grpo_jackknife", DARE)
def bridgeratio_jackknife(ref):
    return _bridge_case(ref, 83, "jackknife", "sequence", JACKKNIFE_SPREAD,
                        lowered=(1, 4))


@case("bridgeratio_grpo_cumulant", DARE)
def bridgeratio_cumulant(ref):
    return _bridge_case(ref, 84, "cumulant", "valid_tokens", CUMULANT_SPREAD)

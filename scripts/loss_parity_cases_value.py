"""Loss-parity cases of TraceRL's optional value model (``configs/rl_sdar_with_value.yaml``; docs/loss_parity.md).

The authors' ``train/train_sdar_value.py`` builds the block rounds with its own ``collect_training_data``, puts the
value model's old values of every row into its ``TrainDataset``, computes the token returns and advantages with its
``compute_returns_and_advantages_from_fragments`` (step-level GAE over the trace steps) and trains the value model with
its ``forward_process`` (the clipped value loss); ``train/train_sdar_policy.py``'s ``forward_process`` then trains the
policy on those token-wise advantages. The value model and the policy are stand-ins that return the leaves (values;
log-probs embedded as logits) at each row's noisy response positions. gamma and lambda are below 1 so that the
general step-level recursion is exercised (the configs use 1, where R_j = r and A_j = r - V_j).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from loss_parity_cases_replay import _row_logits, _seq, _steps_per_block, _trace_inputs, _z_scores
from loss_parity_lib import repository, case, load_reference, log_probs, nested_function, perturbed, record
from tests.algorithms.parity_io import MASK_ID, PAD

DLLM_RL = repository("dllm_rl", "Gen-Verse/dLLM-RL")

GAMMA, LAM, BLOCK = 0.9, 0.8, 4


def _value_pipeline(ref, seed: int):
    """The authors' value-side pipeline up to the returns and advantages: (inputs, rows, dataset, config)."""
    rel = "train/train_sdar_value.py"
    path = ref.file(rel)
    module = load_reference(path, "tracerl_value")
    x, g, lengths = _trace_inputs(seed)
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]  # the prompt fills whole blocks: the reference's blocks start at the response
    step_map = _steps_per_block(g, lengths, BLOCK)
    rewards = _z_scores(ref, x["rewards"], x["group"])  # rl_reward.py's z-scores are the value pipeline's rewards
    full = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    config = SimpleNamespace(training=SimpleNamespace(block_size=BLOCK, shrink=1, eps=0.2, gam=GAMMA, lam=LAM,
                                                      beta=0.01, use_kl_estimator_k3=True))
    collapse = nested_function(path, "collapse_k_unique")
    one_round = nested_function(path, "one_round_vectorized", torch=torch)
    collect = nested_function(path, "collect_training_data", torch=torch, config=config, start_pos=P, mask_id=MASK_ID,
                              pad_id=PAD, post_num=0, collapse_k_unique=collapse, one_round_vectorized=one_round)
    (extended, p_mask, tok_idx, row_labels, row_rewards, seq_ids, _, step_map_all,
     resp_ids) = collect(full, [list(s) for s in step_map], rewards.tolist())
    dataset = module.TrainDataset(extended, p_mask, tok_idx, row_labels, row_rewards, seq_ids=seq_ids, L0=P, L1=Lc,
                                  step_map_all=step_map_all, resp_input_ids_all=resp_ids, per_seq_reward=rewards,
                                  per_token_reward_all=rewards, use_vector_reward=False, pad_id=PAD, post_num=0)
    # compute_old_value_parallel: the value model's scores, kept at each row's p_mask positions
    # (fp32, as the reference stores them: dataset.old_values = values.float())
    old_values = 0.5 * torch.randn(B, Lc, generator=g, dtype=torch.float64).float()
    owners = seq_ids.tolist()
    rows_old = torch.cat([torch.zeros(len(owners), P), old_values[owners]], 1)
    dataset.old_values = torch.where(p_mask, rows_old, torch.zeros_like(rows_old))
    returns_adv = nested_function(path, "compute_returns_and_advantages_from_fragments", torch=torch,
                                  TrainDataset=module.TrainDataset)
    returns_adv(dataset, GAMMA, LAM, atol=1e-5)
    inputs = {**_seq(x), "rewards": x["rewards"], "step_map": torch.tensor(step_map), "old_values": old_values,
              "block_size": torch.tensor(BLOCK)}
    return x, g, inputs, dataset, owners, config


def _attention(P: int, Lc: int) -> dict:
    # the attention mask only feeds the stand-in models
    return dict(start_pos=P, basic_block_attention=torch.zeros(1, 1, P + 2 * Lc, P + 2 * Lc),
                process_pad=lambda attn, ids: attn)


CONFIG = dict(inner_iterations=2, clip_low=0.2, clip_high=None, logratio_clamp=10.0, beta=0.01, kl_estimator="k3",
              kl_target="old", advantage="mean_std", shrink=1, post_tokens=0, truncated_reward=None,
              normalize="round_length", value_model=True, value_clip=0.2, value_gamma=GAMMA, value_lambda=LAM)


@case("tracerl_value_loss", DLLM_RL)
def tracerl_value_loss(ref):
    """The value model's loss (``train_sdar_value.py`` ``forward_process``): ``0.5 max((V - R)^2, (V_clip - R)^2)``
    with ``V_clip = V_old + clip(V - V_old, +-eps)``, each row's sum divided by the response length, mean over rows;
    R from the authors' ``compute_returns_and_advantages_from_fragments``."""
    x, g, inputs, dataset, owners, config = _value_pipeline(ref, 22)
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    values = (inputs["old_values"].double() + 0.3 * torch.randn(B, Lc, generator=g, dtype=torch.float64)).requires_grad_()

    def value_model(input_ids, attention_mask, position_ids):  # values at the noisy copy of the response
        return torch.cat([torch.zeros(len(owners), P + Lc, dtype=values.dtype), values[owners]], 1)

    forward = nested_function(ref.file("train/train_sdar_value.py"), "forward_process", torch=torch,
                              value_model=value_model, config=config, **_attention(P, Lc))
    loss = forward(dataset.extended_input_ids, dataset.p_mask, dataset.tok_idx_ext, dataset.Return,
                   dataset.old_values)
    return record("tracerl", CONFIG, inputs, {"values": values}, loss,
                  ref.meta("train/train_sdar_value.py", "main: collect_training_data (one_round_vectorized), "
                                                        "TrainDataset, compute_returns_and_advantages_from_fragments, "
                                                        "forward_process; reward/rl_reward.py: z_score_normalize"),
                  runner="value_loss", note=f"{len(owners)} rows from {B} samples; gamma {GAMMA}, lambda {LAM}")


@case("tracerl_value_policy", DLLM_RL)
def tracerl_value_policy(ref):
    """The policy loss with the value model's token-wise advantages (``train_sdar_policy.py`` ``forward_process`` on
    the advantages ``compute_returns_and_advantages_from_fragments`` wrote into the rows)."""
    x, g, inputs, dataset, owners, config = _value_pipeline(ref, 23)
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    logp = log_probs(g, B, Lc).requires_grad_()
    old = perturbed(g, logp.detach())
    model = lambda input_ids, attention_mask, position_ids: SimpleNamespace(logits=_row_logits(logp, x, owners, Lc))
    forward = nested_function(ref.file("train/train_sdar_policy.py"), "forward_process", torch=torch, F=F,
                              model=model, config=config, **_attention(P, Lc))
    old_rows = torch.cat([torch.zeros(len(owners), P, dtype=old.dtype), old[owners]], 1)
    loss = forward(dataset.extended_input_ids, dataset.p_mask, dataset.tok_idx_ext, dataset.labels, dataset.adv,
                   old_rows)
    return record("tracerl", CONFIG, {**inputs, "old_logp": old}, {"logp": logp}, loss,
                  ref.meta("train/train_sdar_policy.py", "main: forward_process; advantages from "
                                                         "train/train_sdar_value.py compute_returns_and_advantages_"
                                                         "from_fragments"),
                  runner="value_policy", note=f"{len(owners)} rows from {B} samples; gamma {GAMMA}, lambda {LAM}")

"""Loss-parity cases of d2 (kuleshov-group/d2): d2-StepMerge and d2-AnyOrder (docs/loss_parity.md).

Both run the authors' trainer code from their model call down: the likelihood estimator (``_get_per_token_logps``
and, for StepMerge, its ``forward_process`` prompt masking; for AnyOrder ``get_logits``, which builds the ``P + 2L``
input, the position ids and the pair-mask bias) and ``compute_loss``. The model is a stand-in that returns the leaf
log-probs embedded as logits and records what it was given -- the perturbed prompt and segment snapshot (StepMerge),
the attention bias and positions (AnyOrder) -- so dare's test also checks that its views are the reference's inputs.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from loss_parity_lib import repository, case, centred, load_reference, log_probs, perturbed, record, rl_inputs, trainer
from tests.algorithms.parity_io import MASK_ID, completion_hidden

D2 = repository("d2", "kuleshov-group/d2")

SEQ_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "group")


def _seq(x: dict) -> dict:
    return {k: x[k] for k in SEQ_KEYS}


def _block_steps(g: torch.Generator, B: int, Lc: int, block: int, per_step: int) -> torch.Tensor:
    """A semi-autoregressive step map: block b's tokens get steps b * (block / per_step) ... in a random order,
    ``per_step`` tokens per step (the authors' samplers: an even split of every block)."""
    steps_per_block = block // per_step
    out = torch.empty(B, Lc, dtype=torch.long)
    for i in range(B):
        for b in range(Lc // block):
            local = torch.arange(block) // per_step
            out[i, b * block:(b + 1) * block] = b * steps_per_block + local[torch.randperm(block, generator=g)]
    return out


@case("d2_stepmerge", D2)
def d2_stepmerge(ref):
    """``d2StepMergeTrainer.compute_loss`` on the N micro-steps of one rollout batch (segment k = (_step - 1) mod N,
    inner iteration 1 of 2), each through the real ``_get_per_token_logps`` (``forward_process`` masks the prompt with
    p 0.15 from ``set_seed(mask_seeds[1])``). T = 8 one-token steps, N = 3: the authors' boundaries int(8 k / 3) =
    2, 5 make segments of 2, 3 and 3 steps."""
    rel = "diffu-grpo/diffu_grpo_trainer.py"
    mod = load_reference(ref.file(rel), "d2_stepmerge",
                         overrides={"accelerate.utils": {"set_seed": lambda s: torch.manual_seed(int(s))}})
    x = rl_inputs(seed=31)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    T, N, mu, itr = 8, 3, 2, 1
    step_map = _block_steps(g, B, Lc, block=4, per_step=1)
    bounds = [0] + [int(k * (T / N)) for k in range(1, N)] + [T]  # the authors' ``segments`` (and the ends)
    full = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    # trajectory[j]: the canvas at the start of segment j; trajectory_mask[j]: the positions committed in segment j
    snapshots = [torch.cat([x["prompt_ids"], torch.where(step_map < bounds[j], x["completion_ids"], MASK_ID)], 1)
                 for j in range(N)]
    seg_mask = [((step_map >= bounds[j]) & (step_map < bounds[j + 1])).long() for j in range(N)]
    logp = log_probs(g, N, B, Lc).requires_grad_()  # segment j's log-prob of every token in snapshot j
    old, ref_lp = perturbed(g, logp.detach()[0]), perturbed(g, logp.detach()[0])
    other = perturbed(g, logp.detach()[0])  # iteration 0's stored values: must not be read
    adv = centred(torch.randn(B, generator=g, dtype=torch.float64), x["group"])
    seen = {}

    def model(inputs):  # the stand-in policy: which snapshot it was given decides the table
        j = next(k for k in range(N) if torch.equal(inputs[:, P:], snapshots[k][:, P:]))
        seen[j] = inputs[:, :P].clone()
        return SimpleNamespace(logits=completion_hidden(logp[j], P, x["completion_ids"]))

    args = SimpleNamespace(gradient_accumulation_steps=N, N=N, mask_id=MASK_ID, p_mask_prompt=0.15, cfg_scale=0.0)
    tr = trainer(mod.d2StepMergeTrainer, args=args, num_iterations=mu, epsilon=0.5, beta=0.04)
    inputs = {**_seq(x), "completion_mask": x["completion_mask"].int(), "mask_seeds": torch.tensor([7, 1234]),
              "trajectory": [s.unsqueeze(0).expand(mu, -1, -1) for s in snapshots],
              "trajectory_mask": [m.unsqueeze(0) for m in seg_mask], "advantages": adv,
              "old_per_token_logps": torch.stack([other, old]), "ref_per_token_logps": torch.stack([other, ref_lp])}
    losses = []
    for k in range(N):  # the N micro-steps of inner iteration 1: (_step - 1) // GAS = 1
        tr._step = itr * N + k + 1
        losses.append(tr.compute_loss(model, inputs))
    loss = torch.stack(losses).sum() / N  # HF divides every micro-step's loss by GAS = N (one rollout batch here)
    assert sorted(seen) == list(range(N)) and all(torch.equal(seen[0], s) for s in seen.values())
    config = dict(inner_iterations=mu, clip_low=0.5, clip_high=None, beta=0.04, kl_estimator="k3",
                  kl_target="reference", p_mask_prompt=0.15, segments=N, total_steps=T, post_tokens=0)
    return record("d2_stepmerge", config,
                  {**_seq(x), "advantages": adv, "step_map": step_map, "old_logp": old, "ref_logp": ref_lp,
                   "prompt_input": seen[0], "snapshots": torch.stack(snapshots)}, {"logp_segments": logp}, loss,
                  ref.meta(rel, "d2StepMergeTrainer.compute_loss -> _get_per_token_logps -> forward_process"),
                  runner="d2_stepmerge",
                  note="one rollout batch: the loss is the sum of its N micro-step losses / GAS (= N)")


@case("d2_anyorder", D2)
def d2_anyorder(ref):
    """``d2AnyOrderTrainer.compute_loss`` (inner iteration 1 of 2) through its ``_get_per_token_logps`` and
    ``get_logits``: the completion in decoding order (two tokens per step, ties by position), the true positions as
    position ids, the pair-mask bias. The stand-in model returns the leaf at the L query rows (in decoding order)."""
    rel = "diffu-grpo-ao/diffu_grpo_trainer_ao.py"
    mod = load_reference(ref.file(rel), "d2_anyorder")
    x = rl_inputs(seed=32)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    mu = 2
    step_map = _block_steps(g, B, Lc, block=4, per_step=2)
    order = torch.stack([torch.tensor(sorted(range(Lc), key=lambda j: (int(s[j]), j))) for s in step_map])
    logp = log_probs(g, B, Lc).requires_grad_()  # true order
    old, ref_lp, other = (perturbed(g, logp.detach()) for _ in range(3))
    adv = centred(torch.randn(B, generator=g, dtype=torch.float64), x["group"])

    def dec(t):  # true order -> decoding order
        return t.gather(1, order)
    comp_dec = dec(x["completion_ids"])
    seen = {}

    class Model:  # the stand-in policy (``get_logits`` reads ``model.device``)
        device = torch.device("cpu")

        def __call__(self, input_ids, attention_bias, position_ids):
            seen["attend"] = (attention_bias[:, 0] == 0).clone()  # their preprocessing: 0 attend, finfo.min not
            seen["position_ids"] = position_ids.clone()
            assert torch.equal(input_ids[:, P:P + Lc], comp_dec) and (input_ids[:, P + Lc:] == MASK_ID).all()
            return SimpleNamespace(logits=completion_hidden(dec(logp), P + Lc, comp_dec))
    model = Model()

    args = SimpleNamespace(num_iterations=mu, mask_id=MASK_ID)
    tr = trainer(mod.d2AnyOrderTrainer, args=args, num_iterations=mu, epsilon=0.5, beta=0.04, _step=1)
    position_ids = torch.cat([torch.arange(P).expand(B, P), P + order], 1)
    inputs = {"prompt_ids": x["prompt_ids"], "completion_ids": comp_dec, "position_ids": position_ids,
              "completion_mask": dec(x["completion_mask"].int()), "advantages": adv,
              "old_per_token_logps": torch.stack([dec(other), dec(old)]),
              "ref_per_token_logps": torch.stack([dec(other), dec(ref_lp)])}
    loss = tr.compute_loss(model, inputs)
    config = dict(inner_iterations=mu, clip_low=0.5, clip_high=None, beta=0.04, kl_estimator="k3",
                  kl_target="reference", aggregation="token_mean")
    return record("d2_anyorder", config,
                  {**_seq(x), "advantages": adv, "step_map": step_map, "old_logp": old, "ref_logp": ref_lp,
                   "decode_order": order, "ref_attend": seen["attend"], "ref_position_ids": seen["position_ids"]},
                  {"logp": logp}, loss,
                  ref.meta(rel, "d2AnyOrderTrainer.compute_loss -> _get_per_token_logps -> get_logits"),
                  runner="d2_anyorder",
                  note="the reference divides by sum(mask) + 1e-6 (a 1e-6 / #tokens relative difference)")

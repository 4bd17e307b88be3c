"""Loss-parity cases of EGSPO and EGSPO-SA (docs/loss_parity.md): the authors' step selection, advantages and loss.

The authors' ``EGSPOTrainer._generate_and_score_completions`` runs whole, on a synthetic rollout handed over by a
stand-in ``generate`` (trajectory, per-step rollout log-probs, the distributions of the unmasked tokens, greedy
one-step completions): their nested ``_get_high_entropy_time_steps`` picks the steps, their reward loop scores the
picked greedy completions and the final one (a given reward per completion text), their advantage code builds the
(stepwise) returns and centres them per group, and their ``_get_per_token_logps_unbiased`` scores the reference.
Then their ``compute_loss`` runs once per selected step index k (``_step = k``); an optimizer update of dare's
iteration j trains slots ``2j, 2j + 1``, which the reference does in two micro-steps of gradient accumulation 2
(HF's Trainer averages them). The case's loss is the sum over the iterations.

The stand-in models return, for a state of the trajectory, logits embedding the leaf (current policy) or a perturbed
copy (reference) at every completion position. Every sample has its own prompt, so each (sample, step) state is
unique; the group structure is the reference's (``num_generations`` consecutive samples).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace

import torch

from loss_parity_lib import repository, case, load_reference, log_probs, perturbed, record, trainer
from tests.algorithms.parity_io import EOS, FIRST_TOKEN, MASK_ID, VOCAB, embed_logp

EGSPO = repository("egspo", "vishnutez/egspo-dllm-rl")

REL = "egspo/egspo_trainer.py"


class _Trainer:
    """transformers.Trainer as ``_generate_and_score_completions`` calls it: ``_prepare_inputs`` is the identity."""

    @staticmethod
    def _prepare_inputs(self, inputs):
        return inputs


class _Tokenizer:
    """The prompt batch (given), EOS id, and decoding to a text that names the token ids (the reward key)."""
    eos_token_id = EOS

    def __init__(self, prompt_ids, prompt_mask):
        self.batch = {"input_ids": prompt_ids, "attention_mask": prompt_mask}

    def __call__(self, **kwargs):
        return dict(self.batch)

    def batch_decode(self, ids, **kwargs):
        return [text(row) for row in ids]


def text(ids: torch.Tensor) -> str:
    return " ".join(str(int(t)) for t in ids)


class _StateModel:
    """A stand-in policy: for a ``[1, P + Lc]`` state of the trajectory it returns logits embedding ``table[t, b]``
    (log-probs of the final tokens) at the completion positions."""

    def __init__(self, trajectory: torch.Tensor, table: torch.Tensor, final: torch.Tensor, P: int):
        self.trajectory, self.table, self.final, self.P = trajectory, table, final, P

    def __call__(self, state):
        hits = (self.trajectory == state[0]).all(-1).nonzero()
        if hits.shape[0] != 1:
            raise RuntimeError(f"a scored state matches {hits.shape[0]} trajectory states")
        t, b = hits[0].tolist()
        logits = torch.cat([torch.zeros(1, self.P, VOCAB, dtype=self.table.dtype),
                            embed_logp(self.table[t, b][None], self.final[b][None])], dim=1)
        return SimpleNamespace(logits=logits)

    def disable_adapter(self):
        return contextlib.nullcontext()


def _rollout(g: torch.Generator, B: int, P: int, T: int, n: int):
    """A synthetic rollout: distinct prompts, completions, ``n`` tokens committed per step in a random order, the
    distributions the committed tokens came from (random temperatures: well separated entropies), greedy one-step
    completions of every state (committed tokens kept, fresh guesses elsewhere; the last is the final completion)."""
    Lc = T * n
    prompt = torch.randint(FIRST_TOKEN, VOCAB, (B, P), generator=g)
    final = torch.randint(FIRST_TOKEN, VOCAB, (B, Lc), generator=g)
    step_map = torch.stack([torch.arange(Lc)[torch.randperm(Lc, generator=g)] // n for _ in range(B)])
    states = torch.stack([torch.where(step_map >= t, MASK_ID, final) for t in range(T + 1)])  # [T + 1, B, Lc]
    guesses = torch.randint(FIRST_TOKEN, VOCAB, (T + 1, B, Lc), generator=g)
    greedy = torch.where(states == MASK_ID, guesses, states)
    greedy[T] = final
    logits = torch.randn(B, Lc, VOCAB, generator=g, dtype=torch.float64)
    logits = logits / (0.2 + 3.0 * torch.rand(B, Lc, 1, generator=g, dtype=torch.float64))
    probs = logits.softmax(-1)  # the distribution each token was committed from (position-wise)
    logp = probs.log()
    entropy_map = -(probs * logp).sum(-1)
    return prompt, final, step_map, states, greedy, probs, entropy_map


def _egspo_case(ref, method: str, lambda1: float, seed: int):
    mod = load_reference(ref.file(REL), method, overrides={"transformers": {"Trainer": _Trainer},
                                                           "accelerate.utils": {"gather": lambda t: t,
                                                                                "gather_object": lambda t: t}})
    g = torch.Generator().manual_seed(seed)
    G, n_groups, P, T, n, K = 3, 2, 4, 6, 2, 4
    B, Lc = G * n_groups, T * n
    prompt, final, step_map, states, greedy, probs, entropy_map = _rollout(g, B, P, T, n)
    full = lambda c: torch.cat([prompt, c], -1)  # noqa: E731
    trajectory = torch.stack([full(states[t]) for t in range(T + 1)])  # [T + 1, B, P + Lc]
    greedy_full = torch.stack([full(greedy[t]) for t in range(T + 1)])
    rewards = torch.rand(B, T + 1, generator=g, dtype=torch.float64).round(decimals=3)  # r(x0_hat(s_t)); t = T: R
    reward_of = {text(greedy[t, b]): float(rewards[b, t]) for b in range(B) for t in range(T + 1)}
    assert len(reward_of) == B * (T + 1), "greedy completions must be distinct (the reward key)"
    leaf = log_probs(g, T, B, Lc).requires_grad_()  # log pi(final token | s_t) at every completion position
    old_tok, ref_tok = perturbed(g, leaf.detach()), perturbed(g, leaf.detach())
    # per step: the rows of U_t in position order (how the reference's sampler lists the unmasked tokens)
    pos = [[(step_map[b] == t).nonzero().flatten() for b in range(B)] for t in range(T)]
    rollout_logps = torch.stack([torch.stack([old_tok[t, b, pos[t][b]] for b in range(B)]) for t in range(T)])
    dists = torch.stack([torch.stack([probs[b, pos[t][b]] for b in range(B)]) for t in range(T)])

    def generate(model, prompt, **kw):
        return trajectory, rollout_logps.float(), dists.float(), greedy_full, torch.full((B,), T - 1)

    def reward(prompts, completions, **kwargs):
        return [reward_of[c] for c in completions]

    reward.__name__ = "given_rewards"
    args = SimpleNamespace(
        max_completion_length=Lc, block_length=Lc, diffusion_steps=T, temperature=0.9, cfg_scale=0.0,
        generation_batch_size=B, remasking="low_confidence", mask_id=MASK_ID, logps_eval_num_steps=K,
        logps_eval_mode="unbiased", logps_eval_time_steps_mode="high_entropy", terminate_at_last_non_eos=False,
        logps_aggregation_mode="sum", pred_state="next", correctness_step_reward_only=False, dynamic_lambda1=False,
        standard_grpo_returns=False, lambda1=lambda1, normalize_returns=True, epsilon=0.2, epsilon_high=0.5,
        use_exact_kl=False, output_dir="", num_gradient_steps=1)
    policy = _StateModel(trajectory, leaf, final, P)
    reference = _StateModel(trajectory, ref_tok, final, P)
    tr = trainer(mod.EGSPOTrainer, args=args, beta=0.04, num_generations=G, max_prompt_length=P, _step=0,
                 generate=generate, model=reference, model_wrapped=None, reward_funcs=[reward],
                 reward_processing_classes=[None], reward_weights=torch.ones(1), log_completions=False,
                 processing_class=_Tokenizer(prompt, torch.ones(B, P, dtype=torch.long)),
                 accelerator=SimpleNamespace(device=torch.device("cpu"), process_index=0, unwrap_model=lambda m: m,
                                             gather_for_metrics=lambda t: t),
                 _metrics=defaultdict(lambda: defaultdict(list)), control=SimpleNamespace(should_evaluate=False),
                 state=SimpleNamespace(global_step=0))
    inputs = tr._generate_and_score_completions([{"prompt": f"prompt {b}"} for b in range(B)])
    # dare's iteration j trains slots 2j, 2j + 1: two micro-steps of gradient accumulation 2 (averaged)
    losses = []
    for k in range(K):
        tr._step = k
        losses.append(tr.compute_loss(policy, inputs))
    loss = sum(0.5 * (losses[2 * j] + losses[2 * j + 1]) for j in range(K // 2))
    config = dict(sample_train_steps=K, inner_iterations=K // 2, clip_low=0.2, clip_high=0.5, beta=0.04,
                  kl_estimator="k3", advantage="mean", step_selection="entropy", step_logp="sum")
    if method == "egspo_sa":
        config.update(lambda1=lambda1, normalize_returns=True, centre_stepwise=True)
    x = {"prompt_ids": prompt, "prompt_mask": torch.ones(B, P, dtype=torch.bool), "completion_ids": final,
         "completion_mask": torch.ones(B, Lc, dtype=torch.bool), "group": torch.arange(B) // G,
         "rewards": rewards[:, T].float(), "step_map": step_map, "entropy_map": entropy_map.float(),
         "states": states.transpose(0, 1).contiguous(), "greedy": greedy.transpose(0, 1).contiguous(),
         "greedy_rewards": rewards.float(), "eval_time_steps": inputs["eval_time_steps"],
         "old_logp": inputs["old_per_token_logps"], "ref_logp": inputs["ref_per_token_logps"]}
    note = (f"{T} steps of {n} tokens, the {K} highest-entropy trained, 2 per update; logp_steps[t, b, i] = "
            f"log pi(final token i | s_t of sample b)" + (f"; lambda1 {lambda1}, normalized returns" if lambda1 else ""))
    return record(method, config, x, {"logp_steps": leaf}, loss,
                  ref.meta(REL, "EGSPOTrainer._generate_and_score_completions (entropy step selection, rewards of "
                                "the greedy completions, returns and group-centred advantages, reference log-probs "
                                "via _get_per_token_logps_unbiased), compute_loss once per selected step"),
                  runner="egspo", note=note)


@case("egspo", EGSPO)
def egspo(ref):
    return _egspo_case(ref, "egspo", 0.0, seed=41)


@case("egspo_sa", EGSPO)
def egspo_sa(ref):
    return _egspo_case(ref, "egspo_sa", 0.5, seed=42)

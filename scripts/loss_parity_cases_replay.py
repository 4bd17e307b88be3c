"""Loss-parity cases of the trajectory methods: CJ-GRPO, TraceRL (full and block attention), DiRL, MDPO
(docs/loss_parity.md).

TraceRL's and DiRL's training rows are built by the authors' own row builders (functions nested in their training
``main``, compiled from their source text by ``nested_function``) from a rollout step map, so these cases also check
which tokens dare trains in which replayed state and how it normalises them. The model forward is a stand-in that
returns the leaf log-probs (embedded as logits) at every row's response positions.
"""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from loss_parity_lib import (Stub, case, load_reference, log_probs, nested_function, perturbed, record, repository,
                             rl_inputs, trainer)
from tests.algorithms.parity_io import FIRST_TOKEN, MASK_ID, PAD, VOCAB, completion_hidden

CJ_GRPO = repository("cj_grpo", "yjyddq/EOSER-ASS-RL")
DLLM_RL = repository("dllm_rl", "Gen-Verse/dLLM-RL")
DIRL = repository("dirl", "OpenMOSS/DiRL")
MDPO = repository("mdpo", "autonomousvision/mdpo")

SEQ_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "group")


def _seq(x: dict) -> dict:
    return {k: x[k] for k in SEQ_KEYS}


def _owners(rows: torch.Tensor, full: torch.Tensor) -> list[int]:
    """The sample each training row of a reference was built from (rows hold a sample's clean sequence)."""
    owners = []
    for r in rows:
        hit = torch.nonzero((full == r).all(1)).flatten()
        if hit.numel() != 1:
            raise RuntimeError("a training row matches no (or several) samples")
        owners.append(int(hit[0]))
    return owners


def _row_logits(leaf: torch.Tensor, x: dict, owners: list[int], tail_offset: int = 0) -> torch.Tensor:
    """``[N, P + tail_offset + Lc, V]``: row i's logits hold sample ``owners[i]``'s leaf at its response positions."""
    return completion_hidden(leaf[owners], x["prompt_ids"].shape[1] + tail_offset, x["completion_ids"][owners])


def _z_scores(ref, rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """TraceRL's advantages: its ``z_score_normalize`` (reward/rl_reward.py) over each group's rewards."""
    z = nested_function(ref.file("reward/rl_reward.py"), "z_score_normalize")
    out = torch.zeros_like(rewards)
    for grp in torch.unique(group):
        sel = group == grp
        out[sel] = torch.tensor([float(v) for v in z(rewards[sel].tolist())], dtype=rewards.dtype)
    return out


def _steps_per_block(g, lengths, block: int, pads_first=()) -> list[list[int]]:
    """Block-by-block decoding order: block k's tokens get steps after block k-1's, several tokens may share a step;
    in a block holding the EOS the padding is decoded last (or first, for the rows in ``pads_first``)."""
    maps = []
    for i, (n_real, total) in enumerate(lengths):
        steps, base = [], 0
        for start in range(0, total, block):
            idx = list(range(start, min(start + block, total)))
            order = torch.randperm(len(idx), generator=g).tolist()
            real = [k for k in order if idx[k] < n_real]
            pad = [k for k in order if idx[k] >= n_real]
            order = pad + real if i in pads_first else real + pad
            block_steps = [0] * len(idx)
            s = base
            for rank, k in enumerate(order):
                if rank and torch.rand((), generator=g) < 0.6:
                    s += 1  # otherwise this token shares the previous one's step
                block_steps[k] = s
            steps += block_steps
            base = s + 1
        maps.append(steps)
    return maps


def _trace_inputs(seed: int):
    x = rl_inputs(seed=seed, n_groups=3, group=3, pad=PAD, eos_rows=3)
    g = x.pop("generator")
    x["rewards"][6:] = 1.0  # a group with equal rewards: advantage 0
    lengths = [(int(m.sum()), m.numel()) for m in x["completion_mask"]]
    return x, g, lengths


@case("cj_grpo", CJ_GRPO)
def cj_grpo(ref):
    """CJ-GRPO's ``compute_loss``: per decoding step a token mean over the tokens written at that step (its
    ``reversed_traj_unmask_positions``), then the mean over the steps; ASS schedule (1, 2, 4, ... tokens per step)."""
    rel = "cj-grpo/cj_grpo_trainer_eoser_ass.py"
    mod = load_reference(ref.file(rel), "cj_grpo")
    x = rl_inputs(seed=17)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    schedule = [1, 2, 4, 1]
    step_map = torch.stack([torch.repeat_interleave(torch.arange(len(schedule)), torch.tensor(schedule))
                            [torch.randperm(Lc, generator=g)] for _ in range(B)])
    logp = log_probs(g, B, Lc).requires_grad_()
    old, ref_lp = perturbed(g, logp.detach()), perturbed(g, logp.detach())
    adv = x["rewards"] - x["rewards"].view(-1, 3).mean(1).repeat_interleave(3)
    S = len(schedule)
    full = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    states = [torch.where(torch.cat([torch.zeros_like(x["prompt_ids"], dtype=torch.bool), step_map >= s], 1),
                          MASK_ID, full) for s in range(S + 1)]
    tr = trainer(mod.FlowGRPOTrainer, num_iterations=2, beta=0.04, epsilon=0.5,
                 _get_per_token_logps=lambda model, ids, traj, positions, keep: [logp] * len(positions))
    inputs = {**_seq(x), "advantages": adv, "reversed_traj": states,
              "reversed_traj_unmask_positions": [step_map == s for s in range(S)],
              "reversed_traj_old_per_token_logps": [old] * S, "reversed_traj_ref_per_token_logps": [ref_lp] * S}
    loss = tr.compute_loss(None, inputs)
    config = dict(inner_iterations=2, clip_low=0.5, clip_high=None, beta=0.04, kl_estimator="k3",
                  kl_target="reference", shrink=1, post_tokens=None)
    return record("cj_grpo", config, {**_seq(x), "advantages": adv, "step_map": step_map, "old_logp": old,
                                      "ref_logp": ref_lp}, {"logp": logp}, loss,
                  ref.meta(rel, "FlowGRPOTrainer.compute_loss"), runner="replay",
                  note="every token written at step s is a target of step s (post-EOS padding included)")


@case("tracerl_llada", DLLM_RL)
def tracerl_llada(ref):
    """TraceRL, full attention (``train/rl_llada.py``): the authors' ``prepare_inputs_and_labels_for_text`` turns
    the step map into (sample, step group) rows (shrink 2, post_num 1), their ``forward_process`` is the loss (each
    row's surrogate averaged over its targets, KL3 to the old policy summed, mean over rows); advantages from their
    ``z_score_normalize``."""
    rel = "train/rl_llada.py"
    path = ref.file(rel)
    x, g, lengths = _trace_inputs(18)
    B, Lc = x["completion_ids"].shape
    P = x["prompt_ids"].shape[1]
    step_map = [torch.randint(0, 6, (Lc,), generator=g).tolist() for _ in range(B)]
    adv = _z_scores(ref, x["rewards"], x["group"])
    full = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    labels = torch.cat([torch.full_like(x["prompt_ids"], -100), x["completion_ids"]], 1)
    config = SimpleNamespace(training=SimpleNamespace(max_gen_length=Lc, lower_p=0.1, upper_p=0.9, method="TraceRL",
                                                      shrink=2, post_num=1, eps=0.2, beta=0.01,
                                                      use_kl_estimator_k3=True))
    collapse = nested_function(path, "collapse_k_unique")
    prepare = nested_function(path, "prepare_inputs_and_labels_for_text", torch=torch, config=config, pad_id=PAD,
                              mask_id=MASK_ID, collapse_k_unique=collapse,
                              uni_prompting=lambda pair: (full.clone(), labels.clone(), P, 0))
    noisy, row_labels, p_mask, row_adv, _, _ = prepare(None, None, step_map, adv.tolist())
    owners = _owners(row_labels, labels)
    logp = log_probs(g, B, Lc).requires_grad_()
    old = perturbed(g, logp.detach())
    model = lambda input_ids: SimpleNamespace(logits=_row_logits(logp, x, owners))
    forward = nested_function(path, "forward_process", torch=torch, F=F, model=model, config=config)
    old_rows = torch.cat([torch.zeros(len(owners), P, dtype=old.dtype), old[owners]], 1)
    loss = forward(noisy, row_labels, p_mask, row_adv, old_rows)
    cfg = dict(inner_iterations=2, clip_low=0.2, clip_high=None, logratio_clamp=None, beta=0.01, kl_estimator="k3",
               kl_target="old", advantage="mean_std", shrink=2, post_tokens=1, truncated_reward=None,
               normalize="round_mean")
    return record("tracerl", cfg, {**_seq(x), "rewards": x["rewards"], "step_map": torch.tensor(step_map),
                                   "old_logp": old}, {"logp": logp}, loss,
                  ref.meta(rel, "main: prepare_inputs_and_labels_for_text, forward_process; "
                                "reward/rl_reward.py: z_score_normalize"), runner="replay",
                  note=f"{len(owners)} training rows from {B} samples")


def _tracerl_sdar(ref, seed: int, pads_first=(), xfail: str = ""):
    rel = "train/rl_sdar.py"
    path = ref.file(rel)
    x, g, lengths = _trace_inputs(seed)
    B, Lc = x["completion_ids"].shape
    P, block = x["prompt_ids"].shape[1], 4  # the prompt fills whole blocks: the reference's blocks start at the response
    step_map = _steps_per_block(g, lengths, block, pads_first)
    adv = _z_scores(ref, x["rewards"], x["group"])
    full = torch.cat([x["prompt_ids"], x["completion_ids"]], 1)
    config = SimpleNamespace(training=SimpleNamespace(block_size=block, lower_p=0.1, upper_p=0.9, method="TraceRL",
                                                      shrink=1, eps=0.2, beta=0.01, use_kl_estimator_k3=True))
    collapse = nested_function(path, "collapse_k_unique")
    one_round = nested_function(path, "one_round_vectorized", torch=torch)
    collect = nested_function(path, "collect_training_data", torch=torch, config=config, start_pos=P, mask_id=MASK_ID,
                              pad_id=PAD, post_num=0, collapse_k_unique=collapse, one_round_vectorized=one_round)
    extended, p_mask, tok_idx, row_labels, row_adv = collect(full, [list(s) for s in step_map], adv.tolist())
    owners = _owners(row_labels, full)
    logp = log_probs(g, B, Lc).requires_grad_()
    old = perturbed(g, logp.detach())
    N = len(owners)
    model = lambda input_ids, attention_mask, position_ids: SimpleNamespace(logits=_row_logits(logp, x, owners, Lc))
    forward = nested_function(path, "forward_process", torch=torch, F=F, model=model, config=config, start_pos=P,
                              basic_block_attention=torch.zeros(1, 1, P + 2 * Lc, P + 2 * Lc),
                              process_pad=lambda attn, ids: attn)  # attention only feeds the stand-in model
    old_rows = torch.cat([torch.zeros(N, P, dtype=old.dtype), old[owners]], 1)
    loss = forward(extended, p_mask, tok_idx, row_labels, row_adv, old_rows)
    cfg = dict(inner_iterations=2, clip_low=0.2, clip_high=None, logratio_clamp=10.0, beta=0.01, kl_estimator="k3",
               kl_target="old", advantage="mean_std", shrink=1, post_tokens=0, truncated_reward=None,
               normalize="round_length")
    return record("tracerl", cfg, {**_seq(x), "rewards": x["rewards"], "step_map": torch.tensor(step_map),
                                   "old_logp": old, "block_size": torch.tensor(block)}, {"logp": logp}, loss,
                  ref.meta(rel, "main: collect_training_data (one_round_vectorized), forward_process; "
                                "reward/rl_reward.py: z_score_normalize"), runner="replay", xfail=xfail,
                  note=f"{N} training rows from {B} samples; block size {block}")


@case("tracerl_sdar", DLLM_RL)
def tracerl_sdar(ref):
    """TraceRL, block attention (``train/rl_sdar.py``): the authors' ``collect_training_data`` makes one row per
    round (every block's next denoising step), their ``forward_process`` divides the surrogate and KL sums of a row by
    the response length, then averages over rows."""
    return _tracerl_sdar(ref, 19)


@case("tracerl_sdar_pads_first", DLLM_RL)
def tracerl_sdar_pads_first(ref):
    """As ``tracerl_sdar``, but in rows 0-2 the padding after the EOS is decoded before the rest of its block."""
    return _tracerl_sdar(ref, 19, pads_first=(0, 1, 2))


class _Config(dict):
    """An OmegaConf-like node: attribute access and ``.get``."""
    __getattr__ = dict.__getitem__


class _Output(SimpleNamespace):
    def __getattr__(self, name):  # fields the stand-in model does not produce (past_key_values, ...)
        return None


@case("dirl", DIRL)
def dirl(ref):
    """DiRL / DiPO: the authors' ``UniversalPrompting`` lays out [prompt ; response ; padding] with the step map,
    their ``collect_training_data`` / ``generate_training_samples_for_one`` make one row per round of block steps
    (plus ``is_real=False`` dummy rows up to the block size), their ``forward_process`` calls
    ``SDARForCausalLM.forward(compute_rl_loss=True)``, whose RL branch is the loss: token mean over all real targets
    of the clip-higher surrogate (log-ratio clamped to +-10) and of beta * k3 KL to the reference."""
    rel, model_rel = "train/grpo.py", "models/sdar/modeling_sdar.py"
    path = ref.file(rel)
    sdar = load_reference(ref.file(model_rel), "dirl_sdar")
    prompting = load_reference(ref.file("train/prompting_utils.py"), "dirl_prompting")
    x = rl_inputs(seed=20, pad=PAD, eos_rows=3)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    P, block = x["prompt_ids"].shape[1], 4
    lengths = [(int(m.sum()), int(m.sum())) for m in x["completion_mask"]]
    steps = [[s + 1 for s in row] for row in _steps_per_block(g, lengths, block)]  # DiRL's steps start at 1
    prompts = x["prompt_ids"].tolist()
    responses = [x["completion_ids"][i, :n].tolist() for i, (n, _) in enumerate(lengths)]
    uni = prompting.UniversalPrompting(SimpleNamespace(pad_token_id=PAD), max_prompt_len=P, max_gen_length=Lc,
                                       block_size=block)
    input_ids, labels, valid, step_tensor = uni((prompts, responses), step_map_list=steps)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    config = _Config(training=_Config(block_size=block, method="DiPO", shrink=1, eps=0.2, beta=0.1,
                                      use_kl_estimator_k3=True), rollout=_Config(dynamic_threshold=0.9))
    quiet = SimpleNamespace(is_main_process=False, device=torch.device("cpu"))
    one = nested_function(path, "generate_training_samples_for_one", torch=torch)
    collect = nested_function(path, "collect_training_data", torch=torch, config=config, accelerator=quiet,
                              generate_training_samples_for_one=one)
    rows, p_mask, masked, row_valid, row_labels, row_steps, row_adv, _, is_real, _ = collect(
        input_ids, labels, valid, step_tensor, adv.tolist(), adv.tolist())
    owners = _owners(rows, input_ids)
    logp = log_probs(g, B, Lc).requires_grad_()
    old, ref_lp = perturbed(g, logp.detach()), perturbed(g, logp.detach())
    assert torch.equal(input_ids[:, P:], x["completion_ids"])  # responses up to the EOS, then padding
    hidden = _row_logits(logp, x, owners)

    def prepare_for_bd_training(ids, position_ids, prompt_mask, masked_indices=None, p_mask_input=None):
        # The real one builds the [noisy ; clean] input and flex-attention mask for the model; its outputs that the
        # RL branch reads select the noisy half's masked positions, which the stand-in hidden states index directly.
        M = int(masked_indices.sum())
        return None, None, None, masked_indices, masked_indices, torch.full((M,), 0.5), p_mask_input[masked_indices]

    net = trainer(sdar.SDARForCausalLM, training=True, config=SimpleNamespace(output_attentions=False,
                                                                               output_hidden_states=False),
                  model=lambda **kw: _Output(last_hidden_state=hidden), lm_head=lambda h: h,
                  prepare_for_bd_training=prepare_for_bd_training)
    model = lambda **kw: sdar.SDARForCausalLM.forward(net, **kw)
    forward = nested_function(path, "forward_process", torch=torch, model=model, config=config, accelerator=quiet)

    def rows_of(t):
        return torch.cat([torch.zeros(len(owners), P, dtype=t.dtype), t[owners]], 1)

    loss = forward(rows, p_mask, masked, row_valid, row_labels, torch.tensor(row_adv, dtype=torch.float64),
                   rows_of(old), torch.tensor(is_real), row_steps, rows_of(ref_lp))[0]
    step_map = torch.where(x["completion_mask"], step_tensor[:, P:], torch.full_like(step_tensor[:, P:], -1))
    cfg = dict(inner_iterations=2, clip_low=0.2, clip_high=0.28, logratio_clamp=10.0, beta=0.1, kl_estimator="k3",
               kl_target="reference", shrink=1, post_tokens=0, filter_zero_variance=False)
    return record("dirl", cfg, {**_seq(x), "advantages": adv, "step_map": step_map, "old_logp": old,
                                "ref_logp": ref_lp, "block_size": torch.tensor(block)}, {"logp": logp}, loss,
                  ref.meta(rel, "train(): collect_training_data, generate_training_samples_for_one, forward_process "
                                "-> models/sdar/modeling_sdar.py SDARForCausalLM.forward(compute_rl_loss=True); "
                                "train/prompting_utils.py UniversalPrompting"), runner="replay",
                  note=f"{len(owners)} rows ({int(torch.tensor(is_real).sum())} real) from {B} samples")


class _Tokenizer:
    """The tokenizer calls of MDPO's scoring: the (given) prompt batch, decoding (the rewards are given), ids."""
    eos_token_id, mask_token_id = PAD, MASK_ID

    def __init__(self, prompt_ids, prompt_mask):
        self.batch = {"input_ids": prompt_ids, "attention_mask": prompt_mask}

    def __call__(self, **kwargs):
        return dict(self.batch)

    def __len__(self):
        return VOCAB

    def batch_decode(self, ids, **kwargs):
        return [""] * len(ids)


class _Gather:
    """accelerate's ``gather`` on one of a group's devices: its first call (the step advantages) returns
    ``first(local)``, later calls (metrics) the local value."""

    def __init__(self, first):
        self.first, self.calls = first, 0

    def __call__(self, tensor):
        self.calls += 1
        return self.first(tensor) if self.calls == 1 else tensor


class _TrainerBase:
    """transformers.Trainer as MDPOTrainer's ``_generate_and_score_completions`` uses it: ``_prepare_inputs``
    (device placement) is the identity, every other attribute it was not given is an inert stub."""

    def _prepare_inputs(self, inputs):
        return inputs

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return Stub()


@case("mdpo", MDPO)
def mdpo(ref):
    """MDPO as its recipe runs it (``config_demo.yaml``: one sample per device, ``num_generations`` devices per
    prompt): for every sample ("device") the authors' ``_generate_and_score_completions`` scores each intermediate
    prediction x0^(s) (the reward function returns given per-step rewards) and turns them into step advantages
    (reward differences + 1 + mean future reward, z-scored over the group gathered from its devices with the
    unbiased std + 1e-4); their ``split_into_micro_batches`` picks the ``sample_train_steps`` steps with the largest
    |A_s|; their ``compute_loss`` is each step's loss (1/t weight L / #masked, confidence weight, KL2). A device's loss
    is the sum over its steps (one backward each); the total is the mean over devices (DDP gradient averaging).

    dare trains a group on one rank and pools the selection and the token counts over its batch, so the case makes
    them coincide: every sample commits the same number of tokens per step, and the rewards differ within a group
    only at step 2, so that exactly steps 0-3 have A != 0 for every sample and the top 4 steps are the same."""
    rel = "src/open_r1/mdpo/mdpo_trainer.py"
    mod = load_reference(ref.file(rel), "mdpo", overrides={"transformers": {"Trainer": _TrainerBase}})
    x = rl_inputs(seed=21, eos_rows=0)
    g = x.pop("generator")
    B, Lc = x["completion_ids"].shape
    S, k, G = 6, 4, 3
    P = x["prompt_ids"].shape[1]
    final = x["completion_ids"]
    schedule = torch.tensor([1, 1, 2, 1, 2, 1])  # tokens committed per step, the same for every sample
    step_of = torch.stack([torch.repeat_interleave(torch.arange(S), schedule)[torch.randperm(Lc, generator=g)]
                           for _ in range(B)])
    states = torch.stack([torch.where(step_of >= s, MASK_ID, final) for s in range(S)], 1)  # x^(s) [B, S, Lc]
    guesses = torch.randint(FIRST_TOKEN, VOCAB, (B, S, Lc), generator=g)  # predictions that a later step revises
    x0 = torch.where(step_of[:, None] <= torch.arange(S)[None, :, None], final[:, None], guesses)
    conf = torch.where(states == MASK_ID, 0.05 + 0.95 * torch.rand(B, S, Lc, generator=g, dtype=torch.float64), 0.0)
    step_rewards = torch.rand(B // G, S, generator=g, dtype=torch.float64).repeat_interleave(G, 0)
    step_rewards[:, 2] += torch.rand(B, generator=g, dtype=torch.float64)
    logp = log_probs(g, S, B, Lc).requires_grad_()  # log pi(x0^(s) | x^(s)) per step
    ref_lp = perturbed(g, logp.detach())
    REF = object()
    net = SimpleNamespace(module=SimpleNamespace(config=SimpleNamespace(model_type="LLaDA")))
    local_adv: dict = {}

    def device(i: int, gather):
        """Sample i on its own device: (its trajectory dict, the per-step loss micro-batches)."""
        def reward(prompts, completions, **kwargs):  # called once per step, in order
            calls.append(None)
            return [float(step_rewards[i, len(calls) - 1])]

        def per_token_logps(model, input_ids, target_ids, attention_mask):
            s = [j for j in range(S) if torch.equal(input_ids[0, P:], states[i, j])]
            return (ref_lp if model is REF else logp)[s[0], i:i + 1]

        calls: list = []
        reward.__name__ = "given_step_rewards"
        one = slice(i, i + 1)
        tr = trainer(mod.MDPOTrainer, args=SimpleNamespace(diffusion_steps=S, block_length=Lc, sample_train_steps=k),
                     accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda t: t),
                     mixture_data=False, processing_class=_Tokenizer(x["prompt_ids"][one], x["prompt_mask"][one].long()),
                     reward_funcs=[reward], reward_processing_classes=[None], reward_weights=torch.ones(1),
                     num_generations=G, log_completions=False, max_prompt_length=P,
                     _metrics=defaultdict(lambda: defaultdict(list)), control=SimpleNamespace(should_evaluate=False),
                     beta=0.04, epsilon=0.2, num_iterations=1, max_completion_length=Lc, ref_model=REF,
                     _get_per_token_logps=per_token_logps,
                     generation_fn=lambda model, prompt_ids, **kw: (None, list(x0[one].unbind(1)),
                                                                    list(conf[one].unbind(1)),
                                                                    list(states[one].unbind(1))))
        mod.gather = gather
        traj = tr._generate_and_score_completions([{"prompt": f"prompt {i // G}", "solution": ""}])
        assert len(calls) == S
        return traj, tr

    # Pass 1: each device's own raw step advantages (what it contributes to the gather).
    for i in range(B):
        device(i, _Gather(lambda t, i=i: local_adv.setdefault(i, t.clone()).repeat(G, 1)))
    # Pass 2: the gather returns the device's group; then the steps and the loss.
    losses = []
    for i in range(B):
        group = torch.cat([local_adv[j] for j in range(i // G * G, i // G * G + G)])
        traj, tr = device(i, _Gather(lambda t, group=group: group))
        losses.append(sum(tr.compute_loss(net, inputs) for inputs in tr.split_into_micro_batches(traj)))
    loss = torch.stack(losses).mean()
    cfg = dict(inner_iterations=1, clip_low=0.2, clip_high=None, beta=0.04, kl_estimator="k2", advantage_eps=1e-4,
               sample_train_steps=k, confidence_weight=True)
    return record("mdpo", cfg, {**_seq(x), "states": states, "x0": x0, "confidence": conf,
                                "step_rewards": step_rewards, "ref_logp": ref_lp}, {"logp_steps": logp}, loss,
                  ref.meta(rel, "MDPOTrainer._generate_and_score_completions (step advantages), "
                                "split_into_micro_batches, compute_loss; one sample per device, mean over devices"),
                  runner="mdpo", note=f"{S} denoising steps, the top {k} trained; "
                                      f"logp_steps[s] = log pi(x0^(s) | x^(s))")

from pathlib import Path

import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms import Algorithm
from dare.algorithms.justgrpo import JustGRPOConfig, ar_targets
from dare.trainer.recipe import load_recipe
from dare.models import masks, tiny, tiny_tokenizer
from dare.rollout import SamplerConfig
from dare.trainer import stages
from tests.algorithms.helpers import corrupt, rl_batch
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture)
from tests.algorithms.trajectory_helpers import rollout_batch
from tests.trainer.two_processes import register, same_history, trajectory_case

ROOT = Path(__file__).resolve().parents[2]


def _setup(family="llada", **cfg):
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=2)
    if model.adapter.is_block_causal:
        model.adapter.block_size = 4  # the checkpoint's block; JustGRPO attends with the sampler's block length 1
    algo = build_algorithm(JustGRPOConfig(**cfg))
    ctx = StepContext(step=1, seed=3, adapter=model.adapter)
    return model, algo, ctx


def brute_force_logp(model, batch, targets, temperature=1.0):
    """``[B, Lc]``: one unpadded masked sequence per scored token, exactly the sampler's input at that step.

    Bidirectional models see ``[prompt ; y_<t ; MASK * (Lc - t)]``; block models decoding with block length 1 see
    ``[prompt ; y_<t ; MASK]`` under causal attention (blocks of one token)."""
    mask_id = model.adapter.mask_token_id
    comp = batch.completion_ids
    B, Lc = comp.shape
    out = torch.zeros(B, Lc)
    for i in range(B):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]]
        P = prompt.numel()
        for t in targets[i].nonzero().flatten().tolist():
            if model.adapter.is_block_causal:
                x = torch.cat([prompt, comp[i, :t], torch.tensor([mask_id])])[None]
                pos = torch.arange(x.shape[1])[None]
                plain = masks.TokenLayout.plain(pos)
                logits = model(x, attention_mask=masks.dense_mask(plain, plain, 1), position_ids=pos).logits
            else:
                x = torch.cat([prompt, comp[i, :t], torch.full((Lc - t,), mask_id)])[None]
                logits = model.adapter.prediction_logits(model(x).logits)
            lp = (logits[0, P + t].float() / temperature).log_softmax(-1)
            out[i, t] = lp[comp[i, t]]
    return out


def _scored(algo, ctx, model, batch):
    views = corrupt(algo, ctx, batch, 0)
    with torch.no_grad():
        return algo.log_likelihood(ctx, model, batch, views).value


@pytest.mark.parametrize("family,pack", [("llada", 10_000), ("llada", 40), ("dream", 1), ("sdar", 0)])
def test_summed_token_logps_equal_the_brute_force_likelihood(family, pack):
    """Golden: per-token AR log-probs (packed states / one block-size-1 pass) = one masked sequence per token."""
    model, algo, ctx = _setup(family, tokens_per_forward=max(pack, 1))
    batch = rl_batch(n_prompts=2, group=2, prompt_lens=(5, 9), gen_len=7, seed=4)
    ctx.services.rollout_sampler = SamplerConfig(temperature=0.7)  # JustGRPO scores the sampler's policy
    batch.step_map = torch.arange(7).expand(4, 7).clone()
    ours = _scored(algo, ctx, model, batch)
    targets = batch.state.targets
    assert torch.equal(targets, batch.completion_mask | True)  # post_tokens=None: every written position
    brute = brute_force_logp(model, batch, targets, temperature=0.7)
    assert torch.allclose(ours[targets], brute[targets], atol=2e-5), (ours - brute).abs().max()
    assert torch.allclose(ours.sum(1), brute.sum(1), atol=1e-4)  # the completion's exact log-likelihood
    assert (ours[~targets] == 0).all()


def test_states_are_stacked_into_few_forwards_and_block_models_take_one():
    model, algo, ctx = _setup("llada", tokens_per_forward=64)
    batch = rl_batch(n_prompts=2, group=2, prompt_lens=(5, 9), gen_len=7, seed=4)
    corrupt(algo, ctx, batch, 0)
    n_states = int(batch.state.targets.sum())
    per = 64 // (9 + 7)  # padded prompt width + gen_length
    views = algo.forwards(ctx, batch)
    assert len(views) == -(-n_states // per) and all(v.input_ids.shape[0] <= per for v in views)
    assert sum(int(v.targets.sum()) for v in views) == n_states
    model, algo, ctx = _setup("sdar")
    corrupt(algo, ctx, batch, 0)
    assert len(algo.forwards(ctx, batch)) == 1


def test_positions_the_sampler_never_wrote_are_not_scored():
    batch = rl_batch(n_prompts=1, group=3, gen_len=8, seed=2)
    cm = batch.completion_mask
    step_map = torch.arange(8).expand(3, 8).clone()
    step_map[~cm] = -1  # block_stop: nothing decoded after the first stop token
    batch.step_map = step_map
    assert torch.equal(ar_targets(batch, None), cm)
    step_map = torch.arange(8).expand(3, 8).clone()
    batch.step_map = step_map
    assert ar_targets(batch, None).all()
    n = cm.long().sum(1, keepdim=True)
    assert torch.equal(ar_targets(batch, 1), torch.arange(8)[None] < n + 1)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_greedy_left_to_right_rollout_picks_the_argmax_of_every_scored_conditional(family):
    """Rollout policy = scored policy: a temperature-0 block-length-1 rollout commits, at every step, the argmax of
    the conditional the likelihood scores (so its tokens have the largest scored log-prob at their position)."""
    model, algo, ctx = _setup(family)
    sampler = SamplerConfig(gen_length=6, block_length=1, temperature=0.0, block_stop=False)
    batch, _ = rollout_batch(model, sampler, n=1)
    targets = ar_targets(batch, None)
    assert targets.all()
    mask_id = model.adapter.mask_token_id
    comp = batch.completion_ids
    for i in range(comp.shape[0]):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]]
        for t in range(6):
            if family == "sdar":
                x = torch.cat([prompt, comp[i, :t], torch.tensor([mask_id])])[None]
                pos = torch.arange(x.shape[1])[None]
                plain = masks.TokenLayout.plain(pos)
                logits = model(x, attention_mask=masks.dense_mask(plain, plain, 1), position_ids=pos).logits
            else:
                x = torch.cat([prompt, comp[i, :t], torch.full((6 - t,), mask_id)])[None]
                logits = model(x).logits
            row = logits[0, prompt.numel() + t].float()
            row[mask_id] = float("-inf")  # the sampler never commits the mask token
            assert int(row.argmax()) == int(comp[i, t])
    ours = _scored(algo, ctx, model, batch)
    assert torch.allclose(ours, brute_force_logp(model, batch, targets), atol=2e-5)


def test_check_rollout_names_the_setting_and_collect_decodes_left_to_right():
    from dare.algorithms.justgrpo import ar_sampler
    model, algo, _ = _setup("llada")
    algo.check_rollout(SamplerConfig(gen_length=8, block_length=8, temperature=1.0), model.adapter)
    bad = [({"cfg_scale": 0.5}, "cfg_scale"), ({"top_p": 0.9}, "top_p"), ({"top_k": 5}, "top_k"),
           ({"temperature": 0.0}, "temperature")]
    for kw, match in bad:
        cfg = SamplerConfig(**{"gen_length": 8, "block_length": 8, "temperature": 1.0, **kw})
        with pytest.raises(ValueError, match=match):
            algo.check_rollout(cfg, model.adapter)
    ar = ar_sampler(SamplerConfig(gen_length=8, block_length=4, steps=4, temperature=0.7, threshold=0.9))
    assert (ar.block_length, ar.steps, ar.temperature, ar.threshold) == (1, 8, 0.7, 0.9)


def test_advantages_use_the_unbiased_std_and_valid_samples_normalise():
    model, algo, ctx = _setup("llada")
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    batch = rl_batch(n_prompts=2, group=3, gen_len=6, seed=1, rewards=rewards)
    batch.advantages = algo.advantages(ctx, batch)
    adv = batch.advantages.values
    g = rewards[:3]
    assert torch.allclose(adv[:3], (g - g.mean()) / (g.std() + 1e-4))  # torch.std: unbiased, as the reference
    assert (adv[3:] == 0).all()
    corrupt(algo, ctx, batch, 0)
    assert algo.normalizers(batch)["seqs"] == 3.0  # the reference's valid_samples


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_loss_and_gradient_match_one_graph_over_the_whole_likelihood(family):
    """At mu = 1 the loss is -sum_t A / (gen_length * valid samples); the per-forward backward accumulates the
    gradient of that single loss."""
    model, algo, ctx = _setup(family, tokens_per_forward=50)
    batch = rl_batch(n_prompts=2, group=3, gen_len=6, seed=5, rewards=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0]))
    batch.step_map = torch.arange(6).expand(6, 6).clone()
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, micro_batch_size=4)
    ctx.norms = algo.normalizers(batch)
    model.zero_grad()
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0
    tgt = batch.state.targets.float()
    expected = -(tgt * batch.advantages.values[:, None]).sum() / (6 * (ctx.norms["seqs"] + 1e-5))
    assert m["loss"] == pytest.approx(float(expected), abs=1e-6)
    split = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for mb in batch.split(4):  # one graph: the base class's backward (log_likelihood -> loss -> backward)
        Algorithm.backward(algo, ctx, model, mb, 0)
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(split[n], p.grad, atol=1e-6), n


def test_learning_step_is_deterministic_across_micro_batching():
    model, algo, ctx = _setup("llada")
    batch = rl_batch(n_prompts=2, group=3, gen_len=6, seed=6, rewards=torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.2]))
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    a = stages.update(algo, ctx, model, batch, 0, micro_batch_size=6)
    model.zero_grad()
    b = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/justgrpo.yaml")
    cfg = recipe.algorithm
    assert isinstance(cfg, JustGRPOConfig) and cfg.clip_low == 0.2 and cfg.beta == 0.0 and cfg.inner_iterations == 1
    assert cfg.advantage == "mean_std" and cfg.advantage_eps == 1e-4 and cfg.aggregation == "seq_mean_token_sum_norm"
    assert recipe.rollout.sampler.block_length == 1 and recipe.rollout.sampler.temperature == 1.0


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_learns_a_toy_reward(tmp_path, family):
    # (the test's sampler has block length 4 / 8: JustGRPO decodes it left to right with block length 1). On SDAR the
    # reward climbs more slowly at the shared lr (seed 0: 0.02 -> 0.21 mean of the last 5 of 15 steps, 1.0 by step
    # 25), so it gets 25 steps there.
    steps = ["train.steps=25"] if family == "sdar" else []
    learns_toy_reward(tmp_path, "justgrpo", family, "algorithm.inner_iterations=4", *steps)


def test_padding_views_score_nothing_and_keep_the_gradient_path(monkeypatch):
    """Ranks agree on the number of forwards (FSDP): the extra views of a rank with fewer states score nothing."""
    import dare.algorithms.justgrpo as jg
    model, algo, ctx = _setup("llada", tokens_per_forward=40)
    batch = rl_batch(n_prompts=1, group=2, gen_len=5, seed=3, rewards=torch.tensor([1.0, 0.0]))
    batch.step_map = torch.arange(5).expand(2, 5).clone()
    views = corrupt(algo, ctx, batch, 0)
    base = len(algo.forwards(ctx, batch))
    with torch.no_grad():
        before = algo.log_likelihood(ctx, model, batch, views).value
    monkeypatch.setattr(jg, "agree_max", lambda values, device: [v + 2 for v in values])
    padded = algo.forwards(ctx, batch)
    assert len(padded) == base + 2 and not padded[-1].targets.any()
    with torch.no_grad():
        after = algo.log_likelihood(ctx, model, batch, views).value
    assert torch.equal(before, after)
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    algo.backward(ctx, model, batch, 0)


TWO_PROCESS = register({"justgrpo_llada": trajectory_case(
    "justgrpo", "model.path=tiny:llada", "train.steps=2", "train.batch_size=4", "rollout.group_size=4",
    "rollout.sampler={gen_length: 8, block_length: 1, steps: 8, temperature: 1.0}", "algorithm.tokens_per_forward=200")})


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TWO_PROCESS)
def test_two_processes_reproduce_one_process(two_process_runs, case):
    """Ranks hold different numbers of AR states (rows stop early): they agree on the number of forwards (FSDP) and
    the global normalisers make the 2-process losses equal the 1-process ones."""
    first, second = two_process_runs(case)
    one, two = first.metrics, second.metrics
    assert any(abs(a["loss"]) > 1e-6 for a in one)
    assert len(one) == len(two) == 2 and all(a["completion_len"] == b["completion_len"] for a, b in zip(one, two))
    same_history(one, two, ("loss", "entropy", "grad_norm", "ratio_mean"))

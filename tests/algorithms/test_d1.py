import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.d1 import D1Config
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.block_checks import (assert_future_blocks_invisible, assert_matches_brute_force, block_model,
                                           brute_force_logp, naive_block_causal_logp, row_blocks)
from tests.algorithms.helpers import rl_batch
from tests.threads import TEST_THREADS


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: intra-op threads only spin on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)


def _setup(**cfg):
    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, seed=0, num_layers=1)
    algo = build_algorithm(D1Config(**cfg))
    ctx = StepContext(step=3, seed=11, adapter=model.adapter)
    return model, algo, ctx


def test_masked_prompt_fraction_is_p_and_completion_fully_masked():
    model, algo, ctx = _setup(p_mask_prompt=0.3)
    batch = rl_batch(n_prompts=40, group=2, prompt_lens=(30, 50), gen_len=6)
    (view,) = algo.corrupt(ctx, batch, 0)
    P = batch.prompt_ids.shape[1]
    masked = view.info["prompt_masked"]
    real = batch.prompt_mask
    assert not masked[~real].any()  # padding is never "masked"
    frac = masked[real].float().mean().item()
    assert abs(frac - 0.3) < 0.03, frac
    assert (view.input_ids[:, P:] == model.adapter.mask_token_id).all()
    assert ((view.input_ids[:, :P] == model.adapter.mask_token_id) == masked).all()
    # only completion positions up to the first EOS are scored
    assert torch.equal(view.targets[:, P:], batch.completion_mask) and not view.targets[:, :P].any()


def test_noise_repeats_across_passes_and_microbatches_and_differs_across_iterations():
    _, algo, ctx = _setup(p_mask_prompt=0.5)
    batch = rl_batch(n_prompts=3, group=2)
    a = algo.corrupt(ctx, batch, 0)[0]
    b = algo.corrupt(ctx, batch, 0)[0]
    c = algo.corrupt(ctx, batch, 1)[0]
    assert torch.equal(a.input_ids, b.input_ids)
    assert not torch.equal(a.input_ids, c.input_ids)
    sub = algo.corrupt(ctx, batch.select([4, 1]), 0)[0]
    assert torch.equal(sub.input_ids, a.input_ids[[4, 1]])


def test_ratio_is_one_and_clip_inactive_at_first_inner_step():
    model, algo, ctx = _setup(inner_iterations=2, beta=0.0, p_mask_prompt=0.2)
    batch = rl_batch(n_prompts=2, group=3, seed=4)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, micro_batch_size=3)
    # identical noise between the old-logp pass and the training pass
    assert set(batch.old_logp) == {0, 1}
    ctx.norms = {k: v for k, v in algo.normalizers(batch).items()}
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac"] == 0.0
    # rho = 1 -> loss = -sum(m A) / sum(m)
    m = batch.completion_mask.float()
    expected = -(m * batch.advantages.values[:, None]).sum() / m.sum()
    assert abs(metrics["loss"] - expected.item()) < 1e-6


def test_mean_field_logp_ignores_other_completion_tokens():
    model, algo, ctx = _setup(p_mask_prompt=0.0)
    batch = rl_batch(n_prompts=1, group=2, gen_len=6, seed=2)
    batch.completion_mask[:] = True
    before = algo.log_likelihood(ctx, model, batch, algo.corrupt(ctx, batch, 0)).value
    batch.completion_ids[:, 3] = (batch.completion_ids[:, 3] + 7) % 90 + 10
    after = algo.log_likelihood(ctx, model, batch, algo.corrupt(ctx, batch, 0)).value
    keep = [0, 1, 2, 4, 5]
    assert torch.equal(before[:, keep], after[:, keep])
    assert not torch.equal(before[:, 3], after[:, 3])


def test_kl_to_reference_and_gradient_flow():
    model, algo, ctx = _setup(inner_iterations=1, beta=0.04)

    class SameRef:  # reference identical to the policy -> KL exactly 0
        def scoring(self):
            return stages.frozen(model)

    batch = rl_batch(n_prompts=2, group=2, seed=5)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, reference=SameRef())
    ctx.norms = algo.normalizers(batch)
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)
    assert metrics["kl"] == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


# --- block-diffusion models (SDAR, LLaDA2): the [x_t ; x_0] one-step estimate -----------------------------------


def _block_setup(family="sdar", **cfg):
    model = block_model(family)
    return model, build_algorithm(D1Config(**cfg)), StepContext(step=3, seed=11, adapter=model.adapter)


def test_block_view_masks_all_of_x_t_and_puts_the_masked_prompt_in_both_halves():
    model, algo, ctx = _block_setup(p_mask_prompt=0.3)
    batch = rl_batch(n_prompts=2, group=2, prompt_lens=(5, 8), gen_len=12, seed=1)
    (v,) = algo.corrupt(ctx, batch, 0)
    P, mask_id = batch.prompt_ids.shape[1], model.adapter.mask_token_id
    W = P + 12
    noisy, clean = v.input_ids[:, :W], v.input_ids[:, W:]
    assert (noisy[:, P:] == mask_id).all() and torch.equal(clean[:, P:], batch.completion_ids)
    assert torch.equal(noisy[:, :P], clean[:, :P])  # the condition x~ of every block
    masked = v.info["prompt_masked"]
    assert masked.any() and torch.equal(noisy[:, :P] == mask_id, masked)
    assert torch.equal(v.targets[:, P:], batch.completion_mask) and not v.targets[:, :P].any()


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_estimate_equals_per_block_forwards_on_a_clean_prefix(family):
    model, algo, ctx = _block_setup(family, p_mask_prompt=0.2)
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=2)
    views = algo.corrupt(ctx, batch, 0)
    assert_matches_brute_force(model, batch, views)
    P = batch.prompt_ids.shape[1]
    value = algo.log_likelihood(ctx, model, batch, views).value
    brute = brute_force_logp(model, batch, views[0], 4)[:, P:]
    m = batch.completion_mask
    assert torch.allclose(value[m], brute[m], atol=1e-5)
    # The plain block-causal input of x_t conditions later blocks on *masked* earlier blocks: a different estimate.
    naive = naive_block_causal_logp(model, views[0], P + 12)[:, P:]
    first = torch.tensor([row_blocks(batch, i, 4)[0][1] - P for i in range(batch.size)])
    later = m & (torch.arange(12)[None] >= first[:, None])
    assert later.any() and not torch.allclose(naive[later], brute[later], atol=1e-3)


def test_block_terms_ignore_later_blocks():
    model, algo, ctx = _block_setup(p_mask_prompt=0.0)
    batch = rl_batch(n_prompts=2, group=2, gen_len=12, seed=3)
    assert_future_blocks_invisible(model, batch, algo.corrupt(ctx, batch, 0))


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_block_ratio_is_one_at_first_inner_step(family):
    model, algo, ctx = _block_setup(family, inner_iterations=2, beta=0.0, p_mask_prompt=0.2)
    batch = rl_batch(n_prompts=2, group=3, seed=4)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, micro_batch_size=3)
    ctx.norms = algo.normalizers(batch)
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac"] == 0.0
    m = batch.completion_mask.float()
    assert abs(metrics["loss"] + ((m * batch.advantages.values[:, None]).sum() / m.sum()).item()) < 1e-6
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_supports_every_attention_kind_and_names_it_in_errors():
    _, algo, ctx = _setup()
    assert set(algo.supports) == {"bidirectional", "block_causal", "encoder_decoder"}
    algo.supports = ("block_causal",)  # a narrowed instance: the clear error names the kinds and families
    with pytest.raises(ValueError, match="block_causal.*bidirectional.*sdar"):  # the trainer's start-up check
        algo.check_model(ctx.adapter)


@pytest.mark.integration
@pytest.mark.parametrize("family", ["sdar", "llada2_moe"])
def test_block_models_learn_a_toy_reward(tmp_path, family):
    """15 steps of recipes/d1_tiny.yaml on a block model: the toy '7' reward rises by more than 0.3 (from about 0.03)."""
    from dare.trainer.recipe import load_recipe
    from dare.trainer.loop import Trainer
    from tests.algorithms.toy_task import ROOT  # registers the toy reward
    recipe = load_recipe(ROOT / "recipes/d1_tiny.yaml", [
        f"model.path=tiny:{family}", "train.steps=15", "train.batch_size=4", "train.micro_batch_size=16",
        "rollout.group_size=8", "rollout.sampler={gen_length: 8, block_length: 4, steps: 8, temperature: 1.0}",
        "reward.name=mc_test_sevens", "reward.workers=0", "data.dataset.limit=64", f"train.output_dir={tmp_path}",
        "optim.lr=3e-3", "optim.weight_decay=0.0", "algorithm.beta=0.0", "train.export=false", "train.save_every=0",
        "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"])
    rewards = [h["reward_mean"] for h in Trainer(recipe).run()]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards

import math

import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.dpo import DPOConfig, VRPOConfig
from dare.trainer.recipe import DataSection
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from dare.trainer.data import PreferenceSource, load_preference_pairs
from dare.trainer.reference import CopyReference
from tests.threads import TEST_THREADS
from tests.trainer.helpers import TOY_PREF


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: intra-op threads only spin on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)


def _setup(cfg, family="llada", n_pairs=3, step=0):
    tok = tiny_tokenizer()
    model = tiny(family, tokenizer=tok, num_layers=1, hidden_size=32, seed=1)
    pairs = load_preference_pairs(DataSection(pairs=str(TOY_PREF), max_length=64), tok)
    batch = PreferenceSource(pairs, n_pairs, seed=0, pad_id=tok.eos_token_id).batch(step)
    algo = build_algorithm(cfg)
    ctx = StepContext(step=step, seed=3, adapter=model.adapter)
    return model, algo, ctx, batch


def _margins(model, algo, ctx, batch):
    ref = CopyReference.from_policy(model)
    stages.prepare(algo, ctx, batch, model, ref)
    ctx.norms = algo.normalizers(batch)
    with torch.no_grad():
        cur = algo.log_likelihood(ctx, model, batch, batch.views[0])
        loss, _ = algo.loss(ctx, batch, cur, 0)
    return algo.margin(batch, cur.value, 0), loss.item()


@pytest.mark.parametrize("family", ["llada", "sdar"])
@pytest.mark.parametrize("n", [1, 4])
def test_margin_is_exactly_zero_at_reference_with_shared_noise(family, n):
    model, algo, ctx, batch = _setup(VRPOConfig(mc_samples=n), family)
    s, loss = _margins(model, algo, ctx, batch)
    assert torch.equal(s, torch.zeros_like(s))
    assert loss == pytest.approx(math.log(2), abs=1e-7)


def test_margin_is_not_zero_without_shared_noise():
    model, algo, ctx, batch = _setup(VRPOConfig(mc_samples=2, antithetic=False))
    s, loss = _margins(model, algo, ctx, batch)
    assert (s.abs() > 1e-4).all() and loss != pytest.approx(math.log(2))
    assert batch.ref_views is not None


def test_one_mask_per_timestep_means_n_forwards_per_response():
    model, algo, ctx, batch = _setup(VRPOConfig(mc_samples=8))
    views = algo.corrupt(ctx, batch, 0)
    assert len(views) == 16
    slots = torch.stack([v.info["slot"][0] for v in views])
    assert slots.tolist() == [0] * 8 + [1] * 8


@pytest.mark.parametrize("estimator", ["inv_t", "count"])
def test_two_pass_gradient_equals_full_autograd(estimator):
    grads = []
    for two_pass in (False, True):
        model, algo, ctx, batch = _setup(VRPOConfig(mc_samples=3, two_pass=two_pass, estimator=estimator, beta=0.5))
        ref = CopyReference.from_policy(model)
        with torch.no_grad():  # move the policy off the reference so that sigma(-s) is not 1/2 everywhere
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        stages.prepare(algo, ctx, batch, model, ref)
        ctx.norms = algo.normalizers(batch)
        m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=2)
        grads.append(([p.grad.clone() for p in model.parameters()], m["loss"]))
    (g_full, l_full), (g_two, l_two) = grads
    assert l_full == pytest.approx(l_two, abs=1e-6)
    for a, b in zip(g_full, g_two):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in g_full)


def _exact_elbo(model, batch, resp="chosen"):
    """sum over all masked subsets S of the response of 1/(|S| C(L,|S|)) sum_{i in S} log p(y_i | y_S masked):
    the common expectation of the 1/t and L/l estimators."""
    from itertools import combinations
    from dare.diffusion import score_targets
    prompt = batch["prompt_ids"][0][batch["prompt_mask"][0]]
    y = batch[f"{resp}_ids"][0][batch[f"{resp}_mask"][0]]
    L, P = len(y), len(prompt)
    total = 0.0
    for k in range(1, L + 1):
        for S in combinations(range(L), k):
            ids = torch.cat([prompt, y])[None].clone()
            tgt = torch.zeros_like(ids, dtype=torch.bool)
            for i in S:
                ids[0, P + i] = model.adapter.mask_token_id
                tgt[0, P + i] = True
            with torch.no_grad():
                lp, _ = score_targets(model, ids, tgt, torch.cat([prompt, y])[None])
            total += lp.sum().item() / (k * math.comb(L, k))
    return total


@pytest.mark.parametrize("estimator", ["inv_t", "count"])
def test_inverse_t_and_count_estimators_are_unbiased(estimator):
    from dare.trainer.data import PreferencePair
    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, num_layers=1, hidden_size=32, seed=1)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    pair = PreferencePair(0, enc("reverse 123"), enc("321") + [1], enc("123") + [1])
    batch = PreferenceSource([pair], 1, seed=0, pad_id=1).batch(0)
    exact = _exact_elbo(model, batch)
    draws_per_step = 50 if estimator == "inv_t" else 10  # the L/l form has a far smaller variance
    algo = build_algorithm(DPOConfig(mc_samples=draws_per_step, estimator=estimator, stratified=False))
    ctx = StepContext(step=0, seed=3, adapter=model.adapter)
    draws = []
    for step in range(6):  # 300 (inv_t) / 60 (count) single-sample estimates
        ctx.step = step
        views = [v for v in algo.corrupt(ctx, batch, 0) if int(v.info["slot"][0]) == 0]
        with torch.no_grad():
            draws += [algo.view_value(ctx, model, v)[0, 0].item() * draws_per_step for v in views]
    d = torch.tensor(draws)
    se = d.std() / math.sqrt(len(d))
    assert abs(d.mean().item() - exact) < 4 * se.item(), (d.mean().item(), exact, se.item())

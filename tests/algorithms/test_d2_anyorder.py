"""d2-AnyOrder: the one-pass trajectory likelihood of an any-order rollout (docs/algorithms/d2_anyorder.md).

Golden invariants: the one forward gives, for every token, the log-prob of the token given the state before the step
that decoded it -- checked against a brute-force enumeration (one forward per step, in the authors' decode-order
layout, holding only the prompt, the tokens decoded so far and that step's masks) and against the sampler's own
confidences; with two tokens per step the attention is the authors' pair mask.
"""
import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.d2_anyorder import D2AnyOrderConfig
from dare.algorithms.advantages import group_advantages
from dare.diffusion.anyorder import anyorder_attention
from dare.models import tiny, tiny_tokenizer
from dare.rollout.config import SamplerConfig
from dare.trainer import stages
from tests.algorithms.helpers import corrupt, learning_families
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture)
from tests.algorithms.trajectory_helpers import rollout_batch
from tests.algorithms.parity_io import TableModel, completion_hidden, stub_adapter
from tests.algorithms.test_loss_parity import case_batch, leaf, runner

PROMPTS = ("abc", "hello there")  # different lengths: the shorter prompt is left-padded


def _setup(family="llada", **config):
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=2).double()
    algo = build_algorithm(D2AnyOrderConfig(**config))
    return model, algo, StepContext(step=1, seed=3, adapter=model.adapter)


def _rollout(model, gen_length=8, block_length=4, steps=6, **kw):
    sampler = SamplerConfig(gen_length=gen_length, block_length=block_length, steps=steps, temperature=1.0,
                            any_order=True, block_stop=False, **kw)
    batch, r = rollout_batch(model, sampler, prompts=PROMPTS, n=2)
    batch.completion_mask[:] = True  # score every token (the tiny model's EOS would end some completions early)
    return batch, r


def brute_force(model, batch) -> torch.Tensor:
    """``[B, Lc]`` log pi(y_j | prompt, tokens decoded at steps before j's), one forward per (row, step): the input is
    the row's real prompt, then the tokens decoded before the step *in decoding order* (ties by position), then one
    [MASK] per token of the step -- no other mask, no padding. Prompt rows see the prompt, decoded token i the prompt
    and decoded tokens <= i, a mask the prompt, every decoded token and itself (the authors' generation-time bias)."""
    shift = 1 if model.adapter.shift_logits else 0
    mask_id = model.adapter.mask_token_id
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float64)
    for i in range(batch.size):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i]]
        p, comp, steps = prompt.numel(), batch.completion_ids[i], batch.step_map[i]
        for s in torch.unique(steps).tolist():
            before = sorted((int(steps[j]), j) for j in range(comp.numel()) if steps[j] < s)
            now = [j for j in range(comp.numel()) if steps[j] == s]
            dec = [j for _, j in before]
            ids = torch.cat([prompt, comp[dec], torch.full((len(now),), mask_id)])
            pos = torch.cat([torch.arange(p), p + torch.tensor(dec, dtype=torch.long),
                             p + torch.tensor(now) - shift])
            n, d = ids.numel(), len(dec)
            att = torch.zeros(n, n, dtype=torch.bool)
            att[:, :p] = True
            att[:p, p:] = False
            att[p:p + d, p:p + d] = torch.tril(torch.ones(d, d, dtype=torch.bool))
            att[p + d:, p:p + d] = True
            att[p + d:, p + d:] = torch.eye(len(now), dtype=torch.bool)
            logits = model(ids[None], attention_mask=att[None, None], position_ids=pos[None]).logits[0]
            logp = torch.log_softmax(logits[p + d:].double(), -1)
            out[i, now] = logp[torch.arange(len(now)), comp[now]]
    return out


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_one_pass_likelihood_equals_step_by_step_enumeration(family):
    """Uneven tokens per step (blocks of 4 in 3 steps: 2, 1, 1), left padding, Dream's shifted head."""
    model, algo, ctx = _setup(family)
    batch, r = _rollout(model)
    assert {int((batch.step_map[0] == s).sum()) for s in range(6)} == {1, 2}
    views = corrupt(algo, ctx, batch, 0)
    assert len(views) == 1
    with torch.no_grad():
        one_pass = algo.log_likelihood(ctx, model, batch, views).value.double()
        brute = brute_force(model, batch)
    torch.testing.assert_close(one_pass, brute, rtol=0, atol=2e-6)  # dare scores in fp32
    # ... which is what the sampler drew from: its confidence of the committed token (temperature 1)
    conf = r.trajectory.confidence.gather(1, batch.step_map[:, None, :]).squeeze(1)
    torch.testing.assert_close(one_pass, conf.double().log(), rtol=0, atol=1e-5)
    # the trajectory log-likelihood depends on the order: exchanging the steps of two tokens changes it
    swapped = batch.step_map.clone()
    a, b = (swapped[0] == 0).nonzero()[0, 0], (swapped[0] == 5).nonzero()[0, 0]
    swapped[0, a], swapped[0, b] = 5, 0
    batch.step_map = swapped
    with torch.no_grad():
        other = algo.log_likelihood(ctx, model, batch, corrupt(algo, ctx, batch, 0)).value
    assert not torch.allclose(other[0].double(), one_pass[0]) and torch.equal(other[1:].double(), one_pass[1:])


def test_two_tokens_per_step_is_the_authors_pair_mask():
    """In decoding order with two tokens per step the mask is the authors' ``get_logits`` bias: every row sees the
    prompt; clean slot r sees clean slots <= r (tril); mask row r sees clean slots c with c // 2 < r // 2 and itself;
    prompt rows see only the prompt."""
    g = torch.Generator().manual_seed(0)
    P, L = 3, 8
    step = (torch.arange(L) // 2)[torch.randperm(L, generator=g)][None]  # 4 steps of 2 tokens, in a random order
    mask = anyorder_attention(torch.ones(1, P, dtype=torch.bool), step, step)[0, 0]
    order = sorted(range(L), key=lambda j: (int(step[0, j]), j))  # slot r holds token order[r]
    perm = list(range(P)) + [P + j for j in order] + [P + L + j for j in order]
    got = mask[perm][:, perm]
    want = torch.zeros(P + 2 * L, P + 2 * L, dtype=torch.bool)
    want[:, :P] = True
    want[P:P + L, P:P + L] = torch.tril(torch.ones(L, L, dtype=torch.bool))
    r = torch.arange(L)
    want[P + L:, P:P + L] = (r[None] // 2) < (r[:, None] // 2)
    want[P + L + r, P + L + r] = True
    assert torch.equal(got, want)


def test_sampler_and_rollout_checks():
    model, algo, _ = _setup()
    with pytest.raises(ValueError, match="any_order: true"):
        algo.check_rollout(SamplerConfig(gen_length=8, block_length=8), model.adapter)
    algo.check_rollout(SamplerConfig(gen_length=8, block_length=8, any_order=True), model.adapter)
    with pytest.raises(ValueError, match="cache='none'"):
        SamplerConfig(gen_length=8, block_length=8, any_order=True, cache="dual")
    from dare.rollout.api import generate
    sdar = tiny("sdar", tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    with pytest.raises(ValueError, match="any_order is a masked-diffusion"):
        generate(sdar, [[5, 6, 7]], SamplerConfig(gen_length=4, block_length=4, steps=4, any_order=True))
    batch, _ = _rollout(model)
    batch.step_map = None
    with pytest.raises(ValueError, match="step_map"):
        algo.prepare(StepContext(step=0, seed=0, adapter=model.adapter), batch)


def test_advantages_use_the_unbiased_std_and_the_loss_is_the_token_mean():
    model, algo, ctx = _setup(inner_iterations=2, beta=0.0)
    batch, _ = _rollout(model)
    batch.rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])  # second group: equal rewards, advantage 0
    adv = algo.advantages(ctx, batch).values
    r = batch.rewards.view(2, 2)
    want = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).flatten()  # the authors' torch.std
    torch.testing.assert_close(adv, want.float())
    assert torch.equal(group_advantages(batch.rewards, batch.group, "mean_std_unbiased", 0.0)[2:], torch.zeros(2))
    batch.advantages = algo.advantages(ctx, batch)
    batch.completion_mask[0, 5:] = False
    stages.prepare(algo, ctx, batch, model)
    assert batch.views[1] is batch.views[0] and batch.old_logp[1] is batch.old_logp[0]  # scored once per rollout
    ctx.norms = algo.normalizers(batch)
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    cm = batch.completion_mask.float()
    expected = -(adv.double()[:, None] * cm).sum() / cm.sum()  # ratio 1: -sum A / tokens
    assert abs(m["ratio_mean"] - 1.0) < 1e-9 and abs(m["loss"] - expected.item()) < 1e-7


@pytest.mark.integration
@pytest.mark.parametrize("family", learning_families("d2_anyorder"))
def test_learns_toy_reward(tmp_path, family):
    """Two tokens per step, as the authors' any-order sampler."""
    learns_toy_reward(tmp_path, "d2_anyorder", family, "algorithm.beta=0.0",
                      sampler="{gen_length: 8, block_length: 8, steps: 4, temperature: 1.0, any_order: true}")


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("d2_anyorder")
def loss_parity_d2_anyorder(algo, x, monkeypatch):
    """d2-AnyOrder: the one-pass view of the step map -- its attention and positions, put in the reference's decoding
    order, must be the reference's ``get_logits`` bias and position ids -- scored with the leaf at its queries, the
    loss."""
    from types import SimpleNamespace
    batch = case_batch(x, step_map=x["step_map"])
    ctx = StepContext(step=0, seed=0, adapter=SimpleNamespace(**vars(stub_adapter()), shift_logits=False))
    (view,) = batch.views[0] = corrupt(algo, ctx, batch, 0)
    ctx.norms = algo.normalizers(batch)
    B, P = x["prompt_ids"].shape
    Lc = x["completion_ids"].shape[1]
    for i in range(B):
        order = x["decode_order"][i]
        perm = torch.cat([torch.arange(P), P + order, P + Lc + order])
        assert torch.equal(view.attention_mask[i, 0][perm][:, perm], x["ref_attend"][i])
        assert torch.equal(view.position_ids[i][perm], x["ref_position_ids"][i])
    logp = leaf(x, "logp")
    current = algo.log_likelihood(ctx, TableModel([completion_hidden(logp, P + Lc, x["completion_ids"])]), batch,
                                  [view])
    return algo.loss(ctx, batch, current, 0)[0], {"logp": logp}

import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.d1 import D1Config
from dare.models import tiny, tiny_tokenizer
from dare.trainer import stages
from tests.algorithms.helpers import rl_batch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: intra-op threads only spin on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
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
    P = batch["prompt_ids"].shape[1]
    masked = view.info["prompt_masked"]
    real = batch["prompt_mask"]
    assert not masked[~real].any()  # padding is never "masked"
    frac = masked[real].float().mean().item()
    assert abs(frac - 0.3) < 0.03, frac
    assert (view.input_ids[:, P:] == model.adapter.mask_token_id).all()
    assert ((view.input_ids[:, :P] == model.adapter.mask_token_id) == masked).all()
    # only completion positions up to the first EOS are scored
    assert torch.equal(view.targets[:, P:], batch["completion_mask"]) and not view.targets[:, :P].any()


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
    batch["advantages"] = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, micro_batch_size=3)
    # identical noise between the old-logp pass and the training pass
    assert set(batch["old_logp"]) == {0, 1}
    ctx.norms = {k: v for k, v in algo.normalizers(batch).items()}
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac"] == 0.0
    # rho = 1 -> loss = -sum(m A) / sum(m)
    m = batch["completion_mask"].float()
    expected = -(m * batch["advantages"][:, None]).sum() / m.sum()
    assert abs(metrics["loss"] - expected.item()) < 1e-6


def test_mean_field_logp_ignores_other_completion_tokens():
    model, algo, ctx = _setup(p_mask_prompt=0.0)
    batch = rl_batch(n_prompts=1, group=2, gen_len=6, seed=2)
    batch["completion_mask"][:] = True
    before = algo.log_likelihood(ctx, model, batch, algo.corrupt(ctx, batch, 0)).value
    batch["completion_ids"][:, 3] = (batch["completion_ids"][:, 3] + 7) % 90 + 10
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
    batch["advantages"] = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, reference=SameRef())
    ctx.norms = algo.normalizers(batch)
    metrics = stages.update(algo, ctx, model, batch, 0, micro_batch_size=4)
    assert metrics["kl"] == 0.0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)

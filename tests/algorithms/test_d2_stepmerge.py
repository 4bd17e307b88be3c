"""d2-StepMerge: the trajectory likelihood with the rollout's steps merged into N segments
(docs/algorithms/d2_stepmerge.md).

Golden invariants: the segments are the authors' (boundaries ``int(k T / N)`` of the global step count); each
segment's view is the canvas at the segment start (their ``trajectory[j]`` snapshots) scoring the tokens committed in
the segment, which partition the completion; N = T with no prompt masking is the exact per-step trajectory
likelihood (brute force: one forward per step, and the sampler's own confidences); N = 1 is d1's one-step estimate.
"""
import dataclasses

import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.d1 import D1Config
from dare.algorithms.d2_stepmerge import D2StepMergeConfig, segment_map
from dare.models import tiny, tiny_tokenizer
from dare.rollout.config import SamplerConfig
from tests.algorithms.helpers import corrupt, learning_families
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture)
from tests.algorithms.trajectory_helpers import rollout_batch
from tests.algorithms.parity_io import TableModel, completion_hidden
from tests.algorithms.test_loss_parity import case_batch, leaf, prepared, runner

PROMPTS = ("abc", "hello there")


def _setup(family="llada", **config):
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=2).double()
    algo = build_algorithm(D2StepMergeConfig(**config))
    ctx = StepContext(step=1, seed=3, adapter=model.adapter)
    return model, algo, ctx


def _rollout(model, ctx, prompts=PROMPTS, **sampler):
    block = model.adapter.block_size if model.adapter.is_block_causal else 4
    kw = dict(gen_length=8, block_length=block, temperature=1.0, block_stop=False)
    kw.update(sampler)
    if "steps" not in kw and "steps_per_block" not in kw:
        kw["steps"] = 8
    cfg = SamplerConfig(**kw)
    ctx.services.rollout_sampler = cfg
    batch, r = rollout_batch(model, cfg, prompts=prompts, n=2)
    batch.completion_mask[:] = True  # score every token (the tiny model's EOS would end some completions early)
    return batch, r


def authors_segments(steps: int, N: int) -> list[int]:
    """Segment of every global step by the authors' recording loop: a snapshot (a new segment) starts after the step
    whose 1-based count equals the next boundary ``int(k steps / N)``."""
    bounds = [int(k * (steps / N)) for k in range(1, N)]
    out, seg, done = [], 0, 0
    for _ in range(steps):
        out.append(seg)
        done += 1
        if seg + 1 < N and done == bounds[seg]:
            seg += 1
    return out


@pytest.mark.parametrize("T,N", [(128, 8), (64, 16), (256, 16), (64, 64), (10, 3), (7, 1), (12, 5)])
def test_segments_are_the_authors_boundaries(T, N):
    steps = torch.arange(T)[None]
    got = segment_map(steps, torch.tensor([T]), N)[0].tolist()
    assert got == authors_segments(T, N)
    assert segment_map(torch.tensor([[-1, 0]]), torch.tensor([T]), N)[0, 0] == -1  # never written


def test_segment_views_are_the_snapshots_and_partition_the_completion():
    """N = 2 over 8 steps: view j is the canvas after the first 4 j steps (the authors' snapshot ``trajectory[j]``),
    scoring the tokens of steps 4j .. 4j+3."""
    model, algo, ctx = _setup(segments=2, p_mask_prompt=0.0)
    batch, r = _rollout(model, ctx)
    views = corrupt(algo, ctx, batch, 0)
    P, Lc = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    assert int(r.num_steps.max()) == 8 and len(views) == 2
    total = torch.zeros(batch.completion_ids.shape, dtype=torch.long)
    for j, v in enumerate(views):
        tgt = v.targets[:, P:P + Lc]
        assert torch.equal(tgt, (batch.step_map >= 4 * j) & (batch.step_map < 4 * j + 4))
        assert torch.equal(v.input_ids[:, P:P + Lc], r.trajectory.states[:, 4 * j])
        total += tgt.long()
    assert (total == 1).all()


def per_step_brute_force(model, batch, r) -> torch.Tensor:
    """``[B, Lc]`` log pi(y_j | prompt, the rollout's state before the step that decoded j): one forward per step of
    the recorded states, each model's own attention (bidirectional or block-causal) over [prompt ; state]."""
    out = torch.zeros(batch.completion_ids.shape, dtype=torch.float64)
    P = batch.prompt_ids.shape[1]
    mask = torch.cat([batch.prompt_mask, torch.ones_like(batch.completion_mask)], 1)
    for s in range(r.trajectory.states.shape[1]):
        ids = torch.cat([batch.prompt_ids, r.trajectory.states[:, s]], 1)
        logits = model.adapter.prediction_logits(model(ids, attention_mask=mask).logits)[:, P:]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, batch.completion_ids[..., None]).squeeze(-1)
        out = torch.where(batch.step_map == s, logp, out)
    return out


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_one_segment_per_step_is_the_exact_trajectory_likelihood(family):
    """N = T = 8. On the block model (SDAR, block 4) the prompts fill whole blocks (2 completion blocks of 4 steps)
    and the blocks replay in parallel: 4 views."""
    block = family == "sdar"
    model, algo, ctx = _setup(family, segments=8, p_mask_prompt=0.0)
    batch, r = _rollout(model, ctx, prompts=("abcd", "hello!!!") if block else PROMPTS)
    views = corrupt(algo, ctx, batch, 0)
    assert len(views) == (4 if block else 8)
    with torch.no_grad():
        got = algo.log_likelihood(ctx, model, batch, views).value.double()
        brute = per_step_brute_force(model, batch, r)
    torch.testing.assert_close(got, brute, rtol=0, atol=2e-6)  # dare scores in fp32
    conf = r.trajectory.confidence.gather(1, batch.step_map[:, None, :]).squeeze(1)  # what the sampler drew from
    torch.testing.assert_close(got, conf.double().log(), rtol=0, atol=1e-5)
    # more segments than steps: empty ones, the same exact likelihood
    algo16 = build_algorithm(D2StepMergeConfig(segments=24, p_mask_prompt=0.0))
    with torch.no_grad():
        again = algo16.log_likelihood(ctx, model, batch, corrupt(algo16, ctx, batch, 0)).value
    assert torch.equal(again, got.float())


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_one_segment_is_d1(family):
    """N = 1: the whole completion masked, d1's prompt mask (same keys): d1's views, log-probs and loss, bit for bit."""
    model, algo, ctx = _setup(family, segments=1, inner_iterations=2)
    d1 = build_algorithm(D1Config(inner_iterations=2))
    batch, _ = _rollout(model, ctx)
    batch.completion_mask[0, 5:] = False
    batch.advantages = algo.advantages(ctx, batch)
    other = dataclasses.replace(batch)
    for it in (0, 1):
        mine, theirs = corrupt(algo, ctx, batch, it), corrupt(d1, ctx, other, it)
        assert len(mine) == 1
        for f in ("input_ids", "targets", "labels", "attention_mask", "position_ids", "score_index"):
            a, b = getattr(mine[0], f), getattr(theirs[0], f)
            assert (a is None and b is None) or torch.equal(a, b), f
        with torch.no_grad():
            assert torch.equal(algo.log_likelihood(ctx, model, batch, mine).value,
                               d1.log_likelihood(ctx, model, other, theirs).value)
    losses = []
    for a, b in ((algo, batch), (d1, other)):  # the same old / reference log-probs: ratios and KL away from 1 / 0
        b.views = {0: corrupt(a, ctx, b, 0)}
        ctx.norms = a.normalizers(b)
        logp = a.log_likelihood(ctx, model, b, b.views[0])
        b.old_logp = {0: logp.value.detach() + 0.1}
        b.ref_logp = {0: logp.value.detach() - 0.2}
        losses.append(a.loss(ctx, b, logp, 0)[0])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-7)


def test_prompt_mask_is_drawn_per_inner_iteration_and_shared_by_the_segments():
    model, algo, ctx = _setup(segments=4, p_mask_prompt=0.5, inner_iterations=2)
    assert not algo.deterministic_views
    batch, _ = _rollout(model, ctx)
    P = batch.prompt_ids.shape[1]
    it0, it1 = corrupt(algo, ctx, batch, 0), corrupt(algo, ctx, batch, 1)
    prompts0 = {tuple(v.input_ids[:, :P].flatten().tolist()) for v in it0}
    assert len(prompts0) == 1  # one prompt mask for all segments of an iteration
    assert not torch.equal(it0[0].input_ids[:, :P], it1[0].input_ids[:, :P])
    mask_id = model.adapter.mask_token_id
    assert not (it0[0].input_ids[:, :P][~batch.prompt_mask] == mask_id).any()  # padding is never masked
    assert build_algorithm(D2StepMergeConfig(p_mask_prompt=0.0)).deterministic_views


def test_config_and_schedule_errors():
    with pytest.raises(ValueError, match="segments"):
        D2StepMergeConfig(segments=0)
    with pytest.raises(ValueError, match="shrink"):
        D2StepMergeConfig(shrink=2)
    model, algo, ctx = _setup()
    batch, _ = _rollout(model, ctx)
    ctx.services.rollout_sampler = None
    with pytest.raises(ValueError, match="total_steps"):
        algo.prepare(ctx, batch)
    fixed = build_algorithm(D2StepMergeConfig(segments=2, total_steps=8))
    assert fixed.prepare(ctx, batch).num_rounds == 2


@pytest.mark.integration
@pytest.mark.parametrize("family", learning_families("d2_stepmerge"))
def test_learns_toy_reward(tmp_path, family):
    learns_toy_reward(tmp_path, "d2_stepmerge", family, "algorithm.beta=0.0")


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("d2_stepmerge")
def loss_parity_d2_stepmerge(algo, x, monkeypatch):
    """d2-StepMerge: the segment views of the step map (the reference's prompt mask substituted), each row's view
    scored with the reference's table of the segment it holds, the loss; the views must be the reference's inputs
    (its masked prompt and the segment's snapshot)."""
    from dare.algorithms import d2_stepmerge as module
    from tests.algorithms.parity_io import MASK_ID
    monkeypatch.setattr(module, "prompt_masks", lambda *a, **k: x["prompt_input"] == MASK_ID)
    batch = case_batch(x, step_map=x["step_map"])
    ctx, views = prepared(algo, batch)
    seg = leaf(x, "logp_segments")
    B, P = x["prompt_ids"].shape
    rows = torch.arange(B)
    holds = batch.state.threshold.clamp_max(seg.shape[0] - 1)  # [B, R]: the segment row i's view r replays
    for r, v in enumerate(views):
        assert torch.equal(v.input_ids[:, :P], x["prompt_input"])
        live = v.targets[:, P:].any(1)  # rows whose answer ends early have fewer segments with targets
        assert torch.equal(v.input_ids[live, P:], x["snapshots"][holds[:, r], rows, P:][live])
    hidden = [completion_hidden(seg[holds[:, r], rows], P, x["completion_ids"]) for r in range(len(views))]
    current = algo.log_likelihood(ctx, TableModel(hidden), batch, views)
    return algo.loss(ctx, batch, current, 0)[0], {"logp_segments": seg}

"""IGPO (docs/algorithms/igpo.md): the hint builder, the hinted round of the rollout, the scoring view and the loss.

Golden invariants: hints hold the reference's revealed chunks in order (never in the free tail); an all-wrong group
is decoded again with hints and its first rollouts are replaced by correct hinted ones, so it gets non-zero
advantages; hint tokens are context in the scoring view, never scored, never in the loss; the sequence ratio is 1 on
the first inner step (loss ``-sum n_b A_b / sum n_b``).
"""
import json
from pathlib import Path

import pytest
import torch

from dare.algorithms import LogLik, StepContext, build_algorithm
from dare.algorithms.common.hints import (ChunkHints, chunk_hint_canvas, hint_ratios, placed_chunks, reference_chunks,
                                          revealed_chunks)
from dare.algorithms.igpo import IGPOConfig, ScoredHints, hint_entropy_filter
from dare.models import tiny, tiny_tokenizer
from dare.rewards import REWARDS, register_reward
from dare.trainer import stages
from dare.trainer.loop import Trainer
from dare.trainer.recipe import load_recipe
from tests.algorithms.helpers import rl_batch
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture)
from tests.algorithms.test_loss_parity import case_batch, leaf, prepared, runner

ROOT = Path(__file__).resolve().parents[2]

if "mc_test_q" not in REWARDS:
    @register_reward("mc_test_q")
    def _qs(completion, example):
        """1 when at least half the characters are 'Q', else 0: a random tiny model is never right, a Q-hinted
        completion can be (a correctness reward: all-wrong groups have no reward variance at all)."""
        return float(2 * completion.count("Q") >= max(len(completion), 1))


# --- the hint builder ------------------------------------------------------------------------------------------


def _runs(canvas: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) runs of given positions."""
    given = (canvas >= 0).tolist() + [False]
    out, start = [], None
    for i, g in enumerate(given):
        if g and start is None:
            start = i
        if not g and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("seed", range(6))
def test_hints_are_the_revealed_reference_chunks_in_order_outside_the_free_tail(seed):
    spec = ChunkHints(min_chunk=5, max_chunk=10, free_tail=30, max_spacing=100)
    ref = list(range(1000, 1000 + 140))  # distinct tokens: a hint's source position is its value - 1000
    gen = torch.Generator().manual_seed(seed)
    ratio = float(hint_ratios(1, 0.2, 0.6, gen))
    canvas = chunk_hint_canvas(ref, 256, ratio, spec, torch.Generator().manual_seed(seed))
    assert not bool((canvas[256 - 30:] >= 0).any())  # the free tail
    # replay the draws: chunks, the revealed ones, where they go
    g = torch.Generator().manual_seed(seed)
    chunks = reference_chunks(140, spec, g)
    assert all(5 <= e - s <= 10 for s, e in chunks) and chunks[0][0] == 0
    assert 140 - chunks[-1][1] < 5  # only a remainder shorter than min_chunk is left out
    shown = revealed_chunks(chunks, ratio, g)
    assert shown[-1] == chunks[-1]  # the last chunk is always revealed
    n_shown = len(chunks) - int(len(chunks) * (1 - ratio))
    assert len(shown) in (n_shown, n_shown + 1)  # + the last chunk when it was drawn hidden
    given = canvas[canvas >= 0] - 1000
    assert given.tolist() == [t for s, e in shown for t in range(s, e)]  # in order, each chunk whole (it fits)
    stretch = min(226 / 140, 1.5)
    places = placed_chunks(shown, 226, stretch, 100)
    assert places[0][0] == int(shown[0][0] * stretch)
    for (s0, e0), (s1, _), (a0, b0), (a1, _) in zip(shown, shown[1:], places, places[1:]):
        assert a1 - b0 == min(int((s1 - e0) * stretch), 100)  # stretched gaps, capped
    # adjacent revealed chunks may touch (their gap is 0): each run of the canvas is a union of whole chunks
    runs = _runs(canvas)
    assert sum(e - s for s, e in runs) == sum(e - s for s, e in shown)


def test_hint_ratio_edges_and_short_canvases():
    spec = ChunkHints(min_chunk=2, max_chunk=3, free_tail=4, max_spacing=100)
    ref = list(range(50, 70))
    assert not bool((chunk_hint_canvas(ref, 16, 0.0, spec, torch.Generator()) >= 0).any())  # ratio 0: no hints
    full = chunk_hint_canvas(ref, 16, 1.0, spec, torch.Generator().manual_seed(1))
    assert (full[:12] >= 0).sum() >= 10 and not bool((full[12:] >= 0).any())  # everything that fits, never compressed
    assert not bool((chunk_hint_canvas(ref, 4, 1.0, spec, torch.Generator()) >= 0).any())  # no room before the tail
    r = hint_ratios(8, 0.2, 0.6, torch.Generator().manual_seed(0))
    assert torch.equal(r, r.sort().values) and bool(((r >= 0.2) & (r <= 0.6)).all())


def test_entropy_filter_keeps_the_highest_entropy_fifth_of_each_rows_candidates():
    cand = torch.zeros(3, 12, dtype=torch.bool)
    cand[0, :10] = True
    cand[1, [2, 5]] = True
    ent = torch.arange(36, dtype=torch.float32).view(3, 12).flip(1)  # entropy falls along each row
    kept = hint_entropy_filter(cand, ent, 0.2)
    assert kept[0].nonzero().flatten().tolist() == [0, 1]  # int(10 * 0.2) = 2 highest
    assert kept[1].nonzero().flatten().tolist() == [2]  # max(1, int(2 * 0.2)) = 1
    assert not bool(kept[2].any())  # no candidates, none kept


# --- the hinted round, end to end on a tiny model --------------------------------------------------------------


def _q_dataset(tmp_path, n=4, text="QQQQQQQQQQQQQQQQ") -> str:
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"say {i}", "answer": f"{text}\n#### 1"}) + "\n" for i in range(n)))
    return str(path)


def _trainer(tmp_path, family="llada", *overrides):
    block = 4 if family in ("sdar", "llada2_moe") else 8
    recipe = load_recipe(ROOT / "recipes/rl/igpo.yaml", [
        f"model.path=tiny:{family}", "model.tiny_sizes={hidden_size: 32, num_layers: 1}",
        f"data.dataset={{path: {_q_dataset(tmp_path)}, template: plain}}", "reward.name=mc_test_q", "reward.workers=0",
        f"rollout.sampler={{gen_length: 8, block_length: {block}, steps: 8, temperature: 1.0}}",
        "rollout.group_size=4", "rollout.micro_batch_size=1", "train.batch_size=2", "algorithm.correct_reward=0.5",
        "algorithm.hint_free_tail=0", "algorithm.hint_min_chunk=2", "algorithm.hint_max_chunk=2",
        "algorithm.hint_ratio_low=0.5", "algorithm.hint_ratio_high=0.5", "algorithm.max_replacements=2",
        f"train.output_dir={tmp_path / 'run'}", "train.export=false", "train.save_every=0", "logging.progress=false",
        "logging.tensorboard=false", "logging.plot=false", *overrides])
    return Trainer(recipe)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_an_all_wrong_group_gets_hinted_rollouts_and_non_zero_advantages(tmp_path, family):
    tr = _trainer(tmp_path, family)
    try:
        ctx = tr.step_context(0)
        prompts = tr.source.batch(0)
        first, _ = tr.rollout.collect(ctx, prompts, tr.model)  # the first round alone (same seeds)
        assert bool((first.rewards < 0.5).all())  # every group is all wrong
        batch, metrics = tr.algo.collect(ctx, prompts, tr.model)
        assert metrics["igpo_all_wrong_groups"] == 2 and metrics["igpo_hinted_groups"] == 2
        assert metrics["igpo_replaced"] == 4 and metrics["nfe"] > 0
        hint = batch.hint_mask
        q = tr.tokenizer.convert_tokens_to_ids("Q")
        for g in range(2):
            rows = (batch.group == batch.group.unique()[g]).nonzero().flatten()
            new, old = rows[:2], rows[2:]
            assert bool((batch.rewards[new] >= 0.5).all()) and bool(hint[new].any(1).all())
            assert bool((batch.completion_ids[new][hint[new]] == q).all())  # the hints are in the completion
            assert bool((batch.step_map[new][hint[new]] == -1).all())  # never written by the decoder
            assert not bool(hint[old].any())  # the others are the group's own first-round rollouts
            assert torch.equal(batch.completion_ids[old], first.completion_ids[old])
            assert torch.equal(batch.rewards[old], first.rewards[old])
        adv = tr.algo.advantages(ctx, batch).values
        assert bool((adv != 0).all())  # a group with no correct completion now has signal for every sample
        assert torch.equal(tr.algo.advantages(ctx, first).values, torch.zeros_like(adv))  # without IGPO: none
        # the scoring view: hints are clean context, never targets; every other completion position is masked
        stages.prepare(tr.algo, ctx, batch, tr.model, tr.reference, 8)
        (view,) = batch.views[0]
        assert int((view.input_ids == tr.model.adapter.mask_token_id).sum()) == int((~hint).sum())
        assert int(view.targets.sum()) == int((batch.completion_mask & ~hint).sum())
        assert batch.views[1] is batch.views[0]  # nothing is drawn: one view for every inner iteration
    finally:
        tr.close()


def test_score_hints_scores_the_hints_and_keeps_the_high_entropy_fifth(tmp_path):
    tr = _trainer(tmp_path, "llada", "algorithm.score_hints=true", "algorithm.hint_entropy_keep=0.5")
    try:
        ctx = tr.step_context(0)
        batch, _ = tr.algo.collect(ctx, tr.source.batch(0), tr.model)
        assert tr.algo.frozen_models == ("policy",)
        stages.prepare(tr.algo, ctx, batch, tr.model, tr.reference)  # the entropy filter: its score_frozen
        hint, scored = batch.hint_mask, batch.frozen.hints
        n_hint = (hint & batch.completion_mask).sum(1)  # hints after the completion's stop are not candidates
        assert bool((scored <= hint).all())
        assert scored.sum(1).tolist() == [max(1, int(n * 0.5)) if n else 0 for n in n_hint.tolist()]
        (view,) = batch.views[0]
        assert int((view.input_ids == tr.model.adapter.mask_token_id).sum()) == batch.completion_ids.numel()
        mask = tr.algo.loss_mask(batch).bool()
        assert torch.equal(mask, batch.completion_mask & (~hint | scored))
    finally:
        tr.close()


# --- the loss ----------------------------------------------------------------------------------------------------


def _hinted_batch(seed=0, **cfg):
    algo = build_algorithm(IGPOConfig(**cfg))
    batch = rl_batch(n_prompts=2, group=3, gen_len=8, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    hint = (torch.rand(batch.completion_ids.shape, generator=g) < 0.4) & batch.completion_mask
    hint[1] = False
    batch.hint_mask = hint
    return algo, batch


def test_hint_tokens_are_never_scored_nor_in_the_loss():
    model = tiny("llada", tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    algo, batch = _hinted_batch(inner_iterations=1, beta=0.0)
    ctx = StepContext(step=0, seed=3, adapter=model.adapter)
    (view,) = algo.corrupt(ctx, batch, 0)
    P = batch.prompt_ids.shape[1]
    hint = batch.hint_mask
    assert not bool(view.targets[:, P:][hint].any())
    assert torch.equal(view.input_ids[:, P:][hint], batch.completion_ids[hint])  # context: the clean hint tokens
    assert bool((view.input_ids[:, P:][~hint] == model.adapter.mask_token_id).all())
    batch.views = {0: [view]}
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    assert ctx.norms["tokens"] == float((batch.completion_mask & ~hint).sum())
    current = algo.log_likelihood(ctx, model, batch, [view])
    logp = current.value.detach().clone().requires_grad_(True)
    loss, _ = algo.loss(ctx, batch, LogLik(logp), 0)
    loss.backward()
    assert bool((logp.grad[hint] == 0).all()) and bool((logp.grad[~hint & batch.completion_mask] != 0).any())
    moved = logp.detach().clone()
    moved[hint] = -7.0  # whatever the hint slots hold, the loss is the same
    assert torch.equal(algo.loss(ctx, batch, LogLik(moved), 0)[0], loss.detach())


@pytest.mark.parametrize("sequence_ratio", [True, False])
def test_ratio_one_on_the_first_inner_step_gives_the_advantage_weighted_token_mean(sequence_ratio):
    algo, batch = _hinted_batch(inner_iterations=1, beta=0.0, sequence_ratio=sequence_ratio)
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 0.0])
    ctx = StepContext(step=0, seed=0, adapter=None)
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    logp = -torch.rand(batch.completion_ids.shape, generator=torch.Generator().manual_seed(2)) - 0.1
    loss, m = algo.loss(ctx, batch, LogLik(logp.requires_grad_(True)), 0)
    n = (batch.completion_mask & ~batch.hint_mask).float().sum(1)
    A = batch.advantages.values
    torch.testing.assert_close(loss.detach(), -(n * A).sum() / n.sum())
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac"] == 0.0


def test_sequence_ratio_averages_the_scored_log_ratio():
    algo, batch = _hinted_batch(inner_iterations=2, beta=0.0)
    ctx = StepContext(step=0, seed=0, adapter=None)
    batch.advantages = algo.advantages(ctx, batch)
    ctx.norms = algo.normalizers(batch)
    logp = -torch.rand(batch.completion_ids.shape, generator=torch.Generator().manual_seed(3)) - 0.1
    old = logp + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(4))
    old[batch.hint_mask] = 5.0  # hint slots are not part of the ratio
    batch.old_logp = {0: old}
    _, m = algo.loss(ctx, batch, LogLik(logp), 0)
    keep = (batch.completion_mask & ~batch.hint_mask).float()
    s = torch.exp(((logp - old) * keep).sum(1) / keep.sum(1))
    assert m["ratio_mean"] == pytest.approx(float((s[:, None] * keep).sum() / keep.sum()), rel=1e-6)


def test_config_checks_and_the_unsupported_kind():
    with pytest.raises(ValueError, match="hint_ratio_low"):
        IGPOConfig(hint_ratio_low=0.7, hint_ratio_high=0.6)
    with pytest.raises(ValueError, match="min_chunk"):
        IGPOConfig(hint_min_chunk=0)
    model = tiny("diffusion_gemma", tokenizer=tiny_tokenizer(), seed=0, num_layers=1, hidden_size=32)
    with pytest.raises(ValueError, match="no committed positions"):
        build_algorithm(IGPOConfig()).check_model(model.adapter)


# --- learning ---------------------------------------------------------------------------------------------------


def _sevens_data(tmp_path) -> str:
    """Rows whose gold completion (template ``plain``: the worked solution first) is all sevens."""
    data = tmp_path / "sevens.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": "7777777777777777\n#### 7"}) + "\n"
                            for i in range(64)))
    return str(data)


def _replaced(run: Path) -> list[float]:
    return [json.loads(line)["igpo_replaced"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_igpo_learns_the_toy_reward_with_hinted_groups(tmp_path):
    """The toy '7' reward, correct = all sevens: every group starts all wrong, so each step decodes hinted rollouts
    (references made of sevens) and swaps in those that come out all sevens. Hints are never scored (default)."""
    run = tmp_path / "run"
    data = f"data.dataset={{path: {_sevens_data(tmp_path)}, template: plain}}"
    rewards = learns_toy_reward(run, "igpo", "llada", data, "algorithm.correct_reward=1.0", "algorithm.hint_free_tail=0",
                                "algorithm.hint_min_chunk=1", "algorithm.hint_max_chunk=2")
    assert sum(_replaced(run)) > 0, rewards  # the hinted round did give groups correct rollouts


@pytest.mark.integration
def test_igpo_with_scored_hints_learns_from_frequent_replacements(tmp_path):
    """The reference's treatment (hints masked and scored, top-entropy fifth kept) with correct = at least half
    sevens: every all-wrong group gets two hinted rollouts per step, and the policy learns the hinted sevens."""
    run = tmp_path / "run"
    data = f"data.dataset={{path: {_sevens_data(tmp_path)}, template: plain}}"
    rewards = learns_toy_reward(run, "igpo", "llada", data, "algorithm.correct_reward=0.5", "algorithm.hint_free_tail=0",
                                "algorithm.score_hints=true",
                                "algorithm.hint_min_chunk=1", "algorithm.hint_max_chunk=2")
    assert _replaced(run)[0] > 0, rewards


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("igpo")
def loss_parity_igpo(algo, x, monkeypatch):
    """IGPO: the hint state (``score_hints``: dare's entropy filter on the reference's old-policy entropies; else no
    hint position in the loss), the scoring view's targets, and the loss on given per-token log-probs."""
    from dare.algorithms.igpo import ScoredHints, hint_entropy_filter
    hint = x["hint_mask"].bool()
    scored = torch.zeros_like(hint)
    if algo.config.score_hints:
        scored = hint_entropy_filter(hint & x["completion_mask"].bool(), x["entropy"], algo.config.hint_entropy_keep)
    batch = case_batch(x, hint_mask=hint)
    batch.frozen = ScoredHints(scored)
    ctx, _ = prepared(algo, batch)
    logp = leaf(x, "logp")
    return algo.loss(ctx, batch, LogLik(logp), 0)[0], {"logp": logp}

from pathlib import Path

import pytest
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.dtreerpo import (DTreeRPOConfig, distillation_targets, local_advantages, node_values,
                                      sd_schedule, segments_batch)
from dare.trainer.recipe import load_recipe
from dare.models import tiny, tiny_tokenizer
from dare.rollout import SamplerConfig, generate, generate_tree
from dare.trainer import stages
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture)
from tests.algorithms.trajectory_helpers import run_recipe
from tests.trainer.two_processes import register, same_history, trajectory_case
from dare.algorithms import LogLik
from tests.algorithms.helpers import corrupt
from tests.algorithms.parity_io import stub_adapter
from tests.algorithms.test_loss_parity import case_batch, leaf, runner

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ("abc", "hello there")


def _model(family):
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=2)
    if model.adapter.is_block_causal:
        model.adapter.block_size = 4
    return model


def _sampler(family, **kw):
    base = dict(gen_length=8, block_length=4, temperature=1.0)
    base.update(dict(steps_per_block=4) if family == "sdar" else dict(steps=8))
    base.update(kw)
    return SamplerConfig(**base)


def _tree(family, branching=(2, 3), cuts=(4,), **kw):
    model = _model(family)
    tok = tiny_tokenizer()
    tree = generate_tree(model, [tok.encode(p) for p in PROMPTS], _sampler(family, **kw), list(branching), list(cuts),
                         seeds=[11, 12])
    return model, tree


def test_leaf_rewards_propagate_to_node_values_and_sibling_relative_advantages():
    """Golden, on a hand-made tree: prompt 0 has trunks a, b; prompt 1 has trunk c (no sibling).
    a -> leaves (1, 0); b -> (0, 0, 1); c -> (1, 1)."""
    parents = [torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1, 1, 1, 2, 2])]
    leaves = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    values = node_values(leaves, parents)
    assert torch.allclose(values[0].float(), torch.tensor([0.5, 1 / 3, 1.0]))
    assert torch.equal(values[1].float(), leaves)
    adv = local_advantages(values, parents)
    # a leaf minus the mean of the other children of its parent
    assert torch.allclose(adv[1], torch.tensor([1.0, -1.0, -0.5, -0.5, 1.0, 0.0, 0.0]))
    # a trunk minus the other trunks of its prompt; a trunk without siblings keeps its value (the reference)
    assert torch.allclose(adv[0], torch.tensor([0.5 - 1 / 3, 1 / 3 - 0.5, 1.0]))


@pytest.mark.parametrize("family,kw", [("llada", {}), ("llada", {"cache": "dual", "block_length": 8}),
                                       ("sdar", {"cache": "block"}), ("dream", {"block_length": 8})])
def test_transitions_of_every_path_reproduce_the_completion(family, kw):
    """Golden: along every root-to-leaf path the segments' committed tokens are disjoint, cover exactly the leaf's
    written tokens, and replaying them from the all-masked state gives the leaf completion; each segment's input is
    its parent's state."""
    model, tree = _tree(family, branching=(2, 2, 2), cuts=(3, 5), **kw)
    mask_id = model.adapter.mask_token_id
    batch = segments_batch(tree, torch.zeros(tree.leaves.completion_ids.shape[0]), torch.tensor([0, 1]), mask_id)
    sizes = [lv.completion_ids.shape[0] for lv in tree.levels]
    offsets = [sum(sizes[:k]) for k in range(len(sizes))]
    leaves = tree.leaves
    for r in range(sizes[-1]):
        path = tree.ancestors(len(sizes) - 1, r)
        state = torch.full_like(leaves.completion_ids[r], mask_id)
        covered = torch.zeros_like(state, dtype=torch.bool)
        for k, row in enumerate(path):
            seg = offsets[k] + row
            assert torch.equal(batch.tree.parent_ids[seg], state)  # the segment is scored from its parent's state
            new = (batch.step_map[seg] >= 0) & (batch.tree.parent_step_map[seg] < 0)
            assert not (new & covered).any()
            state = torch.where(new, batch.completion_ids[seg], state)
            covered |= new
            assert torch.equal(batch.tree.segment_targets[seg], new & batch.completion_mask[seg])
        written = leaves.step_map[r] >= 0
        assert torch.equal(covered, written)
        assert torch.equal(state[written], leaves.completion_ids[r][written])


def test_segment_ids_are_global_and_siblings_share_their_parents_id():
    model, tree = _tree("llada", branching=(2, 3), cuts=(4,))
    batch = segments_batch(tree, torch.zeros(12), torch.tensor([5, 9]), model.adapter.mask_token_id)
    uid, group, level = batch.uid, batch.group, batch.tree.tree_level
    assert uid.unique().numel() == batch.size == 2 * (2 + 6)
    S = 2 + 6 + 1
    assert set((uid // S).tolist()) == {5, 9} and ((uid % S) >= 1).all()
    assert torch.equal(group[level == 0], (uid[level == 0] // S) * S)  # trunks: the tree's root
    first = (level == 1).nonzero().flatten()
    parent_uid = uid[level == 0][tree.parents[1]]
    assert torch.equal(group[first], parent_uid)  # children: their parent's uid


def test_chunked_tree_rollouts_give_the_same_step(tmp_path):
    args = ("algorithm.trunks=2", "algorithm.branch_factor=2",
            "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}")
    one = run_recipe(tmp_path / "one", "dtreerpo", "llada", *args, steps=1)[0]
    chunked = run_recipe(tmp_path / "chunked", "dtreerpo", "llada", *args, "rollout.micro_batch_size=1", steps=1)[0]
    for key in ("reward_mean", "segments", "loss", "grad_norm"):  # (nfe: one batched call per chunk)
        assert chunked[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert one["segments"] == 2 * (2 + 4)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_step_map_of_each_segment_extends_its_parent(family):
    """Golden: a node keeps its parent's step map where the parent wrote, and the tokens it adds carry steps in
    [parent's steps, its own steps); what neither wrote is still masked in the node."""
    model, tree = _tree(family, branching=(2, 2, 2), cuts=(2, 6), block_stop=False)
    mask_id = model.adapter.mask_token_id
    for k in range(1, len(tree.levels)):
        parent, child = tree.levels[k - 1], tree.levels[k]
        p = tree.parents[k]
        pm, cm = parent.step_map[p], child.step_map
        old = pm >= 0
        assert torch.equal(cm[old], pm[old])
        assert torch.equal(child.completion_ids[old], parent.completion_ids[p][old])
        new = (cm >= 0) & ~old
        lo, hi = parent.num_steps[p][:, None].expand_as(cm), child.num_steps[:, None].expand_as(cm)
        assert ((cm[new] >= lo[new]) & (cm[new] < hi[new])).all()
        assert new.any(1).all()  # every segment commits something
        if child.paused_at is not None:
            assert (child.completion_ids[cm < 0] == mask_id).all()


@pytest.mark.parametrize("family,kw", [("llada", {}), ("sdar", {}), ("sdar", {"cache": "block"})])
def test_an_unbranched_greedy_tree_is_one_rollout(family, kw):
    """Pausing and resuming changes nothing: branching 1 with greedy decoding gives generate()'s tokens and step map."""
    model, tree = _tree(family, branching=(1, 1, 1), cuts=(2, 5), temperature=0.0, **kw)
    tok = tiny_tokenizer()
    plain = generate(model, [tok.encode(p) for p in PROMPTS], _sampler(family, temperature=0.0, **kw))
    assert torch.equal(tree.leaves.completion_ids, plain.completion_ids)
    assert torch.equal(tree.leaves.step_map, plain.step_map)
    assert tree.nfe >= plain.nfe


class RowCounter:
    """Counts model calls and the rows they process (sequence-forwards)."""

    def __init__(self, model):
        self.calls = self.rows = 0
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        self.calls += 1
        self.rows += ids.shape[0]


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_a_tree_costs_fewer_row_forwards_than_independent_rollouts(family):
    b, d = 3, 2
    model = _model(family)
    tok = tiny_tokenizer()
    prompts = [tok.encode(p) for p in PROMPTS]
    counter = RowCounter(model)
    generate_tree(model, prompts, _sampler(family, block_stop=False), [b] * d, [4], seeds=[1, 2])
    tree_rows = counter.rows
    counter.rows = 0
    generate(model, prompts, _sampler(family, block_stop=False), n=b ** d, seeds=[1, 2])
    assert tree_rows < counter.rows
    counter.handle.remove()


def _setup(family="llada", **cfg):
    model = _model(family)
    algo = build_algorithm(DTreeRPOConfig(**cfg))
    return model, algo, StepContext(step=7, seed=1, adapter=model.adapter)


def _tree_batch(model, algo, family="llada", rewards=None):
    tok = tiny_tokenizer()
    cuts = algo.cut_steps(model, _sampler(family))
    tree = generate_tree(model, [tok.encode(p) for p in PROMPTS], _sampler(family), algo.config.branching, cuts,
                         seeds=[3, 4])
    n = tree.leaves.completion_ids.shape[0]
    if rewards is None:
        rewards = (torch.arange(n) % 3).float() / 2
    return segments_batch(tree, rewards, torch.tensor([0, 1]), model.adapter.mask_token_id)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_segment_loss_at_ratio_one_is_minus_the_mean_over_segments_of_their_advantage(family):
    model, algo, ctx = _setup(family, trunks=2, branch_factor=2, inner_iterations=1, beta=0.0, self_distillation=False)
    batch = _tree_batch(model, algo, family)
    assert batch.size == 2 * (2 + 4)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    m = stages.update(algo, ctx, model, batch, 0, micro_batch_size=5)
    has = batch.tree.segment_targets.any(1).float()
    expected = -(batch.advantages.values * has).sum() / batch.size
    assert m["loss"] == pytest.approx(float(expected), abs=1e-6) and m["ratio_mean"] == pytest.approx(1.0)


def test_self_distillation_equals_the_kl_to_the_parent_distribution():
    """The per-token form equals lambda * mean over (parent, position) of KL(q || softmax(parent logits)) computed
    from the parent's own forward, q = softmax(A / tau)-weighted children with A > 0."""
    model, algo, ctx = _setup("llada", trunks=2, branch_factor=3, beta=0.0, inner_iterations=1)
    batch = _tree_batch(model, algo, rewards=torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0] * 2))
    adv = algo.advantages(ctx, batch).values
    lam, tau = sd_schedule(ctx.step, algo.config)
    w, log_q, pairs = distillation_targets(batch.completion_ids, batch.tree.segment_targets, adv, batch.group, tau)
    assert pairs > 0
    views = algo.corrupt(ctx, batch, 0)
    with torch.no_grad():
        logp = algo.log_likelihood(ctx, model, batch, views).value
    ours = float((w * (log_q - logp)).sum() / pairs)
    P = batch.prompt_ids.shape[1]
    total, count = 0.0, 0
    for g in torch.unique(batch.group).tolist():
        members = (batch.group == g).nonzero().flatten()
        pos = members[adv[members] > 0]
        if members.numel() <= 1 or pos.numel() == 0:
            continue
        i0 = int(members[0])
        x = torch.cat([batch.prompt_ids[i0], batch.tree.parent_ids[i0]])[None]
        with torch.no_grad():
            parent_lp = model(x, attention_mask=torch.cat([batch.prompt_mask[i0], torch.ones(8, dtype=torch.bool)])[None]
                              ).logits[0, P:].float().log_softmax(-1)
        wts = torch.softmax(adv[pos].double() / tau, 0)
        for j in range(8):
            act = batch.tree.segment_targets[pos, j]
            if not act.any():
                continue
            toks, ww = batch.completion_ids[pos[act], j], wts[act]
            uniq = torch.unique(toks)
            q = torch.stack([ww[toks == u].sum() for u in uniq]) / ww.sum()
            total += float((q * (q.log() - parent_lp[j, uniq].double())).sum())
            count += 1
    assert count == pairs
    assert ours == pytest.approx(total / count, rel=1e-4, abs=1e-6)
    lam_end, tau_end = sd_schedule(algo.config.sd_horizon, algo.config)
    assert lam == pytest.approx(algo.config.sd_lambda_max * (torch.e ** (2.0 * 7 / 30000) - 1) / (torch.e ** 2 - 1))
    assert lam_end == pytest.approx(algo.config.sd_lambda_max) and tau_end == pytest.approx(1e-6)


@pytest.mark.parametrize("family,block", [("llada", None), ("sdar", 4), ("sdar", 2)])
@torch.no_grad()
def test_a_segment_is_scored_from_its_parents_state_as_the_sampler_saw_it(family, block):
    """Golden: each target's log-prob equals a plain forward of the sampler's view of the segment start -- the
    parent's state (bidirectional), or on block models the node's finished blocks before the target's block, then
    the parent's state of that block, attending with the sampler's block length."""
    from dare.models import masks
    model, algo, ctx = _setup(family, trunks=2, branch_factor=2)
    kw = {} if block is None else {"block_length": block, "steps_per_block": block}
    tok = tiny_tokenizer()
    sampler = _sampler(family, **kw)
    tree = generate_tree(model, [tok.encode(p) for p in PROMPTS], sampler, [2, 2], algo.cut_steps(model, sampler),
                         seeds=[5, 6])
    batch = segments_batch(tree, torch.zeros(8), torch.tensor([0, 1]), model.adapter.mask_token_id)
    batch.tree.block_length = sampler.block_length
    ours = algo.log_likelihood(ctx, model, batch, algo.corrupt(ctx, batch, 0)).value
    checked = 0
    for r in range(batch.size):
        prompt = batch.prompt_ids[r][batch.prompt_mask[r]]
        P = prompt.numel()
        parent, child = batch.tree.parent_ids[r], batch.completion_ids[r]
        for t in batch.tree.segment_targets[r].nonzero().flatten().tolist():
            if block is None:
                x = torch.cat([prompt, parent])[None]
                lp = model(x).logits[0, P + t].float().log_softmax(-1)
            else:
                b_end = ((P + t) // block + 1) * block - P  # end of the target's sampler block (completion index)
                b_start = b_end - block
                x = torch.cat([prompt, child[:max(b_start, 0)], parent[max(b_start, 0):b_end]])[None]
                pos = torch.arange(x.shape[1])[None]
                lay = masks.TokenLayout.plain(pos)
                lp = model(x, attention_mask=masks.dense_mask(lay, lay, block), position_ids=pos).logits[0, P + t]
                lp = lp.float().log_softmax(-1)
            assert abs(float(lp[child[t]]) - float(ours[r, t])) < 2e-5
            checked += 1
    assert checked > 10


def test_training_step_runs_with_mu_and_kl_and_is_micro_batch_invariant():
    model, algo, ctx = _setup("llada", trunks=2, branch_factor=2, inner_iterations=2, beta=0.05, sd_lambda_max=1.0)
    batch = _tree_batch(model, algo)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model, reference=_Frozen(model))
    ctx.norms = algo.normalizers(batch)
    a = stages.update(algo, ctx, model, batch, 0, micro_batch_size=100)
    model.zero_grad()
    b = stages.update(algo, ctx, model, batch, 0, micro_batch_size=3)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6) and "sd_kl" in a and a["kl"] == pytest.approx(0.0, abs=1e-9)


class _Frozen:
    """A reference that is the policy itself (KL 0)."""

    def __init__(self, model):
        self.model = model

    def scoring(self):
        from contextlib import nullcontext
        return nullcontext(self.model)


def test_check_rollout_and_cut_steps():
    model, algo, _ = _setup("llada", levels=3)
    assert algo.cut_steps(model, _sampler("llada")) == [2, 5]  # k * 8 / 3
    with pytest.raises(ValueError, match="rcr"):
        algo.check_rollout(_sampler("llada", rcr=True), model.adapter)
    with pytest.raises(ValueError, match="levels=9"):
        build_algorithm(DTreeRPOConfig(levels=9)).cut_steps(model, _sampler("llada"))


def test_recipe_defaults():
    recipe = load_recipe(ROOT / "recipes/rl/dtreerpo.yaml")
    cfg = recipe.algorithm
    assert isinstance(cfg, DTreeRPOConfig) and cfg.clip_low == 0.4 and cfg.beta == 0.01 and cfg.levels == 2
    assert DTreeRPOConfig().branching == [4, 4] and DTreeRPOConfig().inner_iterations == 12


@pytest.mark.integration
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_learns_a_toy_reward(tmp_path, family):
    learns_toy_reward(tmp_path, "dtreerpo", family, "algorithm.inner_iterations=2", "algorithm.beta=0.0")


TWO_PROCESS = register({"dtreerpo_llada": trajectory_case(
    "dtreerpo", "model.path=tiny:llada", "train.steps=2", "train.batch_size=2", "algorithm.trunks=2",
    "algorithm.branch_factor=2", "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}")})


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", TWO_PROCESS)
def test_two_processes_reproduce_one_process(two_process_runs, case):
    first, second = two_process_runs(case)
    assert any(abs(a["loss"]) > 1e-6 for a in first.metrics)
    same_history(first.metrics, second.metrics, ("reward_mean", "segments", "loss", "grad_norm", "sd_kl"))


# --- loss parity: dare's side of this method's cases (found by tests/algorithms/test_loss_parity.py) ---


@runner("dtreerpo")
def loss_parity_dtreerpo(algo, x, monkeypatch):
    """d-TreeRPO: segment targets (committed in the child, masked in the parent, up to the child's first stop), the
    given local advantages, self-distillation weights at the case's step, and the loss."""
    from dare.algorithms.dtreerpo import TreeState, segment_targets
    from tests.algorithms.parity_io import MASK_ID

    def steps(ids):  # a step map that marks what is written
        return torch.where(ids != MASK_ID, 0, -1)

    targets = segment_targets(steps(x["completion_ids"]), steps(x["parent_ids"]), x["completion_mask"])
    B = x["completion_ids"].shape[0]
    batch = case_batch(x, tree=TreeState(x["parent_ids"], steps(x["parent_ids"]), targets, x["tree_advantages"],
                                        torch.zeros(B, dtype=torch.long)))
    ctx = StepContext(step=int(x["global_step"]), seed=0, adapter=stub_adapter())
    batch.advantages = algo.advantages(ctx, batch)
    batch.views = {0: corrupt(algo, ctx, batch, 0)}
    ctx.norms = algo.normalizers(batch)
    logp = leaf(x, "logp")
    return algo.loss(ctx, batch, LogLik(logp), 0)[0], {"logp": logp}

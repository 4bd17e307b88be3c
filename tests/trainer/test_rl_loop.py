import pytest
import torch

from dare.algorithms.advantages import group_mean_std
from dare.trainer.recipe import load_recipe
from dare.rewards import REWARDS, register_reward
from dare.trainer import stages
from dare.trainer.loop import Trainer
from tests.trainer.helpers import ROOT

if "test_sevens" not in REWARDS:
    @register_reward("test_sevens")
    def _sevens(completion, example):
        """A toy reward a tiny random model can learn: the fraction of '7' characters."""
        return completion.count("7") / max(len(completion), 1)


def d1_recipe(tmp_path, *overrides):
    return load_recipe(ROOT / "recipes/d1_tiny.yaml", [
        f"train.output_dir={tmp_path}", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "train.export=false", "train.save_every=0", "reward.name=test_sevens", "reward.workers=0",
        "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}", "rollout.group_size=8",
        "optim.lr=3e-3", "optim.grad_clip=1.0", "optim.weight_decay=0.0", *overrides])


def test_d1_learns_a_toy_reward_end_to_end(tmp_path):
    hist = Trainer(d1_recipe(tmp_path, "train.steps=15", "algorithm.inner_iterations=2", "algorithm.beta=0.0")).run()
    rewards = [h["reward_mean"] for h in hist]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3, rewards
    assert all(k in hist[0] for k in ("reward_mean", "clip_frac", "ratio_mean", "entropy", "rollout_time", "nfe"))


def test_d1_loop_golden_invariants(tmp_path, monkeypatch):
    seen = []
    real_update = stages.update

    def spy(algo, ctx, model, batch, iteration, micro, *a, **k):
        if iteration == 0:  # bit-identical log-probs of the pre-update policy on the stored noise: ratio exactly 1
            again = stages.score_iteration(algo, ctx, model, batch, 0, micro)
            assert torch.equal(again, batch.old_logp[0])
        m = real_update(algo, ctx, model, batch, iteration, micro, *a, **k)
        seen.append((ctx.step, iteration, m, batch))
        return m

    monkeypatch.setattr(stages, "update", spy)
    trainer = Trainer(d1_recipe(tmp_path, "train.steps=3", "algorithm.inner_iterations=3", "algorithm.beta=0.04"))
    trainer.run()
    assert [(s, it) for s, it, _, _ in seen] == [(s, it) for s in range(3) for it in range(3)]
    for step, it, m, batch in seen:
        if it == 0:  # first inner step: old policy == current policy on identical (stored) noise
            assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-12) and m["clip_frac"] == 0.0
        mean, _, _ = group_mean_std(batch.advantages.values, batch.group)
        assert mean.abs().max() < 1e-6  # mean baseline: advantages sum to zero in every group
        assert batch.views[it][0].input_ids.shape[0] == 32  # 4 prompts x 8 completions
    assert seen[0][2]["kl"] == 0.0  # step 0, iteration 0: the policy is the reference
    assert seen[1][2]["kl"] > 0.0 and seen[1][2]["ratio_mean"] != 1.0


def test_d1_exact_resume(tmp_path):
    straight = Trainer(d1_recipe(tmp_path / "a", "train.steps=3")).run()
    t = Trainer(d1_recipe(tmp_path / "b", "train.steps=3"))
    t.train_step(0)
    t.save_checkpoint(1)
    resumed = Trainer(d1_recipe(tmp_path / "b", "train.steps=3"))
    hist = resumed.run()
    assert [h["loss"] for h in hist] == [h["loss"] for h in straight[1:]]
    assert [h["reward_mean"] for h in hist] == [h["reward_mean"] for h in straight[1:]]


@pytest.mark.parametrize("family", ["llada_moe", "dream", "sdar", "sdar_moe", "llada2_moe"])
def test_d1_runs_on_other_families(tmp_path, family):
    hist = Trainer(d1_recipe(tmp_path, f"model.path=tiny:{family}", "train.steps=2",
                             "rollout.sampler={gen_length: 8, block_length: 4, steps: 8, temperature: 1.0}")).run()
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)


def test_reference_sync_mixes_policy_into_the_copy(tmp_path):
    from dare.trainer.reference import CopyReference
    trainer = Trainer(d1_recipe(tmp_path, "train.steps=1", "algorithm.beta=0.04", "algorithm.ref_sync_every=1",
                                "algorithm.ref_sync_alpha=0.6"))
    assert isinstance(trainer.reference, CopyReference)
    before = [p.detach().clone() for p in trainer.reference.model.parameters()]
    trainer.run()
    for r0, r1, p in zip(before, trainer.reference.model.parameters(), trainer.model.parameters()):
        assert torch.allclose(r1, 0.6 * p.detach() + 0.4 * r0, atol=1e-6)
    with pytest.raises(ValueError, match="ref_sync_every"):  # d1's default sync needs a copy, not the LoRA-disabled base
        Trainer(d1_recipe(tmp_path / "lora", "lora.enabled=true", "reference.mode=auto", "algorithm.ref_sync_every=64"))


def test_a_reward_that_fails_on_every_completion_stops_the_run(tmp_path):
    # reward.name=math on sudoku rows: every item is an error; the run used to train on zeros (loss 0, rc 0)
    with pytest.raises(ValueError, match=r"reward 'math' failed on all 32 completions of this step, e.g. error: "
                                         r"ValueError: math ground_truth must be a non-empty answer string"):
        Trainer(d1_recipe(tmp_path, "reward.name=math", "train.steps=1")).run()


def test_prompts_longer_than_the_model_allows_are_bad_rows(tmp_path):
    import json

    from dare.data.schema import DataError
    rows = [{"question": "2+2?", "answer": "4"}, {"question": "1+" * 3000 + "1?", "answer": "3001"},
            {"question": "3+3?", "answer": "6"}]
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = f"data.dataset={{path: {data}, format: qa, template: compact}}"
    with pytest.raises(DataError, match=r"example qa/1 \(row 1\): prompt has \d+ tokens, but the model has 1024 positions "
                                        r"and rollout.sampler.gen_length=8 leaves 1016 for the prompt"):
        Trainer(d1_recipe(tmp_path / "a", source, "train.steps=1", "train.batch_size=2"))
    source = source[:-1] + ", on_bad_row: skip}"
    t = Trainer(d1_recipe(tmp_path / "b", source, "train.steps=1", "train.batch_size=2"))
    assert [p.example["id"] for p in t.source.prompted] == ["qa/0", "qa/2"]
    t.close()
    with pytest.raises(ValueError, match="rollout.sampler.gen_length=2048 leaves no room for a prompt in the model's 1024"):
        Trainer(d1_recipe(tmp_path / "c", "rollout.sampler={gen_length: 2048, block_length: 32, steps: 64}"))

"""Step maps and model setups for the trajectory-replay tests (TraceRL, DiRL, CJ-GRPO)."""
import torch

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.common.replay import completion_block_ids
from dare.models import tiny, tiny_tokenizer
from tests.algorithms.helpers import rl_batch


def setup(config, family="llada", **sizes):
    tok = tiny_tokenizer()
    model = tiny(family, tokenizer=tok, seed=0, num_layers=1, **sizes)
    algo = build_algorithm(config)
    ctx = StepContext(step=2, seed=5, adapter=model.adapter)
    return model, algo, ctx


def masked_step_map(batch, steps: int, seed: int = 0, skip_tail: int = 0) -> torch.Tensor:
    """A full-attention step map: each token gets a step in [0, steps) (every step used when possible);
    the last ``skip_tail`` tokens of odd rows are never written (-1)."""
    g = torch.Generator().manual_seed(seed)
    B, Lc = batch.completion_ids.shape
    out = torch.empty(B, Lc, dtype=torch.long)
    for i in range(B):
        base = torch.arange(Lc) % steps
        out[i] = base[torch.randperm(Lc, generator=g)]
        if skip_tail and i % 2:
            out[i, Lc - skip_tail:] = -1
    return out


def block_step_map(batch, block_size: int, steps_per_block: int, seed: int = 0) -> torch.Tensor:
    """A block-diffusion step map: the tokens of block j get row-global steps in increasing order per block,
    at most ``steps_per_block`` distinct steps per block (like SDAR's sampler with a per-row step counter)."""
    g = torch.Generator().manual_seed(seed)
    blocks = completion_block_ids(batch, block_size)
    B, Lc = blocks.shape
    out = torch.empty(B, Lc, dtype=torch.long)
    for i in range(B):
        counter = 0
        for b in torch.unique(blocks[i]).tolist():
            cols = (blocks[i] == b).nonzero().flatten()
            n = cols.numel()
            k = int(torch.randint(1, min(steps_per_block, n) + 1, (1,), generator=g))
            local = torch.arange(n) % k
            local = local[torch.randperm(n, generator=g)]
            out[i, cols] = counter + local
            counter += k
    return out


def replay_batch(family_block: bool, seed=0, n_prompts=2, group=3, gen_len=10, block_size=4, steps=4, **kw):
    batch = rl_batch(n_prompts=n_prompts, group=group, gen_len=gen_len, seed=seed, **kw)
    if family_block:
        batch.step_map = block_step_map(batch, block_size, steps, seed)
    else:
        batch.step_map = masked_step_map(batch, steps, seed)
    return batch


def rollout_batch(model, sampler, prompts=("abc", "hello there"), n=2, seed=0, rewards=None, record=None):
    """(Batch, Rollout) from a real rollout of ``model`` (the fields the trainer builds for RL), recording ``record``
    (default: the trajectory, which the tests compare against)."""
    from dare.algorithms import RLBatch
    from dare.rollout import Record
    from dare.rollout.api import generate
    tok = tiny_tokenizer()
    r = generate(model, [tok.encode(p) for p in prompts], sampler, generator=torch.Generator().manual_seed(seed), n=n,
                 record=record or Record(trajectory=True))
    B = r.completion_ids.shape[0]
    if rewards is None:
        rewards = torch.arange(B).float() % 3
    batch = RLBatch(uid=torch.arange(B), group=r.prompt_index.clone(), prompt_ids=r.prompt_ids.clone(),
                  prompt_mask=r.prompt_mask.bool(), completion_ids=r.completion_ids.clone(),
                  completion_mask=r.completion_mask.bool(), rewards=rewards, step_map=r.step_map.clone())
    return batch, r


def _register_toy_reward():
    from dare.rewards import REWARDS, register_reward
    if "traj_sevens" not in REWARDS:
        @register_reward("traj_sevens")
        def _sevens(completion, example):
            """A toy reward a tiny random model can learn: the fraction of '7' characters."""
            return completion.count("7") / max(len(completion), 1)


def run_recipe(tmp_path, algo: str, family: str, *overrides, steps: int = 2):
    """``dare train recipes/rl/<algo>.yaml`` through the loop API on a tiny model; returns the metric history."""
    from pathlib import Path

    from dare.trainer.recipe import load_recipe
    from dare.trainer.loop import Trainer
    _register_toy_reward()
    root = Path(__file__).resolve().parents[2]
    from tests.tiny_rl import tiny_random
    recipe = load_recipe(root / f"recipes/rl/{algo}.yaml", [
        *tiny_random(f"recipes/rl/{algo}.yaml", family), f"train.output_dir={tmp_path}", f"train.steps={steps}", "train.resume=never",
        "train.save_every=0", "train.export=false", "logging.progress=false", "logging.tensorboard=false",
        "logging.plot=false", "reward.name=traj_sevens", "reward.workers=0", "train.batch_size=2",
        "rollout.group_size=2", "data.dataset={name: sudoku, template: compact, limit: 8, shuffle_seed: 0}",
        "model.tiny_sizes={hidden_size: 32, num_layers: 1}", *overrides])
    return Trainer(recipe).run()


def learning_curve(tmp_path, algo: str, family: str, *overrides, steps: int = 15):
    """Rewards of a short run on the toy reward (8 completions per prompt, high learning rate)."""
    hist = run_recipe(tmp_path, algo, family, "optim.lr=3e-3", "optim.weight_decay=0.0", "rollout.group_size=8",
                      "train.batch_size=4", "data.dataset={name: sudoku, template: compact, limit: 64, shuffle_seed: 0}",
                      "model.tiny_sizes={hidden_size: 64, num_layers: 2}", *overrides, steps=steps)
    return [h["reward_mean"] for h in hist]

"""``dare`` with a toy reward a random tiny model scores above zero (so RL gradients are not zero), counting the
sequence-parallel forwards and the prompts decoded: run directly (one process) or by torchrun from
test_sequence_parallel_train.py. Each process writes ``{"sharded": score_targets calls run sharded, "decoded":
prompts it generated}`` to ``$DARE_TEST_COUNTS/rank<r>``, and rank 0 the whole gradient every optimizer sees before
its step (FSDP2's shards gathered) to ``$DARE_TEST_COUNTS/grads.pt``: one {parameter: gradient} per step call."""
import json
import os
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import dare.diffusion.logprob as logprob
import dare.rollout as rollout
from dare.cli import main
from dare.rewards import REWARDS, register_reward

if "test_sevens" not in REWARDS:
    @register_reward("test_sevens")
    def _sevens(completion, example):
        return completion.count("7") / max(len(completion), 1)

if "test_distinct" not in REWARDS:  # for models whose samples hold no digits (DiffusionGemma's 512-token vocabulary)
    @register_reward("test_distinct")
    def _distinct(completion, example):
        return len(set(completion)) / max(len(completion), 1)

_counts = {"sharded": 0, "decoded": 0}
_sharded, _generate = logprob._score_sharded, rollout.generate


def _counted_sharded(*args, **kwargs):
    _counts["sharded"] += 1
    return _sharded(*args, **kwargs)


def _counted_generate(model, prompts, *args, **kwargs):
    _counts["decoded"] += len(prompts)
    return _generate(model, prompts, *args, **kwargs)


logprob._score_sharded, rollout.generate = _counted_sharded, _counted_generate
_grads: list = []


def _record_gradients(optimizer, args, kwargs):
    """Every rank gathers (the same collectives in the same order); rank 0 keeps the whole fp64 gradients."""
    step = {}
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            step[f"{len(step)}:{tuple(g.shape)}"] = g.detach().double().cpu().clone()
    _grads.append(step)


register_optimizer_step_pre_hook(_record_gradients)

if __name__ == "__main__":
    code = main(sys.argv[1:])
    out = Path(os.environ["DARE_TEST_COUNTS"])
    (out / f"rank{os.environ.get('RANK', '0')}").write_text(json.dumps(_counts))
    if os.environ.get("RANK", "0") == "0":
        torch.save(_grads, out / "grads.pt")
    sys.exit(code)

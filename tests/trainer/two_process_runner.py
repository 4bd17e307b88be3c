"""Run two-process equivalence cases one after another in this interpreter (tests/trainer/two_processes.py).

``python two_process_runner.py CASES.json one`` trains each case as one process; under ``torchrun
--nproc_per_node=2`` with ``two`` each case runs on both ranks (the process group is set up once and kept across
cases). Per case it writes ``<side>/<case>/run`` (the run folder), ``counts/rank<r>.json`` ({"sharded": scoring
calls that ran sequence-parallel, "decoded": prompts this rank generated}), for cases that ask rank 0's
``grads.pt`` (each optimizer step's whole gradient in fp64, FSDP2's shards gathered) and, once every rank is through,
``done``. A failing case ends the run (exit 1, its traceback printed): a rank that went on alone could wait forever
in a collective its peer skipped.
"""
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import dare.diffusion.logprob as logprob
import dare.rollout as rollout
from dare.rewards import REWARDS, register_reward
from dare.trainer.distributed import close_process_group
from dare.trainer.loop import Trainer
from dare.trainer.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[2]

# Toy rewards a random tiny model scores above zero, so RL gradients are not zero.
for _name in ("test_sevens", "traj_sevens"):  # the names the cases' recipes use
    if _name not in REWARDS:
        register_reward(_name)(lambda c, e: c.count("7") / max(len(c), 1))
if "test_distinct" not in REWARDS:  # models whose samples hold no digits (DiffusionGemma's 512-token vocabulary)
    register_reward("test_distinct")(lambda c, e: len(set(c)) / max(len(c), 1))

_counts = {"sharded": 0, "decoded": 0}
_grads: list = []
_record = {"grads": False}
_sharded, _generate = logprob._score_sharded, rollout.generate


def _counted_sharded(*args, **kwargs):
    _counts["sharded"] += 1
    return _sharded(*args, **kwargs)


def _counted_generate(model, prompts, *args, **kwargs):
    _counts["decoded"] += len(prompts)
    return _generate(model, prompts, *args, **kwargs)


logprob._score_sharded, rollout.generate = _counted_sharded, _counted_generate


def _record_gradients(optimizer, args, kwargs):
    """Every rank gathers (the same collectives in the same order); rank 0 keeps the whole fp64 gradients."""
    if not _record["grads"]:
        return
    step = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            step[f"{len(step)}:{tuple(g.shape)}"] = g.detach().double().cpu().clone()
    _grads.append(step)


register_optimizer_step_pre_hook(_record_gradients)


def main(spec_path: str, side: str) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cases = json.loads(Path(spec_path).read_text())
    root = Path(spec_path).parent / side
    rank = int(os.environ.get("RANK", "0"))
    trainer = None
    for name, case in cases.items():
        folder = root / name
        (folder / "counts").mkdir(parents=True, exist_ok=True)
        _counts.update(sharded=0, decoded=0)
        _grads.clear()
        _record["grads"] = case["grads"]
        start = time.perf_counter()
        try:
            trainer = Trainer(load_recipe(ROOT / case["recipe"], case[side]))
            history = trainer.run()
        except Exception:
            print(f"two-process case {name} ({side}, rank {rank}) failed:", file=sys.stderr)
            traceback.print_exc()
            return 1
        (folder / "counts" / f"rank{rank}.json").write_text(json.dumps(_counts))
        if rank == 0 and case["grads"]:
            torch.save(list(_grads), folder / "grads.pt")
        trainer.env.barrier()
        if rank == 0:
            (folder / "done").write_text("")
        print(f"{name} ({side}, rank {rank}): {len(history)} steps in {time.perf_counter() - start:.1f} s", flush=True)
    if trainer is not None:
        trainer.env.close(sync=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

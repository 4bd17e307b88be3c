"""``dare`` with a toy reward a random tiny model scores above zero (so RL gradients are not zero), counting the
sequence-parallel forwards and the prompts decoded: run directly (one process) or by torchrun from
test_sequence_parallel_train.py. Each process writes ``{"sharded": score_targets calls run sharded, "decoded":
prompts it generated}`` to ``$DARE_TEST_COUNTS/rank<r>``."""
import json
import os
import sys
from pathlib import Path

import dare.diffusion.logprob as logprob
import dare.rollout as rollout
from dare.cli import main
from dare.rewards import REWARDS, register_reward

if "test_sevens" not in REWARDS:
    @register_reward("test_sevens")
    def _sevens(completion, example):
        return completion.count("7") / max(len(completion), 1)

_counts = {"sharded": 0, "decoded": 0}
_sharded, _generate = logprob._score_sharded, rollout.generate


def _counted_sharded(*args, **kwargs):
    _counts["sharded"] += 1
    return _sharded(*args, **kwargs)


def _counted_generate(model, prompts, *args, **kwargs):
    _counts["decoded"] += len(prompts)
    return _generate(model, prompts, *args, **kwargs)


logprob._score_sharded, rollout.generate = _counted_sharded, _counted_generate

if __name__ == "__main__":
    code = main(sys.argv[1:])
    (Path(os.environ["DARE_TEST_COUNTS"]) / f"rank{os.environ.get('RANK', '0')}").write_text(json.dumps(_counts))
    sys.exit(code)

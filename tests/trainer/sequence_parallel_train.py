"""``dare`` with a toy reward a random tiny model scores above zero (so RL gradients are not zero), counting the
sequence-parallel forwards: run directly (one process) or by torchrun from test_sequence_parallel_train.py. Each
process writes how many sharded ``score_targets`` calls it made to ``$DARE_TEST_COUNTS/rank<r>``."""
import os
import sys
from pathlib import Path

import dare.diffusion.logprob as logprob
from dare.cli import main
from dare.rewards import REWARDS, register_reward

if "test_sevens" not in REWARDS:
    @register_reward("test_sevens")
    def _sevens(completion, example):
        return completion.count("7") / max(len(completion), 1)

_calls = [0]
_sharded = logprob._score_sharded


def _counted(*args, **kwargs):
    _calls[0] += 1
    return _sharded(*args, **kwargs)


logprob._score_sharded = _counted

if __name__ == "__main__":
    code = main(sys.argv[1:])
    (Path(os.environ["DARE_TEST_COUNTS"]) / f"rank{os.environ.get('RANK', '0')}").write_text(str(_calls[0]))
    sys.exit(code)

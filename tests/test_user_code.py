"""A user's own reward and dataset loader named by reference in a recipe (``dare.config.references``), loaded in the
trainer and in reward worker processes; ``model.tiny_sizes: null`` (issue 40)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dare.config.references import Referenced, absolute, is_reference, load_reference
from dare.data import DataConfig, load_examples
from dare.rewards import score_batch
from dare.rewards.registry import check_reward_spec, get_reward
from dare.trainer.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]

REWARDS = textwrap.dedent('''
    import os

    def score(completion, example):
        with open(os.path.join(os.path.dirname(__file__), "scored_by.txt"), "a") as f:
            f.write(f"{os.getpid()}\\n")
        return 0.25 + 0.5 * ("4" in completion)
''')
LOADER = textwrap.dedent('''
    import os

    def load(split):
        with open(os.path.join(os.path.dirname(__file__), "loaded.txt"), "a") as f:
            f.write(split + "\\n")
        return [{"question": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(1, 41)]

    def no_split():
        return iter([{"question": "1 + 1?", "answer": "2"}])

    def not_rows(split):
        return "rows"
''')


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    (tmp_path / "my_data.py").write_text(LOADER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_what_counts_as_a_reference():
    for ref in ("my_rewards:score", "pkg.mod:fn", "./my_rewards.py:score", "/abs/x.py:Cls.method", "x.py:f"):
        assert is_reference(ref), ref
    for name in ("math", "auto", "speed_cosine", "a:b:c", "x.py", ":f", "mod:", 3, None):
        assert not is_reference(name), name


def test_a_file_reference_loads_from_the_working_directory_and_any_other(user_dir, tmp_path_factory, monkeypatch):
    fn = load_reference("./my_rewards.py:score", "reward.name")
    assert fn("4", {}) == 0.75 and fn("x", {}) == 0.25
    assert load_reference("my_rewards:score", "reward.name") is fn  # a module of the working directory: the same file
    ref = absolute("my_rewards:score")
    assert ref == f"{user_dir / 'my_rewards.py'}:score"
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    assert load_reference(ref, "reward.name") is fn
    assert absolute("json:dumps") == "json:dumps"  # importable modules stay modules


@pytest.mark.parametrize("ref, says", [
    ("./nope.py:score", "no file"),
    ("nope_module_xyz:score", "no module named 'nope_module_xyz'"),
    ("./my_rewards.py:missing", "defines no 'missing'"),
    ("./my_rewards.py:os", "is a module, not a function"),
])
def test_a_bad_reference_is_one_line_naming_the_key(user_dir, ref, says):
    with pytest.raises(ValueError) as e:
        load_reference(ref, "reward.name")
    msg = str(e.value)
    assert msg.startswith("reward.name: ") and says in msg and "\n" not in msg, msg


def test_a_module_that_fails_to_import_is_named(user_dir):
    (user_dir / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match=r"^data.loader: importing './broken.py:f' failed: RuntimeError: boom$"):
        load_reference("./broken.py:f", "data.loader")


def test_a_reward_by_reference_scores_in_worker_processes(user_dir):
    check_reward_spec("./my_rewards.py:score", "reward.name")
    check_reward_spec({"auto": 1.0, "my_rewards:score": 0.5}, "reward.terms")
    with pytest.raises(ValueError, match="reward.name: unknown reward 'my_reward'.*module:function"):
        check_reward_spec("my_reward", "reward.name")
    fn = get_reward("./my_rewards.py:score")
    assert isinstance(fn, Referenced) and fn.reward_name == "./my_rewards.py:score"
    results = score_batch("./my_rewards.py:score", ["4", "x", "44"], [{"task": "math", "ground_truth": "4"}] * 3,
                          workers=2)
    assert [r.score for r in results] == [0.75, 0.25, 0.75] and all(r.reason is None for r in results)
    pids = {int(p) for p in (user_dir / "scored_by.txt").read_text().split()}
    assert pids and os.getpid() not in pids  # scored in the pool's processes, which imported the file themselves


def test_a_dataset_loader_by_reference(user_dir):
    examples = load_examples(DataConfig(loader="./my_data.py:load", split="train", limit=5, shuffle_seed=0))
    assert len(examples) == 5 and all(ex["task"] == "math" for ex in examples)
    assert {ex["ground_truth"] for ex in examples} <= {str(2 * a) for a in range(1, 41)}
    assert (user_dir / "loaded.txt").read_text() == "train\n"
    assert load_examples(DataConfig(loader="my_data:no_split"))[0]["ground_truth"] == "2"
    with pytest.raises(ValueError, match="returned a str; it must return"):
        load_examples(DataConfig(loader="./my_data.py:not_rows"))
    with pytest.raises(ValueError, match="set exactly one of name, path, hf, loader or mix"):
        DataConfig(loader="./my_data.py:load", name="gsm8k")
    with pytest.raises(ValueError, match="^data.loader: .*defines no 'lod'"):
        DataConfig(loader="./my_data.py:lod")


def test_tiny_sizes_null_is_no_sizes():
    recipe = load_recipe(ROOT / "recipes/rl/coupled_grpo.yaml", ["model.path=tiny:llada", "model.tiny_sizes=null"])
    assert recipe.model.tiny_sizes is None


@pytest.mark.integration
def test_dare_train_uses_a_reward_file_and_a_loader_file_from_the_folder_it_runs_in(user_dir):
    """What docs/rewards.md and docs/data.md show: `dare train` from the user's folder, the reward scored in a worker
    process (reward.workers=1) that imported the file itself, the prompts from the loader."""
    out = user_dir / "run"
    cmd = [sys.executable, "-m", "dare.cli", "train", str(ROOT / "recipes/rl/coupled_grpo.yaml"),
           "reward.name=./my_rewards.py:score", "reward.workers=1",
           "data.dataset={loader: ./my_data.py:load, template: compact, limit: 8, shuffle_seed: 0}",
           # the recipe's checkpoint path is relative to the repository root (where the README runs dare); this
           # test runs in another folder
           f"model.path={ROOT / 'src/dare/assets/quickstart/lazy-sudoku-llada-sft'}", "train.steps=2", "train.save_every=0",
           "train.export=false", f"train.output_dir={out}", "logging.progress=false", "logging.tensorboard=false",
           "logging.plot=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd, cwd=user_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if "reward_mean" in r]
    assert len(rewards) == 2 and all(0.25 <= r <= 0.75 for r in rewards), rewards
    assert (user_dir / "loaded.txt").read_text().split() == ["train"]
    pids = {int(p) for p in (user_dir / "scored_by.txt").read_text().split()}
    assert pids and proc.pid not in pids

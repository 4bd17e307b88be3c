"""RL on the uniform-noise family (tiny DiffusionGemma) learns the toy '7' reward (slow): every RL method defined on it
-- d1-style GRPO (one-step fully-noised canvas), Coupled-GRPO (complementary corruption sets), EBPO (sequence-level
composite block ELBO), wd1, SPG, BGPO and ESPO.

The rollouts use the canvas sampler with one pass per canvas: the completion is that pass's argmax given a uniform
random canvas, i.e. exactly the distribution d1's fully-noised estimate scores. The canvas sampler's tokens are an
argmax (transformers' generate), so a group's only randomness is its canvas noise; with several passes the canvas
converges to the model's own accepted tokens and, at these learning rates, a group can collapse into identical
completions (zero advantages, no gradient ever again) -- measured: EBPO and ESPO stuck at 0.06 on
``<|reserved_127|>`` x 8 with 4 passes (docs/algorithms/uniform_noise.md, "Learning the toy reward").
"""
import pytest

from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture; registers the reward)

ONE_PASS = "{gen_length: 8, block_length: 4, steps_per_block: 1, temperature: 1.0}"  # 2 canvases of the tiny model


@pytest.mark.slow
@pytest.mark.parametrize("name,recipe,overrides", [
    ("d1", "recipes/d1_tiny.yaml", ["algorithm.beta=0.0"]),
    ("coupled_grpo", None, ["algorithm.beta=0.0"]),
    ("ebpo", None, ["algorithm.num_mc=4"]),
    ("wd1", None, ["algorithm.beta=0.0"]),
    ("spg", None, []),
    ("bgpo", None, []),
    ("espo", None, ["algorithm.num_mc=2", "algorithm.beta=0.0"]),
], ids=["d1", "coupled_grpo", "ebpo", "wd1", "spg", "bgpo", "espo"])
def test_diffusion_gemma_learns_a_toy_reward(tmp_path, name, recipe, overrides):
    rewards = learns_toy_reward(tmp_path, name, "diffusion_gemma", "optim.lr=1e-3", *overrides, recipe=recipe,
                                sampler=ONE_PASS)
    print(name, " ".join(f"{r:.3f}" for r in rewards))  # the curve, with -s

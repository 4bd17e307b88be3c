"""RL on the uniform-noise family (tiny DiffusionGemma) learns the toy '7' reward (integration tier): every RL method defined on it
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

from dare.algorithms import ALGORITHMS, load_builtin_algorithms
from tests.algorithms.toy_task import learns_toy_reward, one_thread  # noqa: F401  (autouse fixture; registers the reward)

ONE_PASS = "{gen_length: 8, block_length: 4, steps_per_block: 1, temperature: 1.0}"  # 2 canvases of the tiny model
# Per-method speed settings (fewer MC samples, no KL; d1 from its tiny recipe); a method not named runs its
# recipes/rl/<name>.yaml as is.
SPEED = {
    "d1": ("recipes/d1_tiny.yaml", ["algorithm.beta=0.0"]),
    "coupled_grpo": (None, ["algorithm.beta=0.0"]),
    "ebpo": (None, ["algorithm.num_mc=4"]),
    "wd1": (None, ["algorithm.beta=0.0"]),
    "espo": (None, ["algorithm.num_mc=2", "algorithm.beta=0.0"]),
    "spg": (None, ["algorithm.num_t=2", "algorithm.inner_iterations=2"]),  # as its masked-family learning test
    "bgpo": (None, ["algorithm.num_mc=4"]),  # as its block-family learning test
}


def _uniform_noise_rl_methods() -> list[str]:
    """The registered RL methods defined on encoder-decoder (uniform-noise) models, from their ``supports``."""
    load_builtin_algorithms()
    return sorted(n for n, c in ALGORITHMS.items() if c.uses_rollout and "encoder_decoder" in c.supports
                  and c.__module__.startswith("dare.algorithms"))


@pytest.mark.integration
@pytest.mark.parametrize("name", _uniform_noise_rl_methods())
def test_diffusion_gemma_learns_a_toy_reward(tmp_path, name):
    recipe, overrides = SPEED.get(name, (None, []))
    rewards = learns_toy_reward(tmp_path, name, "diffusion_gemma", "optim.lr=1e-3", *overrides, recipe=recipe,
                                sampler=ONE_PASS)
    print(name, " ".join(f"{r:.3f}" for r in rewards))  # the curve, with -s

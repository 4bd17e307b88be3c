"""``dare train`` with ``distributed.sequence_parallel: 2`` on two processes reproduces one process: SFT (a
bidirectional and a block-diffusion family, and DiffusionGemma's encoder-decoder), LoRA SFT, DPO and RL (d1 with a
frozen reference; TraceRL with its value model on SDAR's block-causal layout; d1 on DiffusionGemma with LoRA). With
one group, the data, seeds and rollouts are those of one process (its ranks decode half of the prompts each and
exchange them); the training forward is split. In float64 every logged loss agrees to 1e-6 (relative) and every
gradient an optimizer steps with to 1e-6 of its largest entry (the log-softmax runs in fp32, so rounding of the
head's gradient is what is left). The cases run in the shared two-process runner (tests/trainer/two_processes.py),
which counts, per rank, the scoring calls that ran sharded and the prompts decoded, and keeps rank 0's gradients."""
import pytest

from tests.trainer.helpers import TOY_PREF, TOY_SFT
from tests.tiny_rl import tiny_random
from tests.trainer.two_processes import Case, register

# float64: the group splits its prompts for decoding (each rank decodes half, then they exchange rollouts), i.e.
# other batch shapes than one process; float32 rounding of those may flip a near-tie token (docs/samplers.md), and
# float64 keeps the training forward's rounding far below the 1e-6 compared.
F64 = "model.dtype=float64"
RL = ("train.steps=2", "reward.name=test_sevens", "reward.workers=0", "optim.lr=3e-3", "algorithm.beta=0.04", F64)
SFT = (f"data.pairs={TOY_SFT}", "train.steps=3", "train.batch_size=4", "train.micro_batch_size=1", F64)
SP = ("distributed.nproc=2", "distributed.sequence_parallel=2")
_CASES = {
    "sft_llada": ("recipes/sft_tiny.yaml", SFT + ("model.path=tiny:llada",)),
    "sft_sdar": ("recipes/sft_tiny.yaml", SFT + ("model.path=tiny:sdar",)),
    "sft_diffusion_gemma": ("recipes/diffusion_gemma/sft_tiny.yaml", SFT + ("data.max_length=40",)),
    "dpo_llada": ("recipes/dpo_tiny.yaml", (f"data.pairs={TOY_PREF}", "train.steps=2", F64)),
    "lora_sft_llada": ("recipes/lora_sft_tiny.yaml", (f"data.pairs={TOY_SFT}", "train.steps=2", F64)),
    "d1_llada": ("recipes/d1_tiny.yaml", RL + ("algorithm.inner_iterations=2",
                                               "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}")),
    "tracerl_value_sdar": ("recipes/rl/tracerl_with_value.yaml", (*tiny_random("recipes/rl/tracerl_with_value.yaml"), *RL)),
    "d1_diffusion_gemma": ("recipes/diffusion_gemma/rl_tiny.yaml", RL + ("train.batch_size=2", "reward.name=test_distinct",
                                                                       "rollout.sampler.gen_length=8")),
}
CASES = register({f"sp_{name}": Case(recipe, ("train.save_every=0", *overrides), two=SP, grads=True)
                  for name, (recipe, overrides) in _CASES.items()})
KEYS = ("loss", "grad_norm", "masked_frac", "accuracy", "margin", "reward_mean", "kl", "ratio_mean", "value_loss", "completion_len")


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_two_processes_sequence_parallel_reproduce_one_process(two_process_runs, case):
    first, second = two_process_runs(case)
    one, calls_one, grads_one = first.metrics, first.counts, first.grads
    two, calls_two, grads_two = second.metrics, second.counts, second.grads
    assert set(calls_one) == {"rank0"} and calls_one["rank0"]["sharded"] == 0
    assert set(calls_two) == {"rank0", "rank1"}
    zero, one_ = calls_two["rank0"], calls_two["rank1"]
    assert zero["sharded"] == one_["sharded"] > 0  # the training forwards ran sharded
    # Each rank decoded half of the group's prompts (none for SFT).
    assert zero["decoded"] == one_["decoded"] and 2 * zero["decoded"] == calls_one["rank0"]["decoded"]
    assert (zero["decoded"] > 0) == ("reward_mean" in one[0])
    assert len(one) == len(two) > 0
    if "reward_mean" in one[0]:
        assert any(r["grad_norm"] > 0 for r in one)  # the RL comparison is not between two zero updates
    for a, b in zip(one, two):
        for key in KEYS:
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a, b)
    assert len(grads_one) == len(grads_two) > 0  # one entry per optimizer step (a value model's too)
    for g1, g2 in zip(grads_one, grads_two):
        assert g1.keys() == g2.keys() and g1
        scale = max(g.abs().max().item() for g in g1.values())
        assert scale > 0
        worst = max((g1[k] - g2[k]).abs().max().item() for k in g1)
        assert worst <= 1e-6 * max(1.0, scale), (case, worst, scale)

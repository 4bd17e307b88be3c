"""``dare train`` with ``distributed.sequence_parallel: 2`` on two processes reproduces one process: SFT (a
bidirectional and a block-diffusion family, and DiffusionGemma's encoder-decoder), LoRA SFT, DPO and RL (d1 with a
frozen reference; TraceRL with its value model on SDAR's block-causal layout; d1 on DiffusionGemma with LoRA). With
one group, the data, seeds and rollouts are those of one process (its ranks decode half of the prompts each and
exchange them); the training forward is split. In float64 every logged loss agrees to 1e-6 (relative) and every
gradient an optimizer steps with to 1e-6 of its largest entry (the log-softmax runs in fp32, so rounding of the
head's gradient is what is left)."""
import json
import os
import sys

import pytest
import torch

from tests.trainer.helpers import ROOT, TOY_PREF, TOY_SFT, run_to_success

WRAPPER = ROOT / "tests" / "trainer" / "sequence_parallel_train.py"
COMMON = ["logging.progress=false", "logging.tensorboard=false", "train.export=false", "train.save_every=0"]
# float64: the group splits its prompts for decoding (each rank decodes half, then they exchange rollouts), i.e.
# other batch shapes than one process; float32 rounding of those may flip a near-tie token (docs/samplers.md), and
# float64 keeps the training forward's rounding far below the 1e-6 compared.
F64 = "model.dtype=float64"
RL = ["train.steps=2", "reward.name=test_sevens", "reward.workers=0", "optim.lr=3e-3", "algorithm.beta=0.04", F64]
SFT = [f"data.pairs={TOY_SFT}", "train.steps=3", "train.batch_size=4", "train.micro_batch_size=1", F64]
CASES = {
    "sft_llada": ("recipes/sft_tiny.yaml", SFT + ["model.path=tiny:llada"]),
    "sft_sdar": ("recipes/sft_tiny.yaml", SFT + ["model.path=tiny:sdar"]),
    "sft_diffusion_gemma": ("recipes/diffusion_gemma/sft_tiny.yaml", SFT + ["data.max_length=40"]),
    "dpo_llada": ("recipes/dpo_tiny.yaml", [f"data.pairs={TOY_PREF}", "train.steps=2", F64]),
    "lora_sft_llada": ("recipes/lora_sft_tiny.yaml", [f"data.pairs={TOY_SFT}", "train.steps=2", F64]),
    "d1_llada": ("recipes/d1_tiny.yaml", RL + ["algorithm.inner_iterations=2",
                                               "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}"]),
    "tracerl_value_sdar": ("recipes/rl/tracerl_with_value.yaml", RL),
    "d1_diffusion_gemma": ("recipes/diffusion_gemma/rl_tiny.yaml", RL + ["train.batch_size=2", "reward.name=test_distinct",
                                                                       "rollout.sampler.gen_length=8"]),
}
KEYS = ("loss", "grad_norm", "masked_frac", "accuracy", "margin", "reward_mean", "kl", "ratio_mean", "value_loss", "completion_len")


def _train(out, recipe, overrides, two: bool):
    counts = out / "counts"
    counts.mkdir(parents=True)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"] if two else [sys.executable]
    sp = ["distributed.nproc=2", "distributed.sequence_parallel=2"] if two else []
    cmd = [*launch, str(WRAPPER), "train", recipe, *COMMON, *overrides, *sp, f"train.output_dir={out / 'run'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "DARE_TEST_COUNTS": str(counts),
           "PYTHONPATH": f"{ROOT}:{ROOT / 'src'}"}
    run_to_success(cmd, env, 600)
    metrics = [json.loads(l) for l in (out / "run" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    grads = torch.load(counts / "grads.pt")
    return metrics, {p.name: json.loads(p.read_text()) for p in counts.iterdir() if p.suffix != ".pt"}, grads


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_two_processes_sequence_parallel_reproduce_one_process(tmp_path, case):
    recipe, overrides = CASES[case]
    one, calls_one, grads_one = _train(tmp_path / "one", recipe, overrides, two=False)
    two, calls_two, grads_two = _train(tmp_path / "two", recipe, overrides, two=True)
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

"""dare plan: the simulated step equals the same step on real tensors; full-size plans are fast and say why."""
import json
import subprocess
import sys

import pytest
import torch

from dare.trainer.recipe import load_recipe
from dare.plan.gpus import GIB, parse_bytes
from dare.plan.planner import PlanOptions, plan_recipe
from dare.plan.validate import measure, measure_here
from tests.tiny_rl import tiny_random

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _peaks(plan) -> dict:
    phases = plan["phases"] if isinstance(plan, dict) else [p.__dict__ for p in plan.phases]
    return {p["name"]: p["peak_bytes"] for p in phases}


def _load(recipe, overrides=()):
    """A repository recipe; recipes/rl/*.yaml on their tiny random model (tests/tiny_rl.py), as these tests measure."""
    return load_recipe(ROOT / recipe, [*tiny_random(recipe), *overrides])


def _planned(recipe, gpus):
    return plan_recipe(recipe, PlanOptions(gpus=gpus, target="cpu"))


@pytest.mark.parametrize("recipe,overrides,gpus", [
    ("recipes/sft_tiny.yaml", [], 1),
    ("recipes/sft_tiny.yaml", ["model.gradient_checkpointing=true"], 2),
    ("recipes/sft_tiny.yaml", ["model.path=tiny:llada2_moe", "lora.enabled=true"], 2),
    ("recipes/d1_tiny.yaml", [], 2),
    ("recipes/rl/tracerl_with_value.yaml", [], 2),
    # transformers' MoE experts call torch._grouped_mm in fp32 on a CPU, which has no fake-tensor rule there
    ("recipes/diffusion_gemma/sft_tiny.yaml", ["model.gradient_checkpointing=true", "train.micro_batch_size=2",
                                               "train.batch_size=8"], 2),
    # one process: no FSDP to materialise the fake weights (to_empty's in-place swap refused its tied embedding)
    ("recipes/diffusion_gemma/sft_tiny.yaml", ["train.micro_batch_size=2", "train.batch_size=4"], 1),
])
def test_plan_equals_the_step_on_real_tensors(recipe, overrides, gpus):
    """Fake weights, same code: every phase's peak of rank 0 is within 3 % of the real-tensor run's (fake process group;
    the issue asks 5 %; most configurations agree to the byte, checkpointing differs by ~1 %)."""
    r = _load(recipe, overrides)
    planned = _planned(r, gpus)
    assert planned.error is None, planned.error
    real = measure_here(r, PlanOptions(gpus=gpus, target="cpu"))
    assert real["error"] is None, real["error"]
    assert set(_peaks(planned)) == set(_peaks(real)) and planned.phases
    for name, peak in _peaks(real).items():
        assert abs(_peaks(planned)[name] - peak) <= 0.03 * peak, (name, _peaks(planned), _peaks(real))


def test_plan_follows_the_trainers_wrapping():
    """Checkpointing, LoRA and the gradient-sync setting change the plan the way they change training."""
    base = ["model.path=tiny:llada", "train.micro_batch_size=2", "train.batch_size=8", "data.max_length=256",
            "model.tiny_sizes.num_layers=4", "model.tiny_sizes.hidden_size=256", "model.tiny_sizes.intermediate_size=512"]
    r = lambda *o: _load("recipes/sft_tiny.yaml", [*base, *o])
    plain = _planned(r(), 2)
    ckpt = _planned(r("model.gradient_checkpointing=true"), 2)
    lora = _planned(r("lora.enabled=true"), 2)
    every = _planned(r("distributed.grad_sync=every"), 2)
    act = lambda p: p.phases[-1].breakdown["activations"]
    assert act(ckpt) < 0.3 * act(plain) and ckpt.peak_bytes < plain.peak_bytes  # 4 layers: 37.6 -> 10.1 MB at the peak
    assert lora.trainable < plain.trainable and lora.phases[-1].breakdown["optimizer states"] < plain.phases[-1].breakdown["optimizer states"]
    assert "unsharded gradients" in plain.phases[-1].breakdown and every.peak_bytes < plain.peak_bytes


# EGSPO and d-OPSD divide a step's work between their inner iterations (``iterations_split_work``); d2 AnyOrder scores
# views every iteration shares once (as d-TreeRPO, DiRL, CJ-GRPO, IGPO, MDPO, JustGRPO); d1 draws fresh views per
# iteration. Before issue 39's fix a plan at mu = 4 counted
# EGSPO / d-OPSD's score and update and the shared scoring twice (the plan shrank mu to 2 and scaled everything by 2).
@pytest.mark.parametrize("recipe,mu", [("recipes/rl/egspo.yaml", 2), ("recipes/rl/egspo.yaml", 4),
                                       ("recipes/rl/d_opsd.yaml", 2), ("recipes/rl/d_opsd.yaml", 4),
                                       ("recipes/rl/d2_anyorder.yaml", 4), ("recipes/d1_tiny.yaml", 4)])
def test_planned_flops_equal_the_whole_step_on_real_tensors(recipe, mu):
    """The planner's reductions (two inner iterations, two micro-batches, one update iteration) scale back to the
    FLOPs of the whole step, run unreduced on real tensors at the same settings."""
    from dare.trainer.model_setup import load_policy
    over = [f"algorithm.inner_iterations={mu}"] + (["algorithm.sample_train_steps=4"] if "egspo" in recipe else [])
    r = _load(recipe, over)
    planned = _planned(r, 1)
    model, _ = load_policy(r.model)
    whole = plan_recipe(r, PlanOptions(gpus=1, target="cpu", simulate=False, reduced=False, model=model))
    assert planned.error is None and whole.error is None, (planned.error, whole.error)
    flops = lambda p: {ph.name: ph.flops for ph in p.phases if ph.name != "rollout"}  # the decode: probed, not run
    assert flops(planned) == pytest.approx(flops(whole), rel=1e-3) and set(flops(whole)) == {"score", "update"}


@pytest.mark.integration  # two plans each (about 20 s)
@pytest.mark.parametrize("recipe,knob,off,on", [("recipes/rl/d_opsd.yaml", "passk", 1, 4),
                                                ("recipes/rl/mdpo.yaml", "icfw", "false", "true")])
def test_a_methods_other_decodes_are_planned_through_the_service(recipe, knob, off, on):
    """d-OPSD's pass@k retries and MDPO's ICFW curation decode through ``ctx.services.generate``; the planner serves
    it as it serves the group rollout (first steps probed, full-length completions handed back) and adds their rows'
    share of the decode's FLOPs, saying so. Planned rewards alternate 0 / 1 within a group: pass@4 retries half the
    rows, then a quarter, then an eighth."""
    over = ["train.batch_size=4", "algorithm.inner_iterations=1"] + (
        [] if "mdpo" in recipe else ["algorithm.correct_reward=1.0"])
    base = plan_recipe(_load(recipe, over + [f"algorithm.{knob}={off}"]), PlanOptions(gpus=2))
    more = plan_recipe(_load(recipe, over + [f"algorithm.{knob}={on}"]), PlanOptions(gpus=2))
    assert base.error is None and more.error is None, (base.error, more.error)
    rollout = lambda p: next(ph.flops for ph in p.phases if ph.name == "rollout")
    said = [a for a in more.assumptions if a.startswith("rollout: the method's other decodes")]
    assert len(said) == 1 and not any("other decodes" in a for a in base.assumptions)
    import re
    extra, handed = map(int, re.search(r"counted as (\d+) rows beside the group rollout's (\d+);", said[0]).groups())
    assert rollout(more) == pytest.approx(rollout(base) * (1 + extra / handed), rel=1e-9)
    if knob == "passk":
        assert extra == handed // 2 + handed // 4 + handed // 8
    else:  # every prompt of the step's share decoded once
        assert extra == handed // _load(recipe).rollout.group_size


def test_verdict_names_the_phase_and_the_knobs():
    from dare.plan.report import table, verdict
    r = _load("recipes/d1_tiny.yaml")
    plan = plan_recipe(r, PlanOptions(gpus=2, gpu_memory=12 * 2**20, reserved_bytes=0, margin=0.0))
    assert not plan.fits
    text = verdict(plan, r)
    assert "does not fit: update" in text and "train.micro_batch_size" in text
    assert "update" in table(plan, r)


def test_rl_plan_of_a_canvas_sampler_plans_scoring_and_update():
    """DiffusionGemma's canvas sampler cannot pause: the decode is said to be missing, the rest is planned."""
    r = _load("recipes/diffusion_gemma/rl_tiny.yaml", ["model.dtype=bfloat16"])
    plan = plan_recipe(r, PlanOptions(gpus=2))
    assert plan.error is None, plan.error
    assert [p.name for p in plan.phases][-1] == "update" and plan.phases[-1].flops > 0
    assert any(k.startswith("rollout: the canvas sampler cannot pause") for k in plan.assumptions)


def test_rl_plan_of_a_method_that_ranks_steps_by_rollout_entropy():
    """EGSPO's sampler records entropies, which a paused probe cannot carry: the probe decodes without them and the
    planned rollout hands the update an entropy per token, so every phase is planned."""
    plan = _planned(_load("recipes/rl/egspo.yaml", ["train.batch_size=4"]), 1)
    assert plan.error is None, plan.error
    assert [p.name for p in plan.phases] == ["rollout", "score", "update"] and all(p.flops > 0 for p in plan.phases)


@pytest.mark.parametrize("family", ["llada", "llada2_moe"])
def test_tree_rollouts_are_planned_from_the_leaves_decode(family):
    """d-TreeRPO's tree pauses and resumes the sampler, which fake logits cannot finish (a block model's block never
    did: its plans stopped with an error): the planned stage probes the leaves' width and hands the loop trees of the
    real shape (levels, parents, masked tails), whose decoding FLOPs are the leaves' scaled by the tree's row-steps."""
    import math
    from dare.algorithms.dtreerpo import segments_batch
    from dare.plan.data import SimulatedRollout
    r = _load("recipes/rl/dtreerpo.yaml", ["train.batch_size=4", f"model.path=tiny:{family}"])
    trees = []
    original = SimulatedRollout.decode_tree

    def spy(self, *a, **k):
        trees.append((original(self, *a, **k), self.decode_share, a[-2], a[-1]))
        return trees[-1][0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SimulatedRollout, "decode_tree", spy)  # only watches: the plan is the one made without it
        plan = _planned(r, 1)
    assert plan.error is None, plan.error
    assert any("tree" in a for a in plan.assumptions)
    tree, share, branching, cuts = next(t for t in trees if t[0] is not None)
    assert [len(lv.completion_ids) for lv in tree.levels] == [len(tree.levels[0].completion_ids) // branching[0]
                                                              * math.prod(branching[:k + 1]) for k in range(len(branching))]
    mask_ids = set()
    for k, level in enumerate(tree.levels[:-1]):  # a paused level holds the tokens written before its cut only
        written = level.step_map >= 0
        assert (level.step_map[written] < cuts[k]).all() and (~written).any()
        mask_ids |= set(level.completion_ids[~written].tolist())
        child, up = tree.levels[k + 1], tree.parents[k + 1]  # a child extends its parent's tokens
        assert (child.completion_ids[written[up]] == level.completion_ids[up][written[up]]).all()
    assert len(mask_ids) == 1 and (tree.leaves.step_map >= 0).all() and 0 < share < 1
    rows = segments_batch(tree, torch.zeros(len(tree.leaves.completion_ids)), torch.arange(4), mask_ids.pop(), None)
    assert rows.size == sum(len(lv.completion_ids) for lv in tree.levels)


def test_left_to_right_decoding_of_a_block_model_is_probed_on_a_wider_block():
    """JustGRPO decodes a block model one token per block, which the probe cannot pause inside: it probes a block of
    4 tokens and scales its steps back; the planned rollout FLOPs are within 15 % above a real decode's (measured:
    6.55 against 6.05 GFLOP: the probe's first step also runs the wider block)."""
    from torch.utils.flop_counter import FlopCounterMode
    from dare.algorithms.justgrpo import ar_sampler
    from dare.rollout import generate
    from dare.trainer.model_setup import load_policy
    r = _load("recipes/rl/justgrpo.yaml", ["train.batch_size=4", "model.path=tiny:sdar"])
    plan = plan_recipe(r, PlanOptions(gpus=1, target="cpu"))  # prompts of 256 tokens
    assert plan.error is None, plan.error
    planned = next(p.flops for p in plan.phases if p.name == "rollout")
    model, _ = load_policy(r.model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 60, (256,), generator=g).tolist() for _ in range(4)]
    with FlopCounterMode(display=False) as counter:
        ro = generate(model, prompts, ar_sampler(r.rollout.sampler), n=r.rollout.group_size, seeds=[1, 2, 3, 4])
    assert ro.nfe == r.rollout.sampler.gen_length  # no early stop: every step the plan counts ran
    real = counter.get_total_flops()
    assert real <= planned <= 1.15 * real, (planned, real)


def test_cli_json_and_exit_codes(capsys):
    """The command's JSON and exit codes: 0 from a real process; 3 (does not fit) and 2 (bad flag) from its main()."""
    from dare.cli import main
    cmd = [sys.executable, "-m", "dare.cli", "plan", "recipes/sft_tiny.yaml", "--gpus", "1", "--json"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["fits"] and data["phases"][0]["name"] == "update" and data["peak_bytes"] > 0

    def run(*extra):
        try:
            code = main(["plan", str(ROOT / "recipes/sft_tiny.yaml"), "--gpus", "1", *extra])
        except SystemExit as e:  # an argparse error
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err
    code, out, _ = run("--gpu-memory", "1MiB", "--reserved", "0")
    assert code == 3 and "does not fit" in out
    code, _, err = run("--gpu", "tpu")
    assert code == 2 and "unknown --gpu 'tpu'" in err


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * GIB and parse_bytes("94GB") == 94 * 10**9 and parse_bytes("512 MiB") == 2**29
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("eighty")


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe,overrides", [
    ("recipes/sft_tiny.yaml", ["model.path=tiny:sdar"]),
    ("recipes/rl/coupled_grpo.yaml", []),
    # Ulysses: the two processes share the data and split each sequence (the all-to-alls allocate what the plan
    # counts; gloo's own buffers are not torch tensors on either side)
    ("recipes/sft_tiny.yaml", ["model.path=tiny:sdar", "distributed.nproc=2", "distributed.sequence_parallel=2"]),
])
def test_plan_equals_two_gloo_processes(recipe, overrides):
    """The plan of rank 0 on a fake world of 2 equals rank 0 of a real 2-process gloo run."""
    real = measure(recipe, [*tiny_random(recipe), *overrides], 2)
    assert real["error"] is None
    planned = _planned(_load(recipe, overrides), 2)
    for name, peak in _peaks(real).items():
        assert abs(_peaks(planned)[name] - peak) <= 0.03 * peak, (name, _peaks(planned), _peaks(real))


@pytest.mark.parametrize("overrides", [[], ["lora.enabled=true", "reference.mode=lora_disabled", "lora.r=4"]])
def test_repeated_scoring_forwards_are_planned_once_with_the_same_result(overrides, monkeypatch):
    """d-OPSD's teacher runs one no-grad forward per recorded state and its update one forward + backward per state:
    replayed (plan/replay.py), the plan's peaks, breakdowns and FLOPs equal the plan that runs every one of them (the
    old-policy / reference passes of LoRA's disabled adapters are told apart)."""
    import dare.plan.replay as replay
    counted = []
    original = replay.NoGradReplay._replay
    monkeypatch.setattr(replay.NoGradReplay, "_replay",
                        lambda self, seen: counted.append(self.meter.current) or original(self, seen))
    r = _load("recipes/rl/d_opsd.yaml", ["train.batch_size=4", "algorithm.inner_iterations=1", *overrides])
    once = plan_recipe(r, PlanOptions(gpus=2, target="cpu"))
    assert once.error is None, once.error
    assert {"score", "update"} <= set(counted)  # teacher forwards and student forward + backward units
    every = plan_recipe(r, PlanOptions(gpus=2, target="cpu", replay=False))
    assert _peaks(once) == _peaks(every)
    assert [p.breakdown for p in once.phases] == [p.breakdown for p in every.phases]
    assert [p.flops for p in once.phases] == [p.flops for p in every.phases]


# ESPO and EBPO: 6 Monte-Carlo samples instead of the recipes' 16 (their plans that run everything are the tier's
# costliest), with replays checked after 2 instead of CHECK_EVERY = 8: a repeated forward still runs, runs again and
# agrees, is replayed, is checked by a real run that agrees, and is replayed after it with the check twice as late,
# every step of plan/replay.py's schedule, at about half the time. Not BGPO, which keeps its 16 and the real schedule:
# at 12 (schedule of 8) its replayed update counts 0.045 % more FLOPs than the update that runs every unit
# (29,611,524,096 vs 29,598,154,752), at 6 (schedule of 2) 0.016 % fewer (14,796,718,080 vs 14,799,077,376); at 16 they
# agree. Its units' FLOPs depend on their data (how many positions each Monte-Carlo mask scores) while a unit is keyed
# by shapes, so two real runs in a row can agree by chance: a finding of plan/replay.py left open (issue 38's note).
REPLAY_FEWER_MC = {f"recipes/rl/{name}.yaml": ["algorithm.num_mc=6"] for name in ("espo", "ebpo")}
REPLAY_CHECK_EVERY = 2


@pytest.mark.integration
@pytest.mark.parametrize("recipe", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "recipes/rl").glob("*.yaml")))
def test_replayed_plans_equal_plans_that_run_everything(recipe, monkeypatch):
    """Every RL method's tiny recipe: the plan with repeated forwards and units replayed (plan/replay.py) equals, to
    the byte and the FLOP, the plan that runs every one of them."""
    import dare.plan.replay as replay
    keys, record = [], replay._KeyRecord
    if recipe in REPLAY_FEWER_MC:
        monkeypatch.setattr(replay, "_KeyRecord", lambda: keys.append(record(interval=REPLAY_CHECK_EVERY)) or keys[-1])
    r = _load(recipe, ["train.batch_size=4", *REPLAY_FEWER_MC.get(recipe, [])])
    once = plan_recipe(r, PlanOptions(gpus=2, target="cpu"))
    if recipe in REPLAY_FEWER_MC:  # a key went through the whole schedule: a check after replays agreed
        assert any(k.interval > REPLAY_CHECK_EVERY and not k.broken for k in keys)
    every = plan_recipe(r, PlanOptions(gpus=2, target="cpu", replay=False))
    assert once.error is None and every.error is None, (once.error, every.error)
    assert _peaks(once) == _peaks(every)
    assert [p.flops for p in once.phases] == [p.flops for p in every.phases]

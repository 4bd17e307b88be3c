"""Generate the paper's recipe grid: recipes/paper/<model>/<algorithm>_<task>.yaml (see docs/paper_recipes.md).

    python scripts/make_paper_recipes.py            # (re)write every recipe of the grid
    python scripts/make_paper_recipes.py --check    # exit 1 if a recipe on disk differs from the generated one

The grid is every registered RL algorithm (``uses_rollout``) whose ``supports`` holds the model's attention kind, for
LLaDA-8B-Instruct and Dream-7B-Instruct (masked diffusion) and SDAR-8B-Chat and LLaDA2.0-mini (block diffusion), times
the tasks math, code, countdown and sudoku (planning = countdown and sudoku, one recipe each, as DARE runs them:
``--task countdown`` / ``--task sudoku``, separate data, rewards and step counts). Registries decide the algorithms;
this file holds the unified settings, the per-model facts and the few per-method adjustments, each with its source.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "recipes" / "paper"
# GSM8K + MATH train, read from the bundled copies as one data mixture (``data.dataset.mix``).
MATH_MIX = [{"name": "gsm8k", "split": "train"}, {"name": "math", "split": "train"}]
CODE_DATA = "data/deepcoder/train.jsonl"  # not bundled: see docs/paper_recipes.md for the layout

# --- the unified settings of the paper's comparison (the project issue) ------------------------------------------
GROUP_SIZE = 8
MASKED_BLOCK = 32  # rollout block length of the masked-diffusion models (block models decode their own block size)
MC_SAMPLES = 16  # Monte-Carlo samples of MC-based likelihoods
BATCH_PROMPTS = 32  # prompts per optimisation step over all ranks (x 8 completions = 256): our choice
GPUS, GPU_MEM_GB = 8, 80
PLANS = ROOT / "docs" / "plan_recipes.json"  # written by scripts/plan_recipes.py (dare plan of every recipe)


@functools.lru_cache(maxsize=1)
def _plans() -> dict:
    return json.loads(PLANS.read_text()) if PLANS.exists() else {}


def run_hours(cache: dict, rel: str) -> tuple[float, int]:
    """(hours, steps) of one recipe's whole run (``cache``: docs/plan_recipes.json): its planned step's time times its
    own step count. Recipes that share a step (a paper cell's math and code recipes) may train for different numbers
    of steps; the plan stores the time and steps of the recipe it was made from."""
    plan = cache["plans"][cache["recipes"][rel]]
    steps = cache.get("steps", {}).get(rel, plan["steps"])
    return plan["seconds_per_step"] * steps / 3600, steps


def planned(rel: str) -> str:
    """The header line of a recipe's planned resources (docs/plan_recipes.json), or how to get them."""
    from dare.plan.report import gib
    cache = _plans()
    plan = cache.get("plans", {}).get(cache.get("recipes", {}).get(rel, ""))
    if plan is None or plan.get("error"):
        return (f"# Full size: {GPUS} GPUs x {GPU_MEM_GB} GB (A100/H100 80GB); not planned yet: `dare plan {rel}` prints "
                "its per-GPU peak memory and hours (docs/plan.md), `python scripts/plan_recipes.py` adds it to "
                "docs/plan_recipes.md.")
    hours, steps = run_hours(cache, rel)
    return (f"# Full size: {GPUS} GPUs x {GPU_MEM_GB} GB (A100/H100 80GB). Planned by `dare plan` (docs/plan_recipes.md): "
            f"peak {gib(plan['peak_bytes'])} GiB per GPU in {plan['peak_phase']} "
            f"({'fits' if plan['fits'] else 'does NOT fit'} the {gib(plan['budget'])} GiB budget), "
            f"~{hours:.0f} h for {steps} steps at the stated MFU; full fine-tuning under FSDP2, bf16 "
            "compute with gradient checkpointing, KL off (no reference copy).")


@dataclass(frozen=True)
class Task:
    name: str
    dataset: dict
    rows: int  # training prompts (1 epoch = ceil(rows / BATCH_PROMPTS) steps)
    rows_source: str
    gen_length: int
    steps: int
    eval_benchmarks: tuple[str, ...]
    source: str
    micro_batch: int
    reward_workers: int = 4


TASKS = {
    "math": Task("math", {"mix": MATH_MIX, "template": "reasoning", "shuffle_seed": 0}, 7473 + 7470,
                 "GSM8K train 7,473 + MATH train 7,470 (bundled copies; 4 MATH rows have no gold answer)",
                 512, 256, ("gsm8k", "math500"), "GSM8K + MATH train, max response 512, 256 diffusion steps, 1 epoch", 4),
    "code": Task("code", {"path": CODE_DATA, "template": "reasoning", "shuffle_seed": 0}, 24000,
                 "a DeepCoder-size set (about 24k problems); set train.steps = ceil(rows / 32) for yours",
                 512, 256, ("humaneval", "mbpp"),
                 "DeepCoder-style problems (not bundled), HumanEval/MBPP test sets; response 512 / 256 steps as math "
                 "(the issue fixes no code length)", 4, reward_workers=8),
    "countdown": Task("countdown", {"name": "countdown", "split": "train", "template": "reasoning", "shuffle_seed": 0},
                      20000, "Countdown train (20,000, bundled)", 256, 128, ("countdown",),
                      "planning: Countdown, max response 256, 128 diffusion steps, 1 epoch", 8),
    "sudoku": Task("sudoku", {"name": "sudoku", "split": "train", "template": "reasoning", "shuffle_seed": 0},
                   20000, "4x4 Sudoku train (20,000, bundled)", 256, 128, ("sudoku",),
                   "planning: Sudoku, max response 256, 128 diffusion steps, 1 epoch", 8),
}


@dataclass(frozen=True)
class Model:
    folder: str
    path: str
    family: str  # dare.models family (its attention kind comes from the registry)
    params_b: float
    block_size: int | None  # block models: the checkpoint's training block, which the sampler must decode with
    note: str
    # FSDP gradient reduction (distributed.grad_sync): "every" where accumulating the unsharded fp32 gradients of
    # every parameter over the micro-batches does not fit (dare plan: LLaDA2.0-mini's 16B need 59.9 GiB per GPU
    # for them, 91.1 GiB in all for d1_math; docs/plan_recipes.md)
    grad_sync: str = "last"


MODELS = [
    Model("llada_8b_instruct", "GSAI-ML/LLaDA-8B-Instruct", "llada", 8.0, None, "LLaDA-8B-Instruct (8.0B, dense)"),
    Model("dream_7b_instruct", "Dream-org/Dream-v0-Instruct-7B", "dream", 7.6, None,
          "Dream-v0-Instruct-7B (7.6B, Qwen2.5-7B init)"),
    Model("sdar_8b_chat", "JetLM/SDAR-8B-Chat", "sdar", 8.2, 4, "SDAR-8B-Chat (8.2B, Qwen3-8B init, block 4)"),
    Model("llada2_mini", "inclusionAI/LLaDA2.0-mini", "llada2_moe", 16.0, 32,
          "LLaDA2.0-mini (16B total / 1.4B active MoE, block 32)", grad_sync="every"),
]

# A method's departures from the unified settings below live in its manifest (``Algorithm.grid``, a
# ``dare.algorithms.paper.GridAdjust``), with the reason; no list here names a method.

TEMPERATURE = 1.0  # rollout sampling temperature (most methods' rollouts; d1 uses 0.9)


# --- building one recipe ------------------------------------------------------------------------------------------


def registry():
    sys.path.insert(0, str(ROOT / "src"))
    from dare.algorithms import ALGORITHMS, load_builtin_algorithms
    from dare.algorithms.matrix import family_attention
    load_builtin_algorithms()
    return ALGORITHMS, family_attention()


def grid():
    """[(model, algorithm name, task)] of the whole grid, from the registries."""
    algos, attention = registry()
    out = []
    for m in MODELS:
        kind = attention[m.family]
        names = sorted(n for n, c in algos.items() if c.uses_rollout and kind in c.supports)
        out += [(m, n, t) for n in names for t in TASKS]
    return out


def sampler(m: Model, kind: str, task: Task, adjust, temperature: float) -> dict:
    """The rollout sampler of a cell (``adjust``: the method's ``GridAdjust`` or None)."""
    block = m.block_size if kind == "block_causal" else MASKED_BLOCK
    if adjust and adjust.single_block and kind != "block_causal":
        block = task.gen_length
    out = {"gen_length": task.gen_length, "block_length": block, "steps": task.steps, "temperature": temperature,
           "remasking": "low_confidence"}
    if kind == "block_causal":
        out["cache"] = "block"  # the exact block KV cache (docs/samplers.md)
    if adjust:
        out.update(adjust.sampler)
    return out


def build(m: Model, name: str, task_name: str):
    """(recipe dict, header lines) of one cell."""
    algos, attention = registry()
    cls, kind, task = algos[name], attention[m.family], TASKS[task_name]
    from dare.algorithms.paper import own
    adjust = own(cls, "grid")  # the method's departures from the unified settings (its manifest)
    fields = {f.name: f for f in dataclasses.fields(cls.config_class)}
    algo = {"name": name}
    notes = []
    if "beta" in fields:
        algo["beta"] = 0.0
    from dare.algorithms import cost_knobs
    mc = list(cost_knobs(cls.config_class, "mc_samples"))  # the fields that hold its MC sample count
    for key in mc:
        algo[key] = MC_SAMPLES
    if "temperature" in fields:  # a method that rescales logits by the rollout temperature (MDPO)
        algo["temperature"] = TEMPERATURE
    roll = sampler(m, kind, task, adjust, TEMPERATURE)
    if adjust:
        algo.update(adjust.algorithm)
        algo.update(adjust.per_task.get(task_name, {}))
        algo.update(adjust.per_kind.get(kind, {}))
        if kind in adjust.merge_blocks_on:
            algo["shrink"] = task.steps // math.ceil(task.gen_length / roll["block_length"])
        notes.append(f"#   {name}: {adjust.why}")
    # A single 512-token block decodes all its positions in every step: its full-vocabulary logits of 4 prompts x 8
    # samples per rank took 65 GiB (dare plan, Dream MDPO), so those rollouts decode one prompt's group at a time.
    chunk = adjust.rollout_micro_batch if adjust and kind != "block_causal" and roll["block_length"] == task.gen_length else 0
    rollout_chunk = {"micro_batch_size": chunk} if chunk else {}
    if chunk:
        notes.append(f"#   rollout.micro_batch_size {chunk}: one prompt's {GROUP_SIZE} samples per generate() call; a "
                     f"{task.gen_length}-token block's logits of all {BATCH_PROMPTS // GPUS} prompts per rank do not fit "
                     "80 GB (dare plan)")
    steps = math.ceil(task.rows / BATCH_PROMPTS)
    micro = task.micro_batch // (adjust.micro_batch_divisor if adjust else 1)
    eval_sampler = sampler(m, kind, task, None, 0.0)  # every method is evaluated with the same greedy decoding
    recipe = {
        "model": {"path": m.path, "dtype": "float32", "gradient_checkpointing": True},
        "algorithm": algo,
        "data": {"dataset": dict(task.dataset)},
        "rollout": {"group_size": GROUP_SIZE, **rollout_chunk, "sampler": roll},
        "reward": {"workers": task.reward_workers},
        "optim": {"lr": 1.0e-6, "betas": [0.9, 0.99], "weight_decay": 0.0, "schedule": "constant", "warmup_steps": 10,
                  "grad_clip": 1.0},
        "train": {"mixed_precision": "bf16", "steps": steps, "batch_size": BATCH_PROMPTS, "micro_batch_size": micro,
                  "save_every": 100, "eval_every": 100, "output_dir": f"runs/paper/{m.folder}/{name}_{task_name}"},
        "eval": {"benchmarks": list(task.eval_benchmarks), "limit": 64, "template": "reasoning", "sampler": eval_sampler},
        "distributed": {"nproc": GPUS, **({"grad_sync": m.grad_sync} if m.grad_sync != "last" else {})},
    }
    header = [
        f"# Paper grid: {name} on {m.note}, task {task_name}. Generated by scripts/make_paper_recipes.py: edit the "
        "script, not this file. Guide: docs/paper_recipes.md; the method: docs/algorithms/ (its defaults fill every "
        "algorithm key not set here).",
        planned(f"recipes/paper/{m.folder}/{name}_{task_name}.yaml"),
        f"#   dare train recipes/paper/{m.folder}/{name}_{task_name}.yaml    # torchrun over distributed.nproc={GPUS}",
        f"#   CPU smoke run: model.path=tiny:{m.family} distributed.nproc=1 train.mixed_precision=none plus tiny "
        "lengths and budgets (docs/paper_recipes.md, 'Running a cell')",
        "# Settings and their sources:",
        f"#   rollout.group_size {GROUP_SIZE}; beta 0 (KL off)"
        + (f"; {'/'.join(mc)} {MC_SAMPLES} (MC samples)" if mc else "")
        + " -- the paper's unified settings (project issue).",
        f"#   rollout block_length {roll['block_length']}: " + (
            "the model's own block size (a block model decodes with its training block)." if kind == "block_causal"
            else ("gen_length, one block (see the method note below)." if roll["block_length"] == task.gen_length
                  else "the unified block length.")),
        f"#   task: {task.source} -- unified. train.steps {steps} = 1 epoch of {task.rows} prompts ({task.rows_source}).",
        f"#   train.batch_size {BATCH_PROMPTS} prompts x {GROUP_SIZE} completions per step, lr 1e-6 constant (10 warmup "
        "steps), AdamW betas (0.9, 0.99), grad clip 1.0, rollout temperature 1.0 with low_confidence remasking, d1's "
        "reasoning prompt template, eval every 100 steps on 64 examples per benchmark with greedy decoding (final "
        "scores: dare eval on the full test sets) -- our choices, the issue does not fix them.",
        *notes,
        *([f"#   distributed.grad_sync {m.grad_sync}: reduce-scatter after every micro-batch; accumulating the unsharded "
           f"fp32 gradients of all {m.params_b:.0f}B parameters does not fit 80 GB (dare plan)."] if m.grad_sync != "last" else []),
    ]
    return recipe, header


# --- YAML text ------------------------------------------------------------------------------------------------------


def _scalar(v) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=1000).strip().removesuffix("...").strip()


def _emit(d: dict, indent: int) -> list[str]:
    pad = "  " * indent
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += [f"{pad}{k}:", *_emit(v, indent + 1)]
        else:
            out.append(f"{pad}{k}: {_scalar(v)}")
    return out


def to_yaml(recipe: dict, header: list[str]) -> str:
    lines = []
    for h in header:  # comment lines wrapped at 118 characters
        lines += textwrap.wrap(h, 118, subsequent_indent="#     ", break_on_hyphens=False) or ["#"]
    return "\n".join(lines + _emit(recipe, 0)) + "\n"


def grid_table() -> str:
    """docs/paper_recipes.md's table of the grid, per model folder (``python scripts/generate.py`` writes it)."""
    _, attention = registry()
    cells = grid()
    lines = [f"`recipes/paper/<model>/<algorithm>_<task>.yaml`, {len(cells)} files:", "",
             "| model folder | checkpoint | attention | algorithms (registry: RL methods whose `supports` holds the kind) "
             "| recipes |", "|---|---|---|---|---|"]
    above = None
    for m in MODELS:
        names = sorted({n for mm, n, _ in cells if mm is m})
        listed = f"the same {len(names)}" if names == above else ", ".join(names)
        block = f" (block {m.block_size})" if m.block_size else ""
        lines.append(f"| `{m.folder}` | `{m.path}`{block} | {attention[m.family].replace('_', '-')} | {listed} | "
                     f"{sum(1 for mm, _, _ in cells if mm is m)} |")
        above = names
    return "\n".join(lines)


def render_all() -> dict[Path, str]:
    return {OUT / m.folder / f"{name}_{task}.yaml": to_yaml(*build(m, name, task)) for m, name, task in grid()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if any recipe on disk is stale or missing")
    args = ap.parse_args(argv)
    files = render_all()
    if args.check:
        on_disk = set(OUT.rglob("*.yaml"))
        stale = sorted(str(p.relative_to(ROOT)) for p, text in files.items()
                       if not p.is_file() or p.read_text(encoding="utf-8") != text)
        extra = sorted(str(p.relative_to(ROOT)) for p in on_disk - set(files))
        for p in stale:
            print(f"stale or missing: {p}")
        for p in extra:
            print(f"not generated: {p}")
        return 1 if stale or extra else 0
    for p, text in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} recipes under {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

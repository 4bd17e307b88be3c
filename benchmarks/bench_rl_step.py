"""Where an RL step's time goes, ours against a naive pipeline (issue 13, P4): rollout, reward, old / reference
scoring, update.

Both pipelines run the same recipe, seed and prompts through the real ``Trainer``; the step metrics split every step
into ``rollout_time`` (decoding), ``reward_time`` (the verifier), ``prepare_time`` (corruption + pre-update and
reference scoring) and ``update_time`` (forward + backward + optimizer, every inner iteration). The naive pipeline is
what a straightforward implementation does: the rollout re-encodes the whole sequence at every step (no KV cache)
and computes full-vocabulary logits at every position, and the scoring and update build the full ``[B, L, V]``
logits and take a log-softmax over them instead of scoring only the target rows in chunks. Two setups:

- ``quickstart``: ``recipes/quickstart/rl.yaml`` as `dare quickstart` runs it (the shipped 0.8M-parameter LLaDA,
  character vocabulary of 128, gen 40 in one block, 20 steps, no cache, Coupled-GRPO mu 1, 8 prompts x 8 samples);
- ``mid``: the same task and tokenizer with a randomly initialised LLaDA of hidden 256, 4 layers, MLP 768, a
  vocabulary padded to 8192 (the size of the head is what full-vocabulary logits cost; ids the tokenizer does not
  know decode to nothing, so the reward stays well defined), gen 64 in blocks of 32, dual cache + threshold 0.9 for ours,
  Coupled-GRPO mu 2 (so the pre-update policy is scored), 4 prompts x 8 samples.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rl_step.py            # both setups, markdown table
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_rl_step.py --quick    # smoke run (a slow test runs it)
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts its thread pool (see benchmarks/rollout.md)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from dare.trainer.recipe import load_recipe  # noqa: E402
from dare.diffusion import logprob  # noqa: E402
from dare.models import LogitsRequest, load_tokenizer, tiny  # noqa: E402
from dare.models.model import DiffusionLM  # noqa: E402
from dare.models.modules import take_rows  # noqa: E402
from dare.trainer.loop import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART_MODEL = ROOT / "src/dare/assets/quickstart/lazy-sudoku-llada-sft"
PHASES = ("rollout_time", "reward_time", "prepare_time", "update_time")
PHASE_NAMES = {"rollout_time": "rollout", "reward_time": "reward", "prepare_time": "old / ref scoring",
               "update_time": "update"}


def naive_score_targets(model, input_ids, targets, labels, *, attention_mask=None, position_ids=None, layout=None,
                        chunk_size=None, temperature=1.0, with_entropy=False):
    """``score_targets`` the straightforward way: full ``[B, L, V]`` logits, a log-softmax over all of them, gather."""
    logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids, layout=layout).logits.float()
    logits = logprob._capped(logits, model.adapter.logit_softcap)
    logp_all = F.log_softmax(logits / temperature, dim=-1)
    b, col = targets.nonzero(as_tuple=True)
    rows = model.adapter.prediction_rows(col)
    picked = logp_all[b, rows]
    logp = picked.gather(-1, labels[b, col].long()[:, None])[:, 0]
    dense = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device).index_put((b, col), logp)
    dense_ent = None
    if with_entropy:
        ent = -(picked.exp() * picked).sum(-1).detach()
        dense_ent = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device).index_put((b, col), ent)
    return dense, dense_ent


def score_targets_holders() -> list:
    """Every loaded dare module that holds ``score_targets`` by name (the algorithms import it that way), found at
    swap time so that a module added later is swapped too."""
    return [m for name, m in list(sys.modules.items())
            if name.startswith("dare.") and getattr(m, "score_targets", None) is logprob.score_targets]


@contextlib.contextmanager
def naive_pipeline():
    """Full-vocabulary logits everywhere: every forward that asks for some rows' logits computes all of them first,
    and the scorers use ``naive_score_targets``. (The recipe turns the rollout's cache off.)"""
    real_forward = DiffusionLM.forward
    real_score_targets = logprob.score_targets

    def full_logits_forward(self, *args, request=None, **kw):
        request = request or LogitsRequest()
        out = real_forward(self, *args, request=LogitsRequest(logits=request.logits, hidden=request.hidden), **kw)
        if out.logits is not None:
            if request.rows is not None:
                out.logits = take_rows(out.logits, request.rows)
            if request.keep is not None:  # the masked positions, packed, as the sampler asked
                out.logits = out.logits[request.keep]
        return out

    modules = score_targets_holders()
    DiffusionLM.forward = full_logits_forward
    for m in modules:
        m.score_targets = naive_score_targets
    try:
        yield
    finally:
        DiffusionLM.forward = real_forward
        for m in modules:
            m.score_targets = real_score_targets


def mid_checkpoint(folder: Path, quick: bool = False) -> Path:
    """A random LLaDA (hidden 256, 4 layers, MLP 768; for --quick's smoke run hidden 128, 2 layers, MLP 384) with the
    quickstart tokenizer and a vocabulary of 8192."""
    tok = load_tokenizer(QUICKSTART_MODEL)
    hidden, layers = (128, 2) if quick else (256, 4)
    model = tiny("llada", tokenizer=tok, seed=0, std=0.05, hidden_size=hidden, num_layers=layers, num_heads=4,
                 intermediate_size=3 * hidden, vocab_size=8192)
    model.save_pretrained(folder, tokenizer=tok)
    return folder


def setups(tmp: Path, quick: bool) -> dict:
    common = ["logging.progress=false", "logging.tensorboard=false", "logging.plot=false", "train.export=false",
              "train.save_every=0", "train.eval_every=0"]
    quickstart = [f"model.path={QUICKSTART_MODEL}"] + (["train.batch_size=2", "rollout.group_size=4"] if quick else [])
    mid_model = mid_checkpoint(tmp / "mid-model", quick)
    gen, block = (32, 16) if quick else (64, 32)
    mid = [f"model.path={mid_model}", "algorithm.inner_iterations=2", f"rollout.group_size={4 if quick else 8}",
           f"train.batch_size={2 if quick else 4}", "train.micro_batch_size=32",
           f"rollout.sampler={{gen_length: {gen}, block_length: {block}, steps: {gen}, temperature: 1.0, "
           f"threshold: 0.9, cache: dual}}"]
    return {"quickstart": common + quickstart, "mid": common + mid}


def run_variant(overrides: list[str], naive: bool, steps: int, out: Path) -> list[dict]:
    extra = ["rollout.sampler.cache=none"] if naive else []
    recipe = load_recipe(ROOT / "recipes/quickstart/rl.yaml",
                         overrides + extra + [f"train.steps={steps}", f"train.output_dir={out}"])
    trainer = Trainer(recipe)
    with naive_pipeline() if naive else contextlib.nullcontext():
        return trainer.run()


def measure(name: str, overrides: list[str], steps: int, repeats: int, tmp: Path) -> dict:
    """Interleaved repetitions of both pipelines (who goes first alternates); per phase, the median over repetitions
    of the mean over the steps after the first (the first also starts the reward workers and warms the allocator; a
    one-step smoke run times that step)."""
    runs = {"ours": [], "naive": []}
    for rep in range(repeats):
        order = ("ours", "naive") if rep % 2 == 0 else ("naive", "ours")
        for variant in order:
            print(f"  {name}: {variant}, repetition {rep + 1}", file=sys.stderr, flush=True)
            hist = run_variant(overrides, variant == "naive", steps, tmp / f"{name}-{variant}-{rep}")
            runs[variant].append(hist)
    result = {"steps": steps, "repeats": repeats}
    for variant, hists in runs.items():
        timed = [hist[1:] or hist for hist in hists]
        phases = {p: statistics.median(statistics.mean(h[p] for h in hist) for hist in timed)
                  for p in PHASES + ("step_time",)}
        phases["nfe"] = statistics.mean(h["nfe"] for h in timed[0])
        phases["reward_mean"] = [round(h["reward_mean"], 4) for h in hists[0]]
        phases["loss"] = [h.get("loss") for h in hists[0]]
        result[variant] = phases
    return result


def print_table(name: str, r: dict) -> None:
    ours, naive = r["ours"], r["naive"]
    timed = f"steps 2-{r['steps']}" if r["steps"] > 1 else "its one step, allocator and reward workers cold"
    print(f"\n#### {name}: mean seconds per step ({timed}, median of {r['repeats']} interleaved repetitions)\n")
    print("| phase | naive s | ours s | naive / ours | ours: share of the step |")
    print("|---|---:|---:|---:|---:|")
    for p in PHASES + ("step_time",):
        label = PHASE_NAMES.get(p, "**whole step**")
        share = f"{100 * ours[p] / ours['step_time']:.0f}%" if p != "step_time" else "100%"
        print(f"| {label} | {naive[p]:.2f} | {ours[p]:.2f} | {naive[p] / max(ours[p], 1e-9):.2f}x | {share} |")
    print(f"\nForwards per rollout: naive {naive['nfe']:.0f}, ours {ours['nfe']:.0f}. Training reward per step: naive "
          f"{naive['reward_mean']}, ours {ours['reward_mean']}; loss per step: naive "
          f"{[round(v, 6) for v in naive['loss']]}, ours {[round(v, 6) for v in ours['loss']]}.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="smaller groups, generations and mid model, one step, one repetition (a smoke run)")
    ap.add_argument("--setups", default="quickstart,mid")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="also write the raw numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    steps, repeats = (1, 1) if args.quick else (args.steps, args.repeats)
    results = {}
    with tempfile.TemporaryDirectory(prefix="dare-bench-rl-") as tmp:
        configs = setups(Path(tmp), args.quick)
        for name in args.setups.split(","):
            results[name] = measure(name, configs[name], steps, repeats, Path(tmp))
    print(f"\n### RL step: ours vs a naive pipeline (torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"load average at the end {os.getloadavg()[0]:.1f})")
    for name, r in results.items():
        print_table(name, r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

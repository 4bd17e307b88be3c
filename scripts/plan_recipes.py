"""Plan every full-size training recipe with `dare plan` and write the tables of docs/plan_recipes.md.

    python scripts/plan_recipes.py                  # every full-size recipe not planned, stale or without a record
    python scripts/plan_recipes.py --workers 2      # in parallel processes (9 steps, recorded, took 29 minutes on 2
                                                    # cores: DiffusionGemma-26B SFT 20, the others about 5 each);
                                                    # a worker may hold ~14 GiB (an SDAR-8B RL cell: 13.8 GiB), so
                                                    # give each 16 GiB of RAM (two swapped on a 24 GiB machine)
    python scripts/plan_recipes.py --only 'recipes/sft_*' 'recipes/paper/*/d1_math.yaml'   # a subset (the
                                                    # table lists every recipe planned so far)

Recipes whose planned step is the same (they differ only in data, evaluation, logging or step count: e.g. a paper
cell's math and code recipes) share one plan. Results are cached in docs/plan_recipes.json with what each plan
depended on (dare/plan/provenance.py: the recipe's shape key, the functions that ran, the files read, torch's
version), so a rerun re-plans only what is missing, stale (a recipe edited, or code or a config it ran changed since)
or stored without its record (--force re-plans everything). tests/plan/test_published_plans.py fails on a stale plan
and names this command. The tables alone are re-rendered from that file, without planning, by
`python scripts/generate.py` (``rendered()`` below), with every other generated artifact.
"""
from __future__ import annotations

import argparse
import fnmatch
import glob
import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT_MD = ROOT / "docs" / "plan_recipes.md"
OUT_JSON = ROOT / "docs" / "plan_recipes.json"
PAPER_MD = ROOT / "docs" / "paper_recipes.md"
SECTION = "## Expected resources (full size)"
# Sections that do not change a planned step's memory or FLOPs per step.
IGNORED = ("data", "eval", "logging", "reward")
IGNORED_TRAIN = ("steps", "output_dir", "save_every", "eval_every", "log_every", "keep_checkpoints", "resume", "export")


def full_size_recipes() -> list[str]:
    from dare.trainer.recipe import load_recipe
    out = []
    for path in sorted(glob.glob(str(ROOT / "recipes" / "**" / "*.yaml"), recursive=True)):
        rel = str(Path(path).relative_to(ROOT))
        try:
            r = load_recipe(path)
        except Exception:  # eval recipes and others that are no training recipe
            continue
        if r.model.path.startswith("tiny:") or (ROOT / r.model.path).exists():  # a tiny model or a shipped checkpoint
            continue
        out.append(rel)
    return out


def shape_key(recipe) -> str:
    from dare.config.core import to_dict
    d = to_dict(recipe)
    for k in IGNORED:
        d.pop(k, None)
    for k in IGNORED_TRAIN:
        d["train"].pop(k, None)
    for k in ("rdzv_endpoint", "rdzv_id"):  # where the nodes meet, not what they run
        d["distributed"].pop(k, None)
    # What the rollout records is the method's request (``Algorithm.record``), no longer a sampler setting of the
    # recipe: it shapes the step as it did, under the sampler keys the plans were keyed with.
    if isinstance(d.get("rollout"), dict) and isinstance(d["rollout"].get("sampler"), dict):
        from dare.algorithms import build_algorithm
        record = build_algorithm(recipe.algorithm).record
        d["rollout"]["sampler"]["record_trajectory"] = record.trajectory
        d["rollout"]["sampler"]["record_entropy"] = record.entropy
    # Settings added after the cached plans were keyed, left out at their defaults (so adding a setting does not
    # unplan every recipe): the node layout, SFT's editing stream, Fast-dLLM v2 noise and Nemotron's block_diff, the sampler's any-order and
    # entropy records, its sub-blocks and speculative decoding.
    for path, default in ((("distributed", "nnodes"), 1), (("distributed", "sharding"), "full"),
                          (("distributed", "sequence_parallel"), 1), (("algorithm", "edit_ratio"), 0.0),
                          (("algorithm", "edit_weight"), 1.0), (("algorithm", "keep_weight"), 0.0),
                          (("algorithm", "t_per_block"), False), (("algorithm", "complementary"), False),
                          (("algorithm", "block_diff"), None), (("algorithm", "ar_loss_weight"), 1.0),
                          (("rollout", "sampler", "speculative"), False),
                          (("rollout", "sampler", "any_order"), False),
                          (("rollout", "sampler", "record_entropy"), False),
                          (("rollout", "sampler", "sub_block_length"), None)):
        section = d
        for k in path[:-1]:
            section = section.get(k) if isinstance(section, dict) else None
        if isinstance(section, dict) and section.get(path[-1], default) == default:
            section.pop(path[-1], None)
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def plan_one(rel: str) -> tuple[dict, dict]:
    """(the plan, what it depended on): run in a fresh process, so no cache warmed by another plan hides a
    function this one relies on from the recording."""
    import torch

    from dare.plan.provenance import recording
    torch.set_num_threads(1)
    with recording() as record:  # from the recipe's loading on: its defaults and checks are code the plan ran
        from dare.trainer.recipe import load_recipe
        from dare.plan.planner import PlanOptions, plan_recipe
        plan = plan_recipe(load_recipe(ROOT / rel), PlanOptions(), rel)
    return plan.to_dict(), record


NO_RECORD = "no record"  # counts as a change of dare's own (provenance.is_own)


def stale_plans(cache: dict) -> dict[str, dict[str, str]]:
    """Shape key -> {what changed since the plan was made: one line}, for every stored plan that is not current (dare's
    own code and files, torch's version, other packages' code); a plan stored without its record counts as stale."""
    from dare.plan.provenance import Fingerprinter, load
    fp, out = Fingerprinter(), {}
    for key, plan in cache["plans"].items():
        if "depends" not in plan or "provenance" not in cache:
            out[key] = {NO_RECORD: "stored before plans recorded what they depend on"}
            continue
        changed = fp.changed(load(cache["provenance"], plan["depends"]))
        if changed:
            out[key] = changed
    return out


def _records(cache: dict) -> dict:
    """Shape key -> record of every stored plan that has one."""
    from dare.plan.provenance import load
    return {k: load(cache["provenance"], p["depends"]) for k, p in cache["plans"].items() if "depends" in p}


def save(cache: dict, mine: dict, records: dict, keep=None) -> None:
    """Write the cache with this run's plans (``mine``, their ``records``) merged into what is on disk (another run
    may be planning other recipes into the same file); with ``keep``, only the plans of those shape keys."""
    from dare.plan.provenance import Fingerprinter, narrow, store
    every = _records(cache)
    if OUT_JSON.exists():
        disk = json.loads(OUT_JSON.read_text())
        if "provenance" in disk:
            every.update(_records(disk))
        cache["plans"] = {**cache["plans"], **disk.get("plans", {})}  # what is on disk is newer than the plans this
        # run read at its start (another run may have re-planned one of them since)
    cache["plans"].update(mine)
    every.update(records)
    if keep is not None:
        cache["plans"] = {k: v for k, v in cache["plans"].items() if k in keep}
    fp = Fingerprinter()  # records stored with the whole skeleton of modules they only imported are narrowed (exact)
    every = {k: narrow(record, fp) for k, record in every.items()}
    for plan in cache["plans"].values():
        plan.pop("depends", None)
    cache["provenance"], ranges = store({k: every[k] for k in cache["plans"] if k in every})
    for k, r in ranges.items():
        cache["plans"][k]["depends"] = r
    tmp = OUT_JSON.with_suffix(".json.tmp")  # written beside and swapped: a reader never sees half a file
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(OUT_JSON)


def gib(n) -> str:
    return f"{n / 2**30:.1f}"


def render(rows: list[tuple[str, dict, float]]) -> str:
    lines = ["| recipe | model | GPUs | peak GiB / GPU | set by | rollout / score / update GiB | FLOPs / step / GPU | "
             "h / run at the stated MFU | fits 80 GB |", "|---|---|---:|---:|---|---|---:|---:|---|"]
    for rel, p, hours in rows:
        phases = {ph["name"]: ph for ph in p["phases"]}
        per = " / ".join(gib(phases[n]["peak_bytes"]) if n in phases else "-" for n in ("rollout", "score", "update"))
        if p["error"]:
            lines.append(f"| `{rel}` | {p['model']} | {p['world']} | - | - | - | - | - | not planned: {p['error'][:120]} |")
            continue
        lines.append(f"| `{rel}` | {p['model']} | {p['world']} | {gib(p['peak_bytes'])} | {p['peak_phase']} | {per} | "
                     f"{p['flops_per_step'] / 1e15:.2f} PFLOP | {hours:.1f} | {'yes' if p['fits'] else '**no**'} |")
    return "\n".join(lines)


def paper_section(recipes: list[str], keys: dict, plans: dict, hours_of) -> str:
    """docs/paper_recipes.md's resources section: the planned numbers of the grid, per model folder."""
    lines = [SECTION, "",
             "Planned by `dare plan` (regenerate: `python scripts/plan_recipes.py`; every recipe's row: "
             "[plan_recipes.md](plan_recipes.md); how: [plan.md](plan.md)), for 8 x H100 80GB with a budget of 70 GiB "
             "per GPU. Full fine-tuning keeps fp32 weights, gradients and AdamW states sharded by FSDP2 and computes in "
             "bf16 with gradient checkpointing; KL is off, so no reference copy is held. Each recipe's header carries "
             "its own planned peak.", "",
             "| model folder | recipes planned | peak GiB per GPU (lowest - highest) | highest: recipe (phase) | "
             "all planned fit | hours per run (lowest - highest) |", "|---|---:|---:|---|---|---:|"]
    folders: dict[str, list[str]] = {}
    for rel in recipes:
        if rel.startswith("recipes/paper/"):
            folders.setdefault(rel.split("/")[2], []).append(rel)
    for folder, rels in folders.items():
        got = [(rel, plans[keys[rel]]) for rel in rels if keys[rel] in plans and not plans[keys[rel]]["error"]]
        if not got:
            lines.append(f"| `{folder}` | 0 / {len(rels)} | - | - | - | - |")
            continue
        peaks = [p["peak_bytes"] for _, p in got]
        top_rel, top = max(got, key=lambda rp: rp[1]["peak_bytes"])
        hours = [hours_of(rel) for rel, _ in got]
        lines.append(f"| `{folder}` | {len(got)} / {len(rels)} | {gib(min(peaks))} - {gib(max(peaks))} | "
                     f"`{Path(top_rel).name}` ({top['peak_phase']}) | {'yes' if all(p['fits'] for _, p in got) else '**no**'} | "
                     f"{min(hours):.0f} - {max(hours):.0f} |")
    missing = [rel for rels in folders.values() for rel in rels if keys[rel] not in plans]
    if missing:
        lines += ["", f"Not planned yet ({len(missing)}): run `python scripts/plan_recipes.py` (one to a few "
                      "CPU minutes per planned step; it resumes where it stopped)."]
    return "\n".join(lines) + "\n"


def with_paper_section(doc: str, text: str) -> str:
    """docs/paper_recipes.md's text ``doc`` with its resources section (up to the next heading) replaced by ``text``."""
    start = doc.index(SECTION)
    end = doc.index("\n## ", start + len(SECTION))
    return doc[:start] + text + doc[end:]


def rendered(cache: dict) -> dict[Path, str]:
    """The two documents made from the stored plans (``cache``: docs/plan_recipes.json), without planning anything:
    docs/plan_recipes.md in full and docs/paper_recipes.md with its resources section replaced. The recipe list and
    each recipe's shape key are the ones stored with the plans (``cache["recipes"]``), so this reads no recipe; the
    recipes' own headers are rendered by make_paper_recipes.py from the same file. scripts/generate.py calls this."""
    from make_paper_recipes import run_hours  # scripts/ is on the path (main, scripts/generate.py)
    keys = cache.get("recipes", {})
    recipes = sorted(keys)  # full_size_recipes() order: sorted paths
    plans = cache.get("plans", {})
    rows = [(rel, plans[keys[rel]], run_hours(cache, rel)[0]) for rel in recipes if keys[rel] in plans]
    head = ("# Planned resources of every full-size recipe\n\n"
            "Generated by `python scripts/plan_recipes.py` with `dare plan`'s defaults: 8 x H100 80GB (or the recipe's "
            "`distributed.nproc`), a budget of 80 GiB - 10 % - 2 GiB = 70 GiB per GPU, prompts of 256 tokens, time at "
            "40 % of the dense bf16 peak for scoring and updates and 10 % for decoding (docs/plan.md says what is and "
            "is not modelled). Peak is rank 0's, per phase, of one steady-state step.\n\n")
    paper = paper_section(recipes, keys, plans, lambda rel: run_hours(cache, rel)[0])
    return {OUT_MD: head + render(rows) + "\n", PAPER_MD: with_paper_section(PAPER_MD.read_text(), paper)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None, help="globs of recipe paths to (re)plan")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--first", nargs="*", default=(), help="globs of recipe paths whose plans start first (the longest: "
                    "a d-OPSD paper plan takes ~17 min where most take 1-3, so starting them first ends a parallel "
                    "re-plan soonest)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))
    sys.path.insert(0, str(ROOT / "scripts"))
    from dare.trainer.recipe import load_recipe
    cache = json.loads(OUT_JSON.read_text()) if OUT_JSON.exists() else {"plans": {}, "recipes": {}}
    recipes = full_size_recipes()
    keys = {rel: shape_key(load_recipe(ROOT / rel)) for rel in recipes}
    wanted = [rel for rel in recipes if args.only is None or any(fnmatch.fnmatch(rel, g) for g in args.only)]
    stale = stale_plans(cache)
    todo: dict[str, str] = {}
    for rel in wanted:
        stored = cache["plans"].get(keys[rel])
        # a plan that stopped with an error is planned again, and one whose code or config changed since
        if args.force or stored is None or stored["error"] or keys[rel] in stale:
            todo.setdefault(keys[rel], rel)
    first = {k: r for k, r in todo.items() if any(fnmatch.fnmatch(r, g) for g in args.first)}
    todo = {**first, **todo}
    print(f"{len(recipes)} full-size recipes, {len(set(keys.values()))} distinct steps, {len(todo)} to plan "
          f"({sum(k in stale for k in todo)} of them stale)", flush=True)
    cache["recipes"] = {rel: keys[rel] for rel in recipes}  # saved with every plan: the tables rendered meanwhile
    # (scripts/generate.py) list the recipes at their current settings, also when this run is stopped halfway
    cache["steps"] = {rel: load_recipe(ROOT / rel).train.steps for rel in recipes}  # each recipe's own run length
    mine, records = {}, {}
    # Each plan in a fresh process (spawned, one task each): see plan_one. Saved as each one finishes, so a run stopped
    # halfway keeps every plan it finished (a long re-plan can go on in another run: it plans only what is left).
    import multiprocessing
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        futures = {pool.submit(plan_one, rel): key for key, rel in todo.items()}
        try:
            for future in as_completed(futures):
                key = futures[future]
                try:
                    result, record = future.result()
                except Exception as err:  # one plan's crash (its process died) is reported; the others go on
                    print(f"  {todo[key]}: FAILED TO PLAN ({type(err).__name__}: {err})", flush=True)
                    continue
                mine[key], records[key] = result, record
                print(f"  {todo[key]}: {gib(result['peak_bytes'])} GiB ({result['peak_phase']}), "
                      f"{'fits' if result['fits'] else 'DOES NOT FIT' if not result['error'] else result['error']}",
                      flush=True)
                save(cache, mine, records)
        except BaseException:  # Ctrl-C: the plans not started are dropped (the finished ones are saved)
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    save(cache, mine, records, keep=set(keys.values()))  # plans of steps no recipe has any more (a recipe was edited) go
    for path, text in rendered(json.loads(OUT_JSON.read_text())).items():
        path.write_text(text)
    import make_paper_recipes  # the recipes' headers carry their planned peak
    make_paper_recipes.main([])
    plans = cache["plans"]
    bad = [rel for rel in recipes if keys[rel] in plans and not plans[keys[rel]]["fits"]]
    print(f"wrote {OUT_MD.relative_to(ROOT)}: {sum(keys[rel] in plans for rel in recipes)} recipes, {len(bad)} not "
          "fitting or not planned")
    return 0


if __name__ == "__main__":
    sys.exit(main())

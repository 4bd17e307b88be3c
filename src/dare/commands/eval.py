"""``dare eval [RECIPE] --model PATH --benchmarks gsm8k,sudoku --limit N``: evaluate models, write a results table.

Flags override the recipe, which overrides the defaults (``dare.eval.config.EvalConfig``); ``--set key=value``
reaches any field (``--set sampler.cache=dual``). Several ``--model`` give one table row each (Table 2 shape).
Per-sample JSONL, results.json and results.md land in ``--output-dir`` (one folder per model plus the combined
table); an interrupted run resumes where it stopped.
"""
from __future__ import annotations

import logging
from pathlib import Path

NAME = "eval"
HELP = "evaluate models on built-in benchmarks (and lm-eval tasks); resumable, writes JSONL + results table"
log = logging.getLogger(__name__)

# flag -> (dotted config key, type)
SAMPLER_FLAGS = {
    "gen_length": int, "block_length": int, "steps": int, "steps_per_block": int, "temperature": float,
    "top_p": float, "top_k": int, "remasking": str, "cache": str, "threshold": float, "alg_temp": float,
}
RUN_FLAGS = {
    "limit": int, "batch_size": int, "seed": int, "n_samples": int, "template": str, "system_prompt": str,
    "chat_template": str, "generation_prefix": str, "max_prompt_tokens": int, "on_bad_row": str,
    "reward_timeout": float, "reward_workers": int, "output_dir": str, "dtype": str, "device": str,
    "mask_token_id": int, "tokenizer": str, "tiny_seed": int,
}


def add_arguments(p):
    p.add_argument("recipe", nargs="?", help="an eval recipe YAML (recipes/eval/*.yaml)")
    p.add_argument("--model", action="append", default=None, metavar="SPEC",
                   help="checkpoint folder, hub id or tiny:<family>; repeat or comma-separate for several")
    p.add_argument("--benchmarks", default=None, help="comma-separated built-in benchmarks, or 'all' "
                   "(gsm8k, math500, humaneval, mbpp, countdown, sudoku, aime24, aime25)")
    for name, tp in {**RUN_FLAGS, **SAMPLER_FLAGS}.items():
        p.add_argument("--" + name.replace("_", "-"), type=tp, default=None, dest=name)
    p.add_argument("--no-resume", action="store_true", help="start over instead of resuming from the JSONL files")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--lm-eval-tasks", default=None, help="comma-separated lm-evaluation-harness tasks (needs dare[eval])")
    p.add_argument("--lm-eval-include-path", default=None, help="folder of extra lm-eval task YAMLs")
    p.add_argument("--mc-num", type=int, default=None, help="ELBO Monte-Carlo samples for lm-eval loglikelihood")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any config field (dotted)")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="evaluate once per value (any config field, e.g. sampler.threshold=0.5,0.7,0.9,1.0; a bare "
                        "sampler field name works too; repeat for a grid) and write the accuracy-vs-TPF frontier "
                        "(frontier.md, frontier.png) to --output-dir")


def build_config(args, last: tuple = ()):
    """The run's ``EvalConfig``; ``last`` are overrides applied after the recipe and every flag (a sweep's setting)."""
    from dare.config import apply_overrides, from_dict, load_yaml
    from dare.eval.config import EvalConfig

    data = load_yaml(args.recipe) if args.recipe else {}
    data = apply_overrides(data, args.set)
    if args.model:
        data["models"] = [m.strip() for spec in args.model for m in spec.split(",") if m.strip()]
    if args.benchmarks is not None:
        data["benchmarks"] = [b.strip() for b in args.benchmarks.split(",") if b.strip()]
    for name in RUN_FLAGS:
        if getattr(args, name) is not None:
            data[name] = getattr(args, name)
    sampler = dict(data.get("sampler") or {})
    for name in SAMPLER_FLAGS:
        if getattr(args, name) is not None:
            sampler[name] = getattr(args, name)
    if sampler.get("gen_length") is not None and "steps" not in sampler and "steps_per_block" not in sampler:
        sampler["steps"] = sampler["gen_length"]  # one token per step unless told otherwise
    data["sampler"] = sampler
    if args.no_resume:
        data["resume"] = False
    if args.no_progress:
        data["progress"] = False
    lm = dict(data.get("lm_eval") or {})
    if args.lm_eval_tasks is not None:
        lm["tasks"] = [t.strip() for t in args.lm_eval_tasks.split(",") if t.strip()]
    if args.lm_eval_include_path is not None:
        lm["include_path"] = args.lm_eval_include_path
    if args.mc_num is not None:
        lm["mc_num"] = args.mc_num
    data["lm_eval"] = lm
    if last:
        data = apply_overrides(data, list(last))
    cfg = from_dict(EvalConfig, data)
    if not cfg.models:
        raise ValueError("no model to evaluate: give --model PATH (or tiny:<family>) or models: in the recipe")
    # what the recipe, --set, the flags or the sweep gave: a checkpoint's own decoding settings fill the rest
    cfg._given = (set(data.get("sampler") or {}), {k for k in data if k != "sampler"})
    return cfg


def with_checkpoint_decoding(cfg, spec: str, name: str):
    """``cfg`` with the decoding and prompt settings the checkpoint ``spec`` carries (its dare_decoding.json,
    dare.models.decoding) wherever the recipe, --set or a flag gave none; one log line says which."""
    import dataclasses

    from dare.models.decoding import PROMPT_KEYS, read_decoding, sampler_defaults
    from dare.rollout import SamplerConfig

    own = read_decoding(spec, {f.name for f in dataclasses.fields(SamplerConfig)})
    if own is None:
        return cfg
    block, path = own
    given_sampler, given_run = getattr(cfg, "_given", (set(), set()))
    sampler = sampler_defaults(block.get("sampler", {}), {k: getattr(cfg.sampler, k) for k in given_sampler})
    prompt = {k: block[k] for k in PROMPT_KEYS if k in block and k not in given_run}
    if not sampler and not prompt:
        return cfg
    out = dataclasses.replace(cfg, sampler=dataclasses.replace(cfg.sampler, **sampler), **prompt)
    log.info("%s: decoding and prompt settings from %s: %s (a flag, --set or the recipe overrides each)", name, path,
             ", ".join(f"{k}={v}" for k, v in {**sampler, **prompt}.items()))
    return out


def lm_eval_groups(cfg, sampler) -> list:
    """[(sampler, fixed_gen_length, [tasks])]: tasks named in ``sampler_overrides`` decode with their own settings
    (a ``gen_length`` given there is kept whatever the task's max_gen_toks says: a published per-task length)."""
    from types import SimpleNamespace

    from dare.eval.runner import sampler_for

    groups: dict = {}
    for task in cfg.lm_eval.tasks:
        own = sampler_for(SimpleNamespace(name=task), sampler, cfg.sampler_overrides)
        fixed = "gen_length" in (cfg.sampler_overrides.get(task) or {})
        groups.setdefault((repr(own), fixed), (own, fixed, []))[2].append(task)
    return list(groups.values())


def run_lm_eval(cfg, model, tokenizer, name: str) -> dict:
    """lm-eval tasks through the dare LM plugin; returns {task: summary} in the results-table format."""
    from dare.eval import register_lm_eval

    DareLM = register_lm_eval()
    import lm_eval
    from lm_eval.tasks import TaskManager

    groups = lm_eval_groups(cfg, sampler_for_model(cfg.sampler, model, cfg.model_block_length))
    tm = task_manager(TaskManager, cfg.lm_eval.include_path, [t for _, _, tasks in groups for t in tasks])
    summaries = {}
    for sampler, fixed, tasks in groups:
        lm = DareLM(model=model, tokenizer=tokenizer, sampler=sampler, mc_num=cfg.lm_eval.mc_num,
                    mc_batch_size=cfg.lm_eval.mc_batch_size, greedy_check=cfg.lm_eval.greedy_check, seed=cfg.seed,
                    batch_size=cfg.batch_size, max_length=cfg.lm_eval.max_length, fixed_gen_length=fixed)
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=cfg.lm_eval.num_fewshot, limit=cfg.limit,
                                      task_manager=tm, apply_chat_template=cfg.lm_eval.apply_chat_template,
                                      log_samples=False, bootstrap_iters=0, random_seed=cfg.seed,
                                      numpy_random_seed=cfg.seed, torch_random_seed=cfg.seed, fewshot_random_seed=cfg.seed)
        for task, metrics in (out or {}).get("results", {}).items():
            values = {k.split(",")[0]: v for k, v in metrics.items() if isinstance(v, (int, float)) and "stderr" not in k}
            key = next((m for m in ("acc_norm", "acc", "exact_match", "pass@1") if m in values), next(iter(values), None))
            summaries[task] = {"benchmark": task, "metric": key, "score": round(100.0 * values[key], 2) if key else None,
                               "lm_eval": values, "n_examples": out.get("n-samples", {}).get(task, {}).get("effective")}
            c = lm.speed.get(task)
            if c and c["samples"]:  # generative tasks: NFE per sample, TPF and tokens/s as for built-in benchmarks
                summaries[task].update(nfe_per_sample=round(c["nfe"] / c["samples"], 3),
                                       tpf=round(c["valid_tokens"] / c["nfe"], 4) if c["nfe"] else None,
                                       tokens_per_second=round(c["valid_tokens"] / c["seconds"], 2) if c["seconds"] else None)
    return summaries


def task_manager(manager_class, include_path, tasks: list):
    """lm-eval's ``TaskManager`` for ``tasks``: indexing lm-eval's own task folder takes ~15 s (thousands of YAMLs),
    so when every task is a task of ``include_path`` (a task, not a group or tag, which may name lm-eval's tasks)
    only that folder is indexed; otherwise both are."""
    if include_path:
        own = manager_class(include_path=include_path, include_defaults=False)
        if tasks and set(tasks) <= set(own.all_subtasks):
            return own
        return manager_class(include_path=include_path)
    return manager_class()


def sampler_for_model(sampler, model, enabled: bool):
    """Block-diffusion models decode with the block size they were trained with (SDAR 4, LLaDA2 32), encoder-decoder
    models with their canvas length (DiffusionGemma 256)."""
    import dataclasses

    bs = model.adapter.block_size if model.adapter.is_block_causal or model.adapter.is_encoder_decoder else None
    if not enabled or not bs or bs == sampler.block_length:
        return sampler
    if sampler.gen_length % bs:
        log.warning("gen_length=%d is not a multiple of the model's block size %d; keeping block_length=%d",
                    sampler.gen_length, bs, sampler.block_length)
        return sampler
    spb = sampler.steps_per_block
    log.info("%s: block_length %d -> the model's block size %d", model.family, sampler.block_length, bs)
    return dataclasses.replace(sampler, block_length=bs, steps_per_block=min(spb, bs) if spb else None)


def run(args) -> int:
    from dare.eval.models import model_name
    from dare.models.model_spec import resolve_device
    from dare.trainer.run_folder import RunLock

    settings = sweep_settings(args.sweep)
    cfgs = [build_config(args, s) for s in settings]  # every setting is validated before anything runs
    cfg = cfgs[0]
    out = Path(cfg.output_dir)
    names = [model_name(m) for m in cfg.models]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ValueError(f"two models would share the output folder {sorted(dupes)}; give them distinct folder names")
    resolve_device(cfg.device)
    with RunLock(out, "dare eval"):  # two evaluations appending to the same JSONL files would duplicate records
        if not args.sweep:
            _run_models(cfg, out, names)
            return 0
        from dare.eval.frontier import write_frontier

        runs = []
        for setting, c in zip(settings, cfgs):
            label = " ".join(setting)
            log.info("sweep: %s", label)
            runs.append((label, _run_models(c, out / "sweep" / _folder(label), names, quiet=True)))
        write_frontier(runs, out, ", ".join(s.split("=")[0] for s in args.sweep))
        print((out / "frontier.md").read_text())
        return 0


def sweep_settings(sweeps: list) -> list:
    """``["sampler.threshold=0.5,0.9", ...]`` -> the grid of override tuples (one empty tuple without a sweep).

    A bare sampler field name (``threshold``) means ``sampler.threshold``; values are YAML scalars (``null`` unsets)."""
    import dataclasses
    import itertools

    from dare.rollout import SamplerConfig

    sampler_fields = {f.name for f in dataclasses.fields(SamplerConfig)}
    axes = []
    for spec in sweeps:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values.strip():
            raise ValueError(f"--sweep {spec!r}: expected KEY=V1,V2,... (e.g. sampler.threshold=0.5,0.7,0.9,1.0)")
        if "." not in key and key in sampler_fields:
            key = "sampler." + key
        axes.append([f"{key}={v.strip()}" for v in values.split(",") if v.strip()])
    return [tuple(combo) for combo in itertools.product(*axes)] if axes else [()]


def _folder(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.=" else "_" for c in label.replace(" ", "__"))


def _run_models(cfg, out: Path, names: list, quiet: bool = False):
    from dare.eval import evaluate, write_results
    from dare.models.model_spec import load_model_spec, resolve_device
    from dare.rewards import close_pool

    all_results = []
    try:
        for spec, name in zip(cfg.models, names):
            mcfg = with_checkpoint_decoding(cfg, spec, name)
            model, tok = load_model_spec(spec, dtype=cfg.dtype, device=resolve_device(cfg.device),
                                         mask_token_id=cfg.mask_token_id, tokenizer=cfg.tokenizer, tiny_seed=cfg.tiny_seed)
            res = {"model": name, "benchmarks": {}}
            sampler = sampler_for_model(mcfg.sampler, model, mcfg.model_block_length)
            if mcfg.benchmarks:
                res = evaluate(model, tok, mcfg.benchmarks, sampler, output_dir=out / name, model_name=name,
                               options=mcfg.options())
            if mcfg.lm_eval.tasks:
                res["benchmarks"].update(run_lm_eval(mcfg, model, tok, name))
                write_results(res, out / name)
            res["spec"] = spec
            all_results.append(res)
            del model
    finally:
        close_pool()
    write_results(all_results, out)
    if not quiet:
        print((out / "results.md").read_text())
    log.info("wrote %s and %s", out / "results.md", out / "results.json")
    return all_results

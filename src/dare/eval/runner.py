"""``evaluate(model, tokenizer, benchmarks, sampler_config, ...) -> results``: generate, score, record.

The same function backs ``dare eval`` and periodic evaluation during training. Each example's samples
come from its own seed (run seed, benchmark, example id), so its random draws do not depend on batch size or on
which other examples were in the batch (float rounding of the batched forward does: docs/samplers.md), and a
resumed run, which decodes the same batches, reproduces an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Optional

from ..data import DataConfig, build_prompts, load_examples
from ..data.prompts import PromptBudget
from ..diffusion.noise import derive_seed
from ..rollout import SamplerConfig, generate
from .benchmarks import Benchmark, resolve_benchmarks
from .report import summarize, write_results
from .speed import rollout_speed
from .store import SampleStore

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RunOptions:
    """Everything besides the model and the sampler that shapes an evaluation (see ``evaluate``)."""
    template: str = "reasoning"
    templates: dict[str, str] = dataclasses.field(default_factory=dict)  # benchmark -> template
    system_prompt: Optional[str] = None
    chat_template: str = "auto"
    generation_prefix: Optional[str] = None
    sampler_overrides: dict[str, dict] = dataclasses.field(default_factory=dict)  # benchmark -> {sampler field: value}
    n_samples_overrides: dict[str, int] = dataclasses.field(default_factory=dict)  # benchmark -> samples per example
    limit: Optional[int] = None
    batch_size: int = 8
    n_samples: int = 1
    seed: int = 0
    max_prompt_tokens: Optional[int] = None
    on_bad_row: str = "error"
    reward_timeout: float = 10.0
    reward_workers: int = 2
    resume: bool = True
    progress: bool = True

    def __post_init__(self):
        if self.batch_size < 1 or self.n_samples < 1 or any(int(k) < 1 for k in self.n_samples_overrides.values()):
            raise ValueError(f"batch_size and n_samples must be >= 1 (got {self.batch_size}, {self.n_samples}, "
                             f"n_samples_overrides {self.n_samples_overrides})")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1 (leave it unset for every example), got {self.limit}")

    def samples_for(self, benchmark: str) -> int:
        return int(self.n_samples_overrides.get(benchmark, self.n_samples))


def score_line(model_name: str, summary: dict) -> str:
    """The log line of one benchmark: the score in percent, as every dare table prints it, with the fraction it comes
    from (``mean_score`` 0.410 is the score 41.0 of a partial-credit benchmark; ``accuracy`` 0.120 is 12.0)."""
    metric = summary["metric"]
    return (f"{model_name} {summary['benchmark']}: {summary['score']:.1f} % ({metric} {summary[metric]:.3f} over "
            f"{summary['n_examples']} examples)")


def sampler_for(bench: Benchmark, base: SamplerConfig, overrides: dict) -> SamplerConfig:
    extra = overrides.get(bench.name) or {}
    if not extra:
        return base
    unknown = set(extra) - {f.name for f in dataclasses.fields(SamplerConfig)}
    if unknown:
        raise ValueError(f"sampler_overrides.{bench.name}: unknown sampler key(s) {sorted(unknown)}")
    fields = dataclasses.asdict(base)
    if "gen_length" in extra and "steps" not in extra and base.steps == base.gen_length:
        fields["steps"] = None  # steps defaulted to gen_length: follow the new length
    fields.update(extra)
    return SamplerConfig(**fields)


def _settings(bench: Benchmark, cfg: SamplerConfig, opt: RunOptions, template: str, model_name: str) -> dict:
    return {"model": model_name, "benchmark": bench.name, "dataset": f"{bench.dataset}/{bench.split}",
            "reward": bench.reward, "template": template, "system_prompt": opt.system_prompt,
            "chat_template": opt.chat_template, "generation_prefix": opt.generation_prefix, "seed": opt.seed,
            "n_samples": opt.samples_for(bench.name), "sampler": dataclasses.asdict(cfg)}


def run_benchmark(model, tokenizer, bench: Benchmark, sampler_config: SamplerConfig, opt: RunOptions,
                  output_dir: Optional[Path] = None, model_name: str = "model") -> dict:
    from ..rewards import score_batch

    template = opt.templates.get(bench.name, opt.template)
    cfg = sampler_for(bench, sampler_config, opt.sampler_overrides)
    data_cfg = DataConfig(name=bench.dataset, split=bench.split, limit=opt.limit, template=template,
                          system_prompt=opt.system_prompt, chat_template=opt.chat_template,
                          generation_prefix=opt.generation_prefix, max_prompt_tokens=opt.max_prompt_tokens,
                          on_bad_row=opt.on_bad_row)
    budget = PromptBudget.for_model(model, cfg.gen_length, f"{bench.name} sampler gen_length")
    prompted = build_prompts(load_examples(data_cfg), tokenizer, data_cfg, budget)
    if not prompted:
        raise ValueError(f"{bench.name}: no example left to evaluate (every row was skipped; see the warnings above)")
    path = Path(output_dir) / f"{bench.name}.jsonl" if output_dir is not None else None
    store = SampleStore(path, _settings(bench, cfg, opt, template, model_name), opt.resume)
    n = opt.samples_for(bench.name)
    pending = [p for p in prompted if not all(store.done(p.example["id"], j) for j in range(n))]
    if len(pending) < len(prompted):
        log.info("%s: resuming, %d of %d examples already done", bench.name, len(prompted) - len(pending), len(prompted))
    from tqdm import tqdm

    bar = tqdm(total=len(prompted), initial=len(prompted) - len(pending), desc=f"{model_name}:{bench.name}",
               disable=not opt.progress, unit="ex", dynamic_ncols=True)
    gen_seconds, gen_tokens = 0.0, 0
    try:
        for start in range(0, len(pending), opt.batch_size):
            chunk = pending[start:start + opt.batch_size]
            seeds = [derive_seed(opt.seed, "eval", bench.name, p.example["id"]) for p in chunk]
            t0 = time.perf_counter()
            ro = generate(model, [p.input_ids for p in chunk], cfg, n=n, seeds=seeds)
            gen_seconds += time.perf_counter() - t0
            texts = ro.texts(tokenizer)
            prompt_index = ro.prompt_index.tolist()
            sample_index = ro.sample_index.tolist() if ro.sample_index is not None else [0] * len(texts)
            lengths = ro.completion_mask.sum(1).tolist()
            steps = ro.num_steps.tolist() if ro.num_steps is not None else [None] * len(texts)
            valid, nfe = rollout_speed(ro)
            gen_tokens += int(sum(valid))
            examples = [chunk[i].example for i in prompt_index]
            results = score_batch(bench.reward, texts, examples, timeout=opt.reward_timeout, workers=opt.reward_workers)
            store.append({
                "id": ex["id"], "benchmark": bench.name, "sample": j, "index": ex.get("index"),
                "prompt": chunk[i].text, "completion": text, "score": float(res.score), "reason": res.reason,
                "ground_truth": ex["ground_truth"], "completion_tokens": int(length), "steps": step,
                "valid_tokens": v, "nfe": f, "seed": seeds[i],
            } for i, j, ex, text, res, length, step, v, f in zip(prompt_index, sample_index, examples, texts, results,
                                                                 lengths, steps, valid, nfe))
            bar.update(len(chunk))
    finally:
        bar.close()
    ids = {p.example["id"] for p in prompted}
    records = [r for (eid, j), r in store.records.items() if eid in ids and j < n]
    return summarize(bench, records, len(prompted), gen_seconds, gen_tokens)


def evaluate(model, tokenizer, benchmarks="all", sampler_config: Optional[SamplerConfig] = None, *,
             output_dir=None, model_name: str = "model", options: Optional[RunOptions] = None, **kwargs) -> dict:
    """Evaluate ``model`` on ``benchmarks`` ("all", "gsm8k,sudoku" or a list) and return the results dict.

    ``sampler_config`` defaults to ``SamplerConfig()``; ``options`` (or the same fields as keyword arguments:
    ``limit``, ``batch_size``, ``template``, ``seed``, ``n_samples``, ``sampler_overrides``, ...) set the rest.
    With ``output_dir`` the per-sample JSONL (``<benchmark>.jsonl``), ``results.json`` and ``results.md``
    are written there and an interrupted run resumes; without it nothing touches the disk.
    """
    opt = options or RunOptions(**kwargs)
    if options is not None and kwargs:
        raise ValueError("pass either options= or keyword options, not both")
    cfg = sampler_config or SamplerConfig()
    out = Path(output_dir) if output_dir is not None else None
    results = {"model": model_name, "benchmarks": {}, "sampler": dataclasses.asdict(cfg),
               "options": {k: v for k, v in dataclasses.asdict(opt).items() if k != "progress"}}
    for bench in resolve_benchmarks(benchmarks):
        summary = run_benchmark(model, tokenizer, bench, cfg, opt, out, model_name)
        results["benchmarks"][bench.name] = summary
        log.info("%s", score_line(model_name, summary))
    write_results(results, out)
    return results

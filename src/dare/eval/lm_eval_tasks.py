"""A built-in benchmark as a local lm-evaluation-harness task, so the harness and ``dare eval`` score the same thing.

``export_benchmark("gsm8k", folder, tokenizer, limit=50, template="reasoning")`` writes ``folder/<task>.yaml``, the
examples (``<task>.jsonl``) and ``dare_lm_eval_utils.py`` (the task's ``process_results``: dare's own reward). Each
document carries the user turn dare renders (or, without a chat template, the whole prompt text), the example
itself and the seed ``dare eval`` gives it, which the ``dare`` lm-eval model uses for that document's generation. Run
it with ``lm_eval.simple_evaluate(model="dare", ..., tasks=[task], task_manager=TaskManager(include_path=folder),
apply_chat_template=chat)`` (``chat`` is returned): the prompts, completions and scores equal ``dare eval``'s with
the same sampler and ``--batch-size`` (batching changes float rounding; docs/samplers.md).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

UTILS = "dare_lm_eval_utils"
_UTILS_SOURCE = '''"""process_results of tasks exported by dare.eval.lm_eval_tasks: the reward dare eval scores with."""
import json


def process_results(doc, results):
    from dare.rewards import score_batch

    res = score_batch(doc["reward"], [results[0]], [json.loads(doc["example"])], workers=1)[0]
    return {"score": float(res.score), "acc": float(res.score >= 1.0 - 1e-9)}
'''


def export_benchmark(benchmark: str, folder, tokenizer, *, limit: Optional[int] = None, template: str = "reasoning",
                     system_prompt: Optional[str] = None, chat_template: str = "auto",
                     generation_prefix: Optional[str] = None, seed: int = 0, max_gen_toks: int = 256,
                     until: Optional[list[str]] = None, task_name: Optional[str] = None) -> tuple[str, bool]:
    """Write the task; returns ``(task name, whether it needs apply_chat_template=True)``.

    ``until`` defaults to the tokenizer's EOS text: dare's completions are already cut at the first stop token and
    decoded without special tokens, so the harness's own default cut (a blank line) would change them.
    """
    from ..data import DataConfig, load_examples
    from ..data.prompts import _prefix_override, render_prompt, uses_chat_template
    from ..data.templates import get_template
    from ..diffusion.noise import derive_seed
    from .benchmarks import resolve_benchmarks

    (bench,) = resolve_benchmarks([benchmark])
    tpl = get_template(template)
    chat = uses_chat_template(tokenizer, tpl, chat_template)
    cfg = DataConfig(name=bench.dataset, split=bench.split, limit=limit, template=template)
    task = task_name or f"dare_{bench.name}"
    docs = []
    for ex in load_examples(cfg):
        prompt = _prefix_override(tpl.build(ex, system_prompt), generation_prefix)
        doc = {"id": ex["id"], "reward": bench.reward, "example": json.dumps(ex, default=str),
               "dare_seed": derive_seed(seed, "eval", bench.name, ex["id"])}
        if chat:
            if len(prompt.messages) != 1 or prompt.messages[0]["role"] != "user":
                raise ValueError(f"{bench.name} with template {template!r}: lm-eval's chat prompt is one user turn (a "
                                 f"system prompt is simple_evaluate's system_instruction); this prompt has "
                                 f"{[m['role'] for m in prompt.messages]}")
            doc.update(text=prompt.messages[0]["content"], gen_prefix=prompt.generation_prefix)
        else:
            doc.update(text=render_prompt(ex, tpl, tokenizer, system_prompt, chat_template, generation_prefix),
                       gen_prefix="")
        docs.append(doc)
    if not docs:
        raise ValueError(f"{bench.name}: no example to export")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{task}.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    (folder / f"{UTILS}.py").write_text(_UTILS_SOURCE)
    stops = until if until is not None else [tokenizer.eos_token] if getattr(tokenizer, "eos_token", None) else []
    lines = [f"task: {task}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {json.dumps(str(data))}",
             "test_split: test", "output_type: generate_until",
             "doc_to_text: text",  # a column name: lm-eval passes the value as it is (no Jinja rendering)
             "doc_to_target: id", 'target_delimiter: ""',  # no space between the user turn and a generation prefix
             "generation_kwargs:", f"  until: {json.dumps(stops)}", f"  max_gen_toks: {int(max_gen_toks)}",
             f"process_results: !function {UTILS}.process_results", "metric_list:"]
    if any(d["gen_prefix"] for d in docs):
        lines.insert(lines.index("doc_to_target: id"), "gen_prefix: gen_prefix")
    for metric in ("score", "acc"):
        lines += [f"  - metric: {metric}", "    aggregation: mean", "    higher_is_better: true"]
    (folder / f"{task}.yaml").write_text("\n".join(lines) + "\n")
    return task, chat

"""Evaluation: ``dare eval`` and ``evaluate(model, tokenizer, benchmarks, sampler_config)`` (see docs/eval.md).

Built-in benchmarks generate with ``dare.rollout``, score with ``dare.rewards`` and write per-sample JSONL,
results.json and a Markdown table. General-knowledge benchmarks go through the lm-evaluation-harness plugin
(``register_lm_eval()``, model name ``"dare"``); OpenCompass users use ``dare.eval.opencompass_model``.
Neither harness is imported unless asked for.
"""
from .benchmarks import BENCHMARKS, Benchmark, register_benchmark, resolve_benchmarks
from .likelihood import elbo_loglikelihood, greedy_matches
from .report import markdown_table, write_results
from .runner import RunOptions, evaluate, run_benchmark

__all__ = ["BENCHMARKS", "Benchmark", "register_benchmark", "resolve_benchmarks", "elbo_loglikelihood",
           "greedy_matches", "markdown_table", "write_results", "RunOptions", "evaluate", "run_benchmark",
           "register_lm_eval"]


def register_lm_eval():
    """Register the ``dare`` model with lm-evaluation-harness; returns the ``DareLM`` class."""
    try:
        from .lm_eval_plugin import DareLM
    except ImportError as e:
        if not (e.name or "").startswith("lm_eval"):
            raise
        raise ImportError('the lm-eval plugin needs lm-evaluation-harness: pip install "dare[eval]" '
                          '(or pip install "lm-eval>=0.4.8")') from e
    return DareLM

"""``EvalConfig``: the schema of a ``dare eval`` recipe (YAML + dotted overrides + command-line flags)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..rollout import SamplerConfig
from .runner import RunOptions


@dataclass
class LMEvalSection:
    """lm-evaluation-harness tasks run through the ``dare`` LM plugin (needs ``pip install "dare[eval]"``)."""
    tasks: list[str] = field(default_factory=list)  # e.g. [mmlu, hellaswag, arc_challenge, gpqa_main_zeroshot]
    include_path: Optional[str] = None  # a folder of extra task YAMLs (local / offline tasks)
    num_fewshot: Optional[int] = None
    mc_num: int = 32  # ELBO Monte-Carlo samples per loglikelihood request
    mc_batch_size: int = 32
    greedy_check: bool = True
    apply_chat_template: bool = False
    max_length: Optional[int] = None


@dataclass
class EvalConfig(RunOptions):
    models: list[str] = field(default_factory=list)  # checkpoint folders, hub ids, or tiny:<family>
    benchmarks: list[str] = field(default_factory=lambda: ["all"])  # built-in benchmarks ([] = lm-eval tasks only)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    output_dir: str = "runs/eval"
    dtype: Optional[str] = None  # float32 / bfloat16 (default: the checkpoint's)
    device: Optional[str] = None  # default: cuda when available
    mask_token_id: Optional[int] = None
    tokenizer: Optional[str] = None  # tokenizer folder (default: each model's folder)
    tiny_seed: int = 0  # weights of tiny:<family> models
    # Block-diffusion models (SDAR, LLaDA2) decode with their trained block size instead of sampler.block_length
    # (when it divides gen_length), so one recipe serves a table of mixed families.
    model_block_length: bool = True
    lm_eval: LMEvalSection = field(default_factory=LMEvalSection)

    def options(self) -> RunOptions:
        return RunOptions(**{f: getattr(self, f) for f in RunOptions.__dataclass_fields__})

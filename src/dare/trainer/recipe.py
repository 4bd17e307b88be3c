"""``TrainRecipe``: the typed schema of a ``dare train`` recipe (YAML + dotted ``key=value`` overrides).

Every section is a dataclass; unknown keys and wrong types are errors naming the dotted key. The ``algorithm``
section is polymorphic: ``algorithm.name`` picks the algorithm's own config dataclass (``dare.algorithms``), so
method-specific keys are validated too. ``rollout.sampler`` is ``dare.rollout.SamplerConfig`` and
``data.dataset`` is ``dare.data.DataConfig``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional

from ..algorithms.base import AlgorithmConfig
from ..data.config import DataConfig
from ..rollout.config import SamplerConfig
from ..config.core import load_config

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class ModelSection:
    # A checkpoint folder, a Hugging Face id, or ``tiny:<family>`` (a random tiny model + the tiny tokenizer).
    path: str
    dtype: str = "float32"  # parameter dtype (bfloat16 on GPU for real models)
    attn_backend: str = "auto"
    mask_token_id: Optional[int] = None
    tokenizer: Optional[str] = None  # default: the model folder; "tiny": the character tokenizer
    gradient_checkpointing: bool = False
    # Size overrides for tiny:<family> (ignored, with a warning, for a checkpoint path; null or {} = none).
    tiny_sizes: Optional[dict[str, int]] = field(default_factory=dict)
    tiny_seed: int = 0


@dataclass
class LoraSection:
    enabled: bool = False
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    include_experts: bool = True  # also adapt MoE expert MLPs (their modules have the same names)

    def __post_init__(self):
        if self.r <= 0:
            raise ValueError(f"lora.r must be positive, got {self.r}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"lora.target_modules: unknown module name(s) {unknown}; native names are {LORA_TARGETS}")


@dataclass
class ReferenceSection:
    # auto: the LoRA-disabled base when LoRA is on (no second copy), else a frozen copy; only built when needed.
    mode: Literal["auto", "copy", "lora_disabled"] = "auto"


@dataclass
class DataSection:
    # Task datasets through dare.data (SFT uses each example's gold completion; RL uses the prompts).
    dataset: Optional[DataConfig] = None
    # Or a JSONL file of {prompt, response} (SFT) / {prompt, chosen, rejected} (DPO) pairs.
    pairs: Optional[str] = None
    chat_template: Literal["auto", "always", "never"] = "auto"  # for pairs: wrap the prompt in the tokenizer's template
    max_length: int = 1024  # SFT/DPO: tokens per sequence (prompt + answer), and the packed row capacity
    packing: bool = True  # pack documents into rows of max_length (position ids restart per document)
    pad_answer_to: Optional[int] = None  # LLaDA: right-pad each answer with EOS to this many tokens (part of the loss)
    loss_on_padding: bool = True  # padded rows (packing off): the EOS pads are answer tokens, as in LLaDA's SFT
    on_bad_row: Literal["error", "skip"] = "error"

    def __post_init__(self):
        if self.max_length <= 0:
            raise ValueError(f"data.max_length must be positive, got {self.max_length}")


@dataclass
class OptimSection:
    lr: float = 1e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: Literal["constant", "cosine", "cosine_with_min_lr", "linear"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0  # cosine_with_min_lr: the floor as a fraction of lr
    grad_clip: Optional[float] = 1.0

    def __post_init__(self):
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must be two values in [0, 1), got {self.betas}")
        for key in ("lr", "eps"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) > 0):
                raise ValueError(f"optim.{key} must be a positive finite number, got {getattr(self, key)}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"optim.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not (math.isfinite(self.grad_clip) and self.grad_clip > 0):
            raise ValueError(f"optim.grad_clip must be a positive finite number (or null: no clipping), got {self.grad_clip}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"optim.warmup_steps must be >= 0 and optim.min_lr_ratio in [0, 1], got "
                             f"{self.warmup_steps}, {self.min_lr_ratio}")


@dataclass
class TrainSection:
    steps: int = 100  # loop iterations (batches); RL: each runs algorithm.inner_iterations optimizer updates
    batch_size: int = 8  # global per step: SFT documents, DPO pairs, RL prompts
    micro_batch_size: int = 4  # per rank per forward: packed rows / sequences / pairs / completions
    seed: int = 0
    output_dir: str = "runs/train"
    save_every: int = 0  # checkpoint every N steps (0: only at the end)
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto: continue from the latest complete checkpoint; never; or a checkpoint folder
    # Resuming checks the recipe against the checkpoint's (docs/training.md); true resumes despite changed keys.
    allow_recipe_change: bool = False
    log_every: int = 1
    max_bad_steps: int = 3  # NaN/inf losses or gradients: skip the step; abort after this many in a row
    export: bool = True  # write the final model in the family's HF layout (+ tokenizer) to output_dir/export
    chunk_size: int = 1024  # rows per chunk of the linear + log-softmax
    # bf16: compute in bfloat16 with fp32 parameters/optimizer (FSDP2 MixedPrecisionPolicy with fp32 gradient
    # reduction; torch.autocast in a single process). Keep model.dtype float32 with it.
    mixed_precision: Literal["none", "bf16"] = "none"
    eval_every: int = 0  # evaluate on eval.benchmarks every N steps (0: never)

    def __post_init__(self):
        for key in ("steps", "batch_size", "micro_batch_size", "log_every", "chunk_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"train.{key} must be positive, got {getattr(self, key)}")
        for key in ("save_every", "eval_every", "max_bad_steps"):
            if getattr(self, key) < 0:
                raise ValueError(f"train.{key} must be >= 0, got {getattr(self, key)}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"train.keep_checkpoints must be >= 1 (the latest checkpoint is what a run resumes "
                             f"from), got {self.keep_checkpoints}")


@dataclass
class RolloutSection:
    group_size: int = 4  # completions per prompt (G)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    micro_batch_size: int = 0  # prompts per generate() call per rank (0: all at once)


@dataclass
class RewardSection:
    name: Optional[str] = None  # default: the reward registered for each example's task
    # A weighted combination {reward name: weight} instead of `name` ("auto" = each example's task reward), e.g.
    # {auto: 1.0, speed: 0.5}, {countdown: 1.0, format: 0.5} or DiRL's {speed_cosine: 1.0} (see docs/rewards.md).
    terms: dict[str, float] = field(default_factory=dict)
    timeout: float = 10.0
    workers: int = 1

    def __post_init__(self):
        from ..rewards.registry import check_reward_spec
        if self.name is not None and self.terms:
            raise ValueError(f"reward.name={self.name!r} and reward.terms are both set; put the name into terms "
                             f"({{{self.name}: 1.0, ...}})")
        check_reward_spec(self.spec, "reward.terms" if self.terms else "reward.name")
        if not (math.isfinite(self.timeout) and self.timeout > 0) or self.workers < 0:
            raise ValueError(f"reward.timeout must be a positive number of seconds and reward.workers >= 0, got "
                             f"{self.timeout}, {self.workers}")

    @property
    def spec(self):
        """What ``dare.rewards.score_batch`` takes: the terms, else the name, else ``auto`` (each example's task)."""
        return dict(self.terms) if self.terms else (self.name or "auto")


@dataclass
class DistributedSection:
    nproc: int = 1  # > 1: `dare train` launches torchrun itself
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl on GPU, gloo on CPU
    fsdp: bool = True  # shard with FSDP2 fully_shard when world size > 1
    # FSDP gradient reduction: "last" reduce-scatters once per update, after the last micro-batch (FSDP2 then keeps
    # the unsharded fp32 gradients of every parameter while it accumulates: 4 bytes x all parameters per GPU);
    # "every" reduce-scatters after each micro-batch (sharded gradients only; one reduce-scatter per micro-batch).
    grad_sync: Literal["last", "every"] = "last"
    # More than one machine (docs/training.md, "Several machines"): run the same `dare train` command on every
    # node; each starts torchrun with ``nproc`` processes and meets the others by c10d rendezvous at
    # ``rdzv_endpoint`` (host:port of one node that every node reaches), under the job id ``rdzv_id``.
    nnodes: int = 1
    rdzv_endpoint: str = ""
    rdzv_id: str = "dare"
    # "full": FSDP2 shards over every process. "hybrid" (HSDP): shards within a node and replicates across nodes
    # (a 2-D mesh [nodes, processes per node]): all-gathers and reduce-scatters stay on a node's fast links and
    # only an all-reduce of the gradient shards crosses nodes, at the price of per-node (not global) sharding.
    sharding: Literal["full", "hybrid"] = "full"
    # Ulysses sequence parallelism (dare.models.sequence_parallel): groups of this many processes on one node share
    # each micro-batch and split its positions, so activations per GPU shrink by this factor (long responses).
    # Data parallelism is then over nproc x nnodes / sequence_parallel groups.
    sequence_parallel: int = 1

    def __post_init__(self):
        if self.nproc < 1 or self.nnodes < 1:
            raise ValueError(f"distributed.nproc and distributed.nnodes must be >= 1, got {self.nproc}, {self.nnodes}")
        if self.sequence_parallel < 1 or self.nproc % self.sequence_parallel:
            raise ValueError(f"distributed.sequence_parallel={self.sequence_parallel} must be >= 1 and divide "
                             f"distributed.nproc={self.nproc} (a group lives on one node)")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("distributed.nnodes > 1 needs distributed.rdzv_endpoint (host:port of one node that every "
                             "node can reach, e.g. the first node of a SLURM job)")


@dataclass
class EvalSection:
    """Periodic evaluation during training (every ``train.eval_every`` steps) with ``dare.eval.evaluate``."""
    benchmarks: list[str] = field(default_factory=list)  # e.g. [gsm8k, sudoku]; see dare.eval.BENCHMARKS
    limit: Optional[int] = 64  # examples per benchmark
    batch_size: int = 8
    template: str = "reasoning"
    sampler: SamplerConfig = field(default_factory=SamplerConfig)

    def __post_init__(self):
        if (self.limit is not None and self.limit < 1) or self.batch_size < 1:
            raise ValueError(f"eval.limit (null = every example) and eval.batch_size must be >= 1, got "
                             f"{self.limit}, {self.batch_size}")


@dataclass
class LoggingSection:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "dare"
    plot: bool = True  # training-curve PNG at every checkpoint
    progress: bool = True


@dataclass
class TrainRecipe:
    model: ModelSection
    algorithm: AlgorithmConfig
    data: DataSection = field(default_factory=DataSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraSection = field(default_factory=LoraSection)
    reference: ReferenceSection = field(default_factory=ReferenceSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    distributed: DistributedSection = field(default_factory=DistributedSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)

    def __post_init__(self):
        if self.train.eval_every and not self.eval.benchmarks:
            raise ValueError("train.eval_every is set but eval.benchmarks is empty (e.g. eval.benchmarks=[sudoku])")
        if self.reference.mode == "lora_disabled" and not self.lora.enabled:
            raise ValueError("reference.mode: lora_disabled needs lora.enabled: true")
        need, why = self.algorithm.group_need()
        if self.rollout.group_size < need:
            raise ValueError(f"rollout.group_size={self.rollout.group_size}: algorithm {self.algorithm.name!r} needs at "
                             f"least {need} completions per prompt ({why})")
        if self.rollout.group_size < 1 or self.rollout.micro_batch_size < 0:
            raise ValueError(f"rollout.group_size must be >= 1 and rollout.micro_batch_size >= 0, got "
                             f"{self.rollout.group_size}, {self.rollout.micro_batch_size}")


def load_recipe(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None) -> TrainRecipe:
    return load_config(TrainRecipe, path, overrides)

"""``dare plan RECIPE [key=value ...]``: per-GPU memory, FLOPs and time of a recipe at full size, before a GPU is spent.

The recipe's model is built from its config.json with no weights and one training step runs through the trainer's
own code on fake tensors over a fake process group of the recipe's world size (``dare.plan``).
"""
from __future__ import annotations

import json
import sys

NAME = "plan"
HELP = "plan a recipe's per-GPU peak memory, FLOPs and run time at full size on CPU (no weights, no GPU)"


def add_arguments(p):
    p.add_argument("recipe", help="recipe YAML (see recipes/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_size=2")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: distributed.nproc x --nodes)")
    p.add_argument("--nodes", type=int, default=None,
                   help="machines the GPUs are spread over (default: distributed.nnodes); with distributed.sharding="
                        "hybrid FSDP shards within a node and replicates across nodes")
    p.add_argument("--gpu", default="h100", help="a100, h100, h200 or b200: memory and dense bf16 peak (default h100)")
    p.add_argument("--gpu-memory", default=None, help="memory per GPU, e.g. 80GiB or 94GB (default: the GPU's)")
    p.add_argument("--prompt-length", type=int, default=256, help="prompt tokens of every RL prompt and SFT/DPO row (default 256)")
    p.add_argument("--margin", type=float, default=0.10, help="fraction of GPU memory kept free for fragmentation (default 0.10)")
    p.add_argument("--reserved", default="2GiB", help="memory reserved for the CUDA context, NCCL and kernel workspaces (default 2GiB)")
    p.add_argument("--mfu", type=float, default=0.40, help="fraction of peak FLOP/s of scoring and updates (default 0.40)")
    p.add_argument("--rollout-mfu", type=float, default=0.10, help="fraction of peak FLOP/s of decoding (default 0.10)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args) -> int:
    import torch

    from dare.trainer.recipe import load_recipe
    from dare.plan.gpus import parse_bytes
    from dare.plan.planner import PlanOptions, plan_recipe
    from dare.plan.report import table

    torch.set_num_threads(1)  # fake tensors do no arithmetic: dispatch overhead is all there is
    recipe = load_recipe(args.recipe, args.overrides)
    if (args.nodes is not None and args.nodes < 1) or (args.gpus is not None and args.gpus < 1):
        raise ValueError("--nodes and --gpus must be >= 1")
    opts = PlanOptions(gpus=args.gpus, gpu=args.gpu, nodes=args.nodes, prompt_length=args.prompt_length,
                       gpu_memory=parse_bytes(args.gpu_memory) if args.gpu_memory else None, margin=args.margin,
                       reserved_bytes=parse_bytes(args.reserved), train_mfu=args.mfu, rollout_mfu=args.rollout_mfu)
    plan = plan_recipe(recipe, opts, args.recipe)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(table(plan, recipe, opts.margin, opts.reserved_bytes))
    if plan.error:
        print(f"dare plan: error: {plan.error}", file=sys.stderr)
        return 1
    return 0 if plan.fits else 3

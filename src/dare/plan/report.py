"""A plan as a terminal table, a verdict and the knobs that would make a recipe fit."""
from __future__ import annotations

from .gpus import GIB


def gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _flops(f: float) -> str:
    for unit, div in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if f >= div:
            return f"{f / div:.1f} {unit}"
    return f"{f:.0f} FLOP"


def knobs(plan, phase: str, recipe) -> list[str]:
    """Settings that lower the peak of ``phase`` for this recipe (only those it does not use already)."""
    out = []
    if phase == "rollout":
        per_rank = recipe.train.batch_size // max(plan.world, 1)
        if not recipe.rollout.micro_batch_size or recipe.rollout.micro_batch_size > 1:
            out.append(f"rollout.micro_batch_size (prompts decoded together per rank; now "
                       f"{recipe.rollout.micro_batch_size or per_rank})")
        if recipe.train.mixed_precision != "bf16" or recipe.model.dtype == "float32":
            out.append("model.dtype: bfloat16 halves the gathered weights every rollout holds")
    else:
        if recipe.train.micro_batch_size > 1:
            out.append(f"train.micro_batch_size (now {recipe.train.micro_batch_size})")
        if not recipe.model.gradient_checkpointing:
            out.append("model.gradient_checkpointing: true")
        if recipe.train.chunk_size > 256:
            out.append(f"train.chunk_size (rows per log-softmax chunk, now {recipe.train.chunk_size})")
        accumulating = max([p.breakdown.get("backward temporaries", 0) + p.breakdown.get("unsharded gradients", 0)
                            for p in plan.phases if p.name == phase] or [0])
        if plan.world > 1 and recipe.distributed.grad_sync == "last" and accumulating > 0.25 * plan.peak_bytes:
            out.append("distributed.grad_sync: every (reduce-scatter each micro-batch instead of accumulating unsharded "
                       "fp32 gradients)")
        activations = max([p.breakdown.get("activations", 0) for p in plan.phases if p.name == phase] or [0])
        sp, per_node = recipe.distributed.sequence_parallel, plan.world // max(plan.nodes, 1)
        if activations > 0.25 * plan.peak_bytes and per_node % (2 * sp) == 0:
            out.append(f"distributed.sequence_parallel: {2 * sp} (each sequence split over {2 * sp} GPUs: activations "
                       f"per GPU / {2 * sp}; native families)")
        if not recipe.lora.enabled:
            out.append("lora.enabled: true (no full-size gradients or optimizer states)")
    out.append(f"more GPUs (--gpus; now {plan.world}): parameters, gradients and optimizer states shard over them")
    return out


def verdict(plan, recipe=None) -> str:
    if plan.error:
        return f"not planned: {plan.error}"
    peak, budget = plan.peak_bytes, plan.budget
    if peak <= budget:
        return (f"fits: peak {gib(peak)} GiB per GPU in {plan.peak_phase} <= budget {gib(budget)} GiB "
                f"({gib(budget - peak)} GiB to spare)")
    first = next(p for p in plan.phases if p.peak_bytes > budget)
    text = (f"does not fit: {first.name} needs {gib(first.peak_bytes)} GiB per GPU, {gib(first.peak_bytes - budget)} GiB "
            f"over the budget of {gib(budget)} GiB")
    if recipe is not None:
        text += "; try " + "; ".join(knobs(plan, first.name, recipe))
    return text


def _hybrid(recipe) -> bool:
    return recipe is not None and recipe.distributed.sharding == "hybrid"


def _sequence_parallel(recipe) -> str:
    n = recipe.distributed.sequence_parallel if recipe is not None else 1
    return f", sequence parallel {n}: groups of {n} GPUs share each micro-batch" if n > 1 else ""


def table(plan, recipe=None, margin: float = 0.1, reserved: int = 2 * GIB) -> str:
    lines = [f"dare plan: {plan.recipe or plan.model}",
             f"  model {plan.model} ({plan.family}, {plan.parameters / 1e9:.2f}B parameters, "
             f"{plan.trainable / 1e9:.3f}B trainable; {plan.config_source})",
             f"  {plan.world} x {plan.gpu} ({plan.nodes} node{'s' if plan.nodes > 1 else ''}"
             f"{', hybrid sharding: FSDP within a node, replicas across nodes' if _hybrid(recipe) else ''}"
             f"{_sequence_parallel(recipe)}), "
             f"{gib(plan.gpu_memory)} GiB each; budget {gib(plan.budget)} GiB per GPU "
             f"(minus {margin:.0%} margin and {gib(reserved)} GiB reserved)", ""]
    cats = []
    for p in plan.phases:
        for k in p.breakdown:
            if k not in cats:
                cats.append(k)
    head = ["phase", "peak GiB", *cats, "KV cache", "FLOPs/GPU", "seconds"]
    rows = [[p.name, gib(p.peak_bytes), *[gib(p.breakdown.get(c, 0)) for c in cats],
             gib(p.kv_cache_bytes) if p.kv_cache_bytes else "-", _flops(p.flops), f"{p.seconds:.1f}"] for p in plan.phases]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  " + "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines += [fmt(head), fmt(["-" * w for w in widths]), *[fmt(r) for r in rows], ""]
    lines.append(f"  per step: {_flops(plan.flops_per_step)} per GPU, ~{plan.seconds_per_step:.1f} s; "
                 f"{plan.steps} steps: ~{plan.hours:.1f} h")
    if plan.scaled:
        lines.append("  simulated less work than a step and scaled its FLOPs: " +
                     ", ".join(f"{k} x{v:g}" for k, v in plan.scaled.items() if v != 1) if any(v != 1 for v in plan.scaled.values())
                     else "  simulated the whole step")
    if plan.assumptions:
        lines.append("  assumed (values a fake tensor cannot know): " +
                     "; ".join(f"{k} ({v}x)" for k, v in sorted(plan.assumptions.items())))
    lines.append("  " + verdict(plan, recipe))
    return "\n".join(lines)

"""The four parts of benchmarks/gpu_check.py. Each takes a ``Context`` and returns table rows (dicts); a row's "ok"
is True / False where the row is a check with a stated tolerance, absent where it is a measurement. ``Skip`` says in
one line why a part cannot run here."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
GIB = 2 ** 30
# Tolerances (benchmarks/gpu.md): fp32 logits against the reference fixtures as the CPU tests (1e-4 absolute); the
# backends against sdpa relative to the largest |value| (logits, and gradients of the same loss).
FIXTURE_TOL = 1e-4
BACKEND_TOL = {torch.float32: {"logits": 1e-4, "grads": 1e-3}, torch.bfloat16: {"logits": 3e-2, "grads": 8e-2}}
# Models of the speed and plan parts at full shape: the configs dare ships (dare/plan/configs), random weights.
LLADA_8B, SDAR_8B = "GSAI-ML/LLaDA-8B-Instruct", "JetLM/SDAR-8B-Chat"


class Skip(Exception):
    """A part that cannot run here; the message is the one-line reason."""


@dataclass
class Context:
    device: torch.device
    quick: bool

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def peak_flops(self) -> Optional[float]:
        """The device's dense bf16 peak (dare.plan.gpus), or None (a CPU, an accelerator the planner does not know)."""
        if self.device.type != "cuda":
            return None
        from dare.plan.gpus import GPUS
        name = torch.cuda.get_device_name(self.device).lower()
        for key, gpu in GPUS.items():
            if key in name:
                return gpu.bf16_flops
        return None

    def free_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (0 when both are 0)."""
    a, b = a.float().cpu(), b.float().cpu()
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale else (a - b).abs().max().item()


# --- 1. correctness ------------------------------------------------------------------------------------------------


def correctness(ctx: Context) -> list[dict]:
    """Every fixture family on the device: fp32 logits against the reference and against this CPU, bf16 against fp32
    (max difference, argmax agreement), and the reference's required greedy decodes (fp32 cases must match token for
    token; bf16 cases are reported: a bf16 tie may break the other way on another device's kernels)."""
    from dare.models import load_model
    from dare.rollout import generate
    from tests.rollout.fixture_cases import FIXTURES, FOLDERS, load_cases
    rows = []
    for folder in FOLDERS:
        d = FIXTURES / folder
        exp = torch.load(d / "expected_logits.pt")
        ids = exp["input_ids"]
        mask = exp.get("attention_mask_additive")  # LLaDA2: the block length is a decoding parameter, passed as a mask
        ref = exp.get("logits_fp32", exp["logits"]).float()
        models = {dt: load_model(d, dtype=dt, mask_token_id=500).to(ctx.device) for dt in (torch.float32, torch.bfloat16)}
        cpu = load_model(d, dtype=torch.float32, mask_token_id=500)
        with torch.no_grad():
            def logits(model, device, dtype):
                kw = {} if mask is None else {"attention_mask": mask.to(device=device, dtype=dtype)}
                return model(ids.to(device), **kw).logits.float().cpu()
            on_cpu = logits(cpu, "cpu", torch.float32)
            fp32 = logits(models[torch.float32], ctx.device, torch.float32)
            bf16 = logits(models[torch.bfloat16], ctx.device, torch.bfloat16)
        err = (fp32 - ref).abs().max().item()
        cases = [c for c in load_cases(folder) if c.raw["required"]]
        if ctx.quick:
            cases = cases[:2] + [c for c in cases if c.dtype == torch.bfloat16][:1]
        equal = {torch.float32: [0, 0], torch.bfloat16: [0, 0]}
        for case in cases:
            hints = None if case.hints is None else case.hints.to(ctx.device)
            r = generate(models[case.dtype], [case.prompt], case.config, hints=hints)
            got = r.completion_ids[0].tolist()[:len(case.expected)]
            equal[case.dtype][0] += got == case.expected
            equal[case.dtype][1] += 1
        f32, b16 = equal[torch.float32], equal[torch.bfloat16]
        rows.append({"family": folder, "fp32 vs reference": err, "fp32 device vs CPU": (fp32 - on_cpu).abs().max().item(),
                     "bf16 vs fp32 (max)": (bf16 - fp32).abs().max().item(),
                     "bf16 argmax agreement": (bf16.argmax(-1) == fp32.argmax(-1)).float().mean().item(),
                     "fp32 decodes equal": f"{f32[0]}/{f32[1]}", "bf16 decodes equal": f"{b16[0]}/{b16[1]}" if b16[1] else "-",
                     "ok": err <= FIXTURE_TOL and f32[0] == f32[1]})
        del models, cpu
    return rows


# --- 2. attention backends ------------------------------------------------------------------------------------------


def _backend_inputs(model, kind: str, quick: bool, device):
    g = torch.Generator().manual_seed(3)
    vocab = model.arch.vocab_size
    if kind == "packed":  # variable-length documents in one row: the SFT packing path (flash_attn's varlen)
        lengths = (5, 9, 3, 14) if quick else (300, 700, 100, 948)
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        ids = torch.randint(0, vocab - 16, (1, int(pos.shape[1])), generator=g)
        layout = model.adapter.packed_layout(pos.to(device))
    else:  # block diffusion training: [x_t ; x_0] under the block-causal mask
        L = model.adapter.block_size * (3 if quick else 128)
        x0 = torch.randint(0, vocab - 16, (2, L), generator=g)
        xt = x0.clone()
        xt[torch.rand(x0.shape, generator=g) < 0.5] = model.adapter.mask_token_id
        ids = torch.cat([xt, x0], 1)
        layout = model.adapter.block_diffusion_layout(torch.arange(L).expand(2, L).to(device))
    labels = torch.randint(0, vocab - 16, ids.shape, generator=g)
    return ids.to(device), layout, labels.to(device)


def backends(ctx: Context) -> list[dict]:
    """sdpa, flex and flash_attn (where importable, CUDA only) on the same weights: logits and the gradients of one
    cross-entropy loss, against sdpa's, on packed variable-length rows (bidirectional families) and the block-diffusion
    training layout (SDAR), in fp32 and bf16. On a CPU, flex trains through the dense mask (FlexAttention has no CPU
    backward), so only its forward differs from sdpa there."""
    from dare.models import tiny
    names = ["sdpa", "flex"] + (["flash_attn"] if ctx.device.type == "cuda" and _flash_attn() else [])
    rows = []
    sizes = {} if ctx.quick else dict(hidden_size=512, num_layers=4, num_heads=8, intermediate_size=1024)
    for family, kind in (("llada", "packed"), ("dream", "packed"), ("sdar", "block")):
        for dtype in (torch.float32, torch.bfloat16):
            model = tiny(family, seed=11, **sizes).to(ctx.device, dtype).train()
            ids, layout, labels = _backend_inputs(model, kind, ctx.quick, ctx.device)
            results = {}
            for name in names:
                if name == "flash_attn" and kind == "block":
                    continue  # flash_attn takes bidirectional packed rows only; block masks go through flex
                model.set_attn_backend(name)
                with torch.no_grad():  # the inference path (on a CPU, the only one where flex runs flex)
                    logits = model(ids, layout=layout).logits
                model.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(ids, layout=layout).logits.float().flatten(0, -2),
                                                         labels.flatten())
                loss.backward()
                grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
                results[name] = (logits, grads)
            tol = BACKEND_TOL[dtype]
            for name, (logits, grads) in results.items():
                if name == "sdpa":
                    continue
                dl, dg = _rel(logits, results["sdpa"][0]), _rel(grads, results["sdpa"][1])
                rows.append({"family": family, "layout": kind, "dtype": str(dtype).replace("torch.", ""),
                             "backend": name, "tokens": int(ids.numel()), "logits vs sdpa (rel)": dl,
                             "grads vs sdpa (rel)": dg, "tolerance (logits / grads)": f"{tol['logits']} / {tol['grads']}",
                             "ok": dl <= tol["logits"] and dg <= tol["grads"]})
            del model
    if len(names) < 3:
        rows.append({"family": "-", "backend": "flash_attn", "layout": "not run: " + (
            "no CUDA device" if ctx.device.type != "cuda" else "flash-attn is not installed")})
    return rows


# --- 3. speed at full shape -----------------------------------------------------------------------------------------


def full_shape_model(hub_id: str, ctx: Context, dtype=torch.bfloat16, attn_backend: str = "auto"):
    """The published architecture of ``hub_id`` (its config.json shipped with dare) with random weights on the device."""
    from dare.models.builder import build_model
    from dare.models.families import detect_family, get_family
    from dare.plan.models import meta_model, model_config
    from dare.trainer.recipe import ModelSection
    shape, _ = meta_model(ModelSection(path=hub_id))  # the planner's own build, on the meta device
    need = sum(p.numel() for p in shape.parameters()) * torch.finfo(dtype).bits // 8
    if need * 1.3 > ctx.free_bytes():
        raise Skip(f"{hub_id}: {need / GIB:.1f} GiB of {dtype} weights do not fit the {ctx.free_bytes() / GIB:.1f} "
                   "GiB free here")
    cfg, mask_id, _ = model_config(ModelSection(path=hub_id))
    torch.manual_seed(0)
    model = build_model(get_family(detect_family(cfg).name), cfg, mask_id if mask_id is not None else -1,
                        dtype=dtype, device=ctx.device, attn_backend=attn_backend, init=True)
    return model.eval()


def _flops(fn) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def _timed(ctx: Context, fn, repeats: int = 1) -> tuple[float, object]:
    ctx.sync()
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    ctx.sync()
    return (time.perf_counter() - start) / repeats, out


def _vs_plan(row: dict, flops: float, seconds: float, assumed_mfu: float, peak: Optional[float], work: float) -> dict:
    """The measured MFU and the rate the plan's time model predicts (its FLOPs at the assumed MFU of the peak)."""
    row["FLOPs"] = flops
    if peak:
        row["MFU measured"] = flops / seconds / peak
        row["MFU the plan assumes"] = assumed_mfu
        row["plan predicts / s"] = work / (flops / (assumed_mfu * peak))
        row["measured / predicted"] = row["per s"] / row["plan predicts / s"]
    return row


def speed(ctx: Context) -> list[dict]:
    """Rollout tokens per second (LLaDA-8B dual cache at threshold 0.9 and uncached; SDAR-8B block cache) at batch 1
    and 32, and forward + backward tokens per second of an SFT step on packed 2,048-token rows per attention backend,
    each with its measured MFU beside the plan's assumed one (0.10 decoding, 0.40 training) and the rate that
    assumption predicts. Random weights: a threshold decode commits about one token per step (no confident tokens),
    so its NFE is reported. --quick: tiny models of the same families."""
    from dare.models import LogitsRequest, tiny
    from dare.plan.planner import PlanOptions
    from dare.rollout import SamplerConfig, generate
    assumed = PlanOptions()
    peak = ctx.peak_flops
    rows = []
    if ctx.quick:
        llada, sdar = tiny("llada", seed=0).to(ctx.device), tiny("sdar", seed=0).to(ctx.device)
        G, P, batches, row_len, n_rows = 16, 8, (1, 2), 64, 2
    else:
        llada, sdar = full_shape_model(LLADA_8B, ctx), None
        G, P, batches, row_len, n_rows = 256, 128, (1, 32), 2048, 4
    g = torch.Generator().manual_seed(0)

    def rollouts(model, name, configs):
        vocab = model.arch.vocab_size
        for label, cfg in configs:
            for batch in batches:
                prompts = torch.randint(0, min(vocab, 30000) - 16, (batch, P), generator=g).tolist()
                generate(model, prompts[:1], cfg, generator=torch.Generator().manual_seed(1))  # warm-up
                seconds, r = _timed(ctx, lambda: generate(model, prompts, cfg, generator=torch.Generator().manual_seed(1)))
                row = {"what": f"{name} rollout, {label}", "batch": batch, "per s": batch * G / seconds,
                       "unit": "generated tokens", "NFE": r.nfe, "seconds": seconds}
                flops = _flops(lambda: generate(model, prompts, cfg, generator=torch.Generator().manual_seed(1)))
                rows.append(_vs_plan(row, flops, seconds, assumed.rollout_mfu, peak, batch * G))

    block = 8 if ctx.quick else 32
    with torch.no_grad():
        rollouts(llada, "LLaDA-8B" if not ctx.quick else "LLaDA (tiny)", [
            ("dual cache, threshold 0.9", SamplerConfig(gen_length=G, block_length=block, threshold=0.9, cache="dual")),
            (f"no cache, {G // 4} steps", SamplerConfig(gen_length=G, block_length=block, steps=G // 4, cache="none"))])
    # SFT forward + backward on packed rows, every backend, the weights of the rollout model
    names = ["sdpa", "flex"] + (["flash_attn"] if ctx.device.type == "cuda" and _flash_attn() else [])
    model = llada.train()
    model.gradient_checkpointing_enable(True)  # as the full-size recipes train
    for p in model.parameters():
        p.requires_grad_(True)
    lengths = [row_len // 4, row_len // 2, row_len - row_len // 4 - row_len // 2]
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(n_rows, row_len).to(ctx.device)
    ids = torch.randint(0, model.arch.vocab_size - 16, (n_rows, row_len), generator=g).to(ctx.device)
    keep = torch.rand(n_rows, row_len, generator=g).to(ctx.device) < 0.5  # logits only where the loss needs them
    labels = ids[keep]
    layout = model.adapter.packed_layout(pos)
    for name in names:
        model.set_attn_backend(name)

        def step():
            model.zero_grad(set_to_none=True)
            logits = model(ids, layout=layout, request=LogitsRequest(keep=keep)).logits
            torch.nn.functional.cross_entropy(logits.float(), labels).backward()
        step()  # warm-up (flex compiles on CUDA)
        seconds, _ = _timed(ctx, step, repeats=1 if ctx.quick else 3)
        row = {"what": f"SFT forward + backward, {name}", "batch": f"{n_rows} x {row_len}",
               "per s": n_rows * row_len / seconds, "unit": "tokens", "seconds": seconds}
        rows.append(_vs_plan(row, _flops(step), seconds, assumed.train_mfu, peak, n_rows * row_len))
    model.zero_grad(set_to_none=True)
    del model, llada
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    sdar = sdar if sdar is not None else full_shape_model(SDAR_8B, ctx)
    B = sdar.adapter.block_size or 4
    with torch.no_grad():
        rollouts(sdar, "SDAR-8B" if not ctx.quick else "SDAR (tiny)", [
            (f"block cache, block {B}, threshold 0.9",
             SamplerConfig(gen_length=G, block_length=B, steps_per_block=B, threshold=0.9, cache="block"))])
    return rows


# --- 4. the plan against the real step ------------------------------------------------------------------------------


@contextlib.contextmanager
def phase_seconds(ctx: Context):
    """Wall seconds per phase (rollout, score, update) of the steps planned meanwhile, the device synchronised at each
    phase's ends: the planner's phase meter, timed."""
    from dare.plan import planner
    original = planner._PhaseMeter.__call__
    times: dict[str, float] = {}

    @contextlib.contextmanager
    def timed(meter, name):
        ctx.sync()
        start = time.perf_counter()
        with original(meter, name):
            yield
        ctx.sync()
        times[name] = times.get(name, 0.0) + time.perf_counter() - start
    planner._PhaseMeter.__call__ = timed
    try:
        yield times
    finally:
        planner._PhaseMeter.__call__ = original


def plan_configs(quick: bool) -> list[tuple[str, str, list[str]]]:
    """(label, recipe, overrides) of the plan part's two one-GPU configurations."""
    if quick:
        return [("LoRA SFT (tiny)", "recipes/lora_sft_tiny.yaml", []),
                ("d1 + LoRA (tiny)", "recipes/d1_tiny.yaml", ["lora.enabled=true", "reference.mode=lora_disabled"])]
    one = ["distributed.nproc=1", "model.attn_backend=sdpa"]
    return [("LLaDA-8B LoRA SFT", "recipes/lora_sft_llada_8b.yaml", one + ["train.batch_size=2", "train.micro_batch_size=1"]),
            ("LLaDA-8B d1 + LoRA", "recipes/paper/llada_8b_instruct/d1_math.yaml",
             one + ["lora.enabled=true", "reference.mode=lora_disabled", "train.batch_size=1", "rollout.group_size=4",
                    "train.micro_batch_size=2", "rollout.sampler.gen_length=256"])]


def plan(ctx: Context) -> list[dict]:
    """Two one-GPU configurations: ``dare plan --gpus 1``'s peak per phase against the same step on real tensors
    (measured by the planner's own tracker: plan/validate.py), and on CUDA against torch.cuda.max_memory_allocated
    over the real step. Phase seconds of the real step are reported as measured under the trackers (an upper
    bound of the step's time); the time model itself is compared in the speed part (measured against assumed MFU)."""
    from dare.plan.planner import PlanOptions, plan_recipe
    from dare.plan.validate import measure_here
    from dare.trainer.recipe import load_recipe
    configs = plan_configs(ctx.quick)
    target = "cuda" if ctx.device.type == "cuda" else "cpu"
    rows = []
    for label, rel, overrides in configs:
        recipe = load_recipe(ROOT / rel, overrides)
        planned = plan_recipe(recipe, PlanOptions(gpus=1, target=target))
        if planned.error:
            rows.append({"config": label, "phase": "-", "planned GiB": None, "real GiB": None, "ok": False,
                         "note": f"planning failed: {planned.error}"})
            continue
        cuda_peak = None
        if ctx.device.type == "cuda":
            from dare.models.loading import parse_dtype
            model = full_shape_model(recipe.model.path, ctx, dtype=parse_dtype(recipe.model.dtype) or torch.float32)
            torch.cuda.reset_peak_memory_stats(ctx.device)
            with phase_seconds(ctx) as seconds:
                real = plan_recipe(recipe, PlanOptions(gpus=1, target="cuda", simulate=False, model=model)).to_dict()
            cuda_peak = torch.cuda.max_memory_allocated(ctx.device)
            del model
            torch.cuda.empty_cache()
        else:
            with phase_seconds(ctx) as seconds:
                real = measure_here(recipe, PlanOptions(gpus=1, target="cpu"))
        if real.get("error"):
            rows.append({"config": label, "phase": "-", "ok": False, "note": f"the real step failed: {real['error']}"})
            continue
        measured = {p["name"]: p["peak_bytes"] for p in real["phases"]}
        for phase in planned.phases:
            got = measured.get(phase.name)
            dev = None if not got else phase.peak_bytes / got - 1
            rows.append({"config": label, "phase": phase.name, "planned GiB": phase.peak_bytes / GIB,
                         "real GiB (tracker)": None if got is None else got / GIB, "deviation": dev,
                         "max allocated GiB (step)": None if cuda_peak is None else cuda_peak / GIB,
                         "real s (under the trackers)": seconds.get(phase.name), "planned s (full step)": phase.seconds,
                         "ok": dev is not None and abs(dev) <= 0.05})
        if cuda_peak is not None:
            rows.append({"config": label, "phase": "whole step vs max allocated", "planned GiB": planned.peak_bytes / GIB,
                         "max allocated GiB (step)": cuda_peak / GIB, "deviation": planned.peak_bytes / cuda_peak - 1})
    return rows

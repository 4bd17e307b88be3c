"""The routed experts of a sparse-MoE layer as stacked weights, run as grouped GEMMs.

Published MoE checkpoints store each expert's projections as separate tensors (``mlp.experts.{e}.gate_proj.weight``
...). Run as separate modules, LLaDA2.0-mini's 256 experts per layer cost a loop of about ten small kernels per
expert: thousands of launches per forward on a GPU, and thousands of dispatched fake ops per layer in a ``dare plan``
simulation (about 37 CPU minutes to plan one LLaDA2.0-mini RL step). Here the experts of a layer are two stacked
parameters, ``gate_up_proj`` [E, 2I, H] (expert e's gate rows, then its up rows) and ``down_proj`` [E, H, I]. The
(token, slot) pairs the router chose are sorted by expert once, and each projection is one grouped GEMM
(``torch._grouped_mm``) for bf16 inputs, or a loop over the experts that received tokens otherwise (fp32 / fp64,
and devices without the kernel). On CPU both give the same bits as the per-expert ``nn.Linear`` calls they replace.

The layout on disk does not change: loading stacks the published per-expert tensors (``stack_expert_tensors``),
saving splits them back (``split_expert_tensor``). LoRA on the experts (``lora.include_experts``) is what peft puts
on separate ``nn.Linear`` s: per expert and projection, A [E, r, in] and B [E, out, r], run by grouped GEMMs too.
"""
from __future__ import annotations

import math
import re
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import planning

# Native per-expert names as the families map the published checkpoints (and save them back).
_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<param>gate_up_proj|down_proj)$")
_CUDA_GROUPED_FAILED: set = set()  # CUDA devices whose torch build has no grouped-GEMM kernel for them


class Routing(NamedTuple):
    """Where the router sent each token: the flat (token, slot) pairs [T * k] sorted by expert (stable: tokens in
    order within an expert), the token row of each sorted pair, and tokens per expert (a tensor; read back to the
    host only where the per-expert loop needs it, or given as ``host`` where it has no values: a planned routing)."""
    order: torch.Tensor
    rows: torch.Tensor
    counts: torch.Tensor
    host: Optional[tuple[int, ...]] = None

    def offsets(self) -> torch.Tensor:
        return self.counts.cumsum(0).to(torch.int32)

    def host_counts(self) -> list[int]:
        return list(self.host) if self.host is not None else [int(c) for c in self.counts.tolist()]


def route(idx: torch.Tensor, num_experts: int) -> Routing:
    """Sort the router's choices ``idx`` [T, k] by expert. In a ``dare plan`` simulation the router's outputs have
    no values: there every expert gets the same number of tokens (``PlanningSimulation.balanced_routing``)."""
    sim = planning.active()
    if sim is not None and planning.is_fake(idx):
        sim.assume("MoE routing balanced (every expert the same number of tokens)")
        return sim.balanced_routing(idx.shape[0], idx.shape[1], num_experts, idx.device)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return Routing(order, order // idx.shape[1], torch.bincount(flat, minlength=num_experts))


def _grouped_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs this GEMM: bf16 (the dtype its CUDA kernel and its fake-tensor rule take),
    rows aligned to 16 bytes (its stride rule), and a device that has the kernel."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    if (x.shape[-1] * x.element_size()) % 16 or (weight.shape[-2] * weight.element_size()) % 16:
        return False
    return not (x.is_cuda and x.device.index in _CUDA_GROUPED_FAILED)


class _GroupedLinear(torch.autograd.Function):
    """``x @ weight[e].T`` for each expert's rows of ``x`` in one grouped GEMM, both gradients grouped too (the
    gradient is made contiguous first: the kernel rejects the expanded gradients some losses give)."""

    @staticmethod
    def forward(ctx, x, weight, offsets):
        ctx.save_for_backward(x, weight, offsets)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        gx = torch._grouped_mm(grad, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        gw = torch._grouped_mm(grad.t(), x, offs=offsets) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``F.linear`` of each expert's rows of ``x`` [N, in] (sorted by expert) with its ``weight[e]`` [out, in]."""
    if _grouped_kernel(x, weight):
        try:
            return _GroupedLinear.apply(x, weight, routing.offsets())
        except (RuntimeError, NotImplementedError):
            if not x.is_cuda:
                raise
            _CUDA_GROUPED_FAILED.add(x.device.index)  # e.g. a GPU generation this build has no kernel for
    counts = routing.host_counts()
    parts = [F.linear(part, weight[e]) for e, part in enumerate(x.split(counts)) if counts[e]]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[-2])


PROJECTIONS = ("gate", "up", "down")


class ExpertLoRA(nn.Module):
    """peft's LoRA on each expert's ``projections`` (of gate, up, down), stacked: ``x @ A[e].T @ B[e].T * scaling``
    with A [E, r, in] and B [E, out, r] (B starts at zero)."""

    def __init__(self, experts: "GroupedExperts", r: int, alpha: float, dropout: float, projections=PROJECTIONS):
        super().__init__()
        E, I, H = experts.num_experts, experts.intermediate_size, experts.hidden_size
        like = experts.down_proj
        kw = {"dtype": like.dtype, "device": like.device}
        self.projections = tuple(p for p in PROJECTIONS if p in projections)
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        for name in self.projections:
            fan_in, fan_out = (I, H) if name == "down" else (H, I)
            self.register_parameter(f"lora_A_{name}", nn.Parameter(torch.empty(E, r, fan_in, **kw)))
            self.register_parameter(f"lora_B_{name}", nn.Parameter(torch.zeros(E, fan_out, r, **kw)))

    def init_A(self, generator: Optional[torch.Generator]) -> None:
        """peft's default init of A (kaiming-uniform, a = sqrt 5), drawn in the order peft's separate modules would
        draw it: expert by expert, gate, up, down."""
        mats = [getattr(self, f"lora_A_{name}") for name in self.projections]
        with torch.no_grad():
            for e in range(mats[0].shape[0] if mats else 0):
                for a in mats:
                    w = torch.empty(a.shape[1:], dtype=torch.float32)
                    nn.init.kaiming_uniform_(w, a=math.sqrt(5), generator=generator)
                    a[e].copy_(w.to(a.dtype))

    def delta(self, x: torch.Tensor, name: str, routing: Routing) -> Optional[torch.Tensor]:
        if name not in self.projections:
            return None
        a, b = getattr(self, f"lora_A_{name}"), getattr(self, f"lora_B_{name}")
        return grouped_linear(grouped_linear(self.dropout(x), a, routing), b, routing) * self.scaling

    def delta_weight(self, name: str) -> Optional[torch.Tensor]:
        """B @ A * scaling per expert [E, out, in] (what merging adds to the weights), None if not adapted."""
        if name not in self.projections:
            return None
        return (getattr(self, f"lora_B_{name}") @ getattr(self, f"lora_A_{name}")) * self.scaling


class GroupedExperts(nn.Module):
    """E SwiGLU experts held as ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.lora: Optional[ExpertLoRA] = None
        self._disable_adapters = False  # the flag peft's layers carry (``dare.models.lora.adapters_disabled``)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Expert outputs [N, H] of the rows of ``x`` [N, H] sorted by expert (``routing``)."""
        gate_up = grouped_linear(x, self.gate_up_proj, routing)
        gate, up = gate_up.chunk(2, dim=-1)
        lora = None if self._disable_adapters else self.lora
        if lora is not None:
            gate, up = (t if d is None else t + d for t, d in ((gate, lora.delta(x, "gate", routing)),
                                                                (up, lora.delta(x, "up", routing))))
        if torch.is_grad_enabled():
            h = F.silu(gate) * up
        else:  # inference: the GEMM's output is a scratch tensor
            h = F.silu(gate, inplace=True).mul_(up)
        out = grouped_linear(h, self.down_proj, routing)
        d = lora.delta(h, "down", routing) if lora is not None else None
        return out if d is None else out + d

    # --- LoRA (driven by dare.models.lora) ------------------------------------------------------------------------
    def add_lora(self, r: int, alpha: float, dropout: float, projections=PROJECTIONS) -> None:
        self.lora = ExpertLoRA(self, r, alpha, dropout, projections)

    def merge_lora(self) -> None:
        """Fold the adapters into the stacked weights (as peft's ``merge``: W += B @ A * scaling) and drop them."""
        lora, I = self.lora, self.intermediate_size
        if lora is None:
            return
        with torch.no_grad():
            for rows, name in ((slice(0, I), "gate"), (slice(I, 2 * I), "up")):
                d = lora.delta_weight(name)
                if d is not None:
                    self.gate_up_proj[:, rows] += d.to(self.gate_up_proj.dtype)
            d = lora.delta_weight("down")
            if d is not None:
                self.down_proj += d.to(self.down_proj.dtype)
        self.lora = None

    def init_like_separate(self, std: float, generator: Optional[torch.Generator]) -> None:
        """Normal init drawn in the order separate per-expert ``nn.Linear`` s are listed (gate, up, down of expert
        0, then of expert 1 ...), so a tiny random model keeps the weights it had before the experts were stacked."""
        I = self.intermediate_size
        with torch.no_grad():
            for e in range(self.num_experts):
                for w in (self.gate_up_proj[e, :I], self.gate_up_proj[e, I:], self.down_proj[e]):
                    w.normal_(0.0, std, generator=generator)


# --- the published layout ------------------------------------------------------------------------------------------
def stack_expert_tensors(state: dict[str, torch.Tensor], expected: dict) -> tuple[dict[str, torch.Tensor], list]:
    """``state`` with every layer's per-expert ``{gate,up,down}_proj.weight`` tensors replaced by the stacked
    parameters the model expects, and ``[(per-expert name, its shape, the shape the model expects)]`` of the tensors
    that do not fit. Incomplete sets stay per expert, so the checked load names what is missing."""
    groups: dict[str, dict] = {}
    for key in state:
        m = _PER_EXPERT.match(key)
        if m and f"{m['prefix']}.gate_up_proj" in expected:
            groups.setdefault(m["prefix"], {})[(int(m["e"]), m["proj"])] = key
    out, bad = dict(state), []
    projs = ("gate_proj", "up_proj", "down_proj")
    for prefix, keys in groups.items():
        E, two_i, H = expected[f"{prefix}.gate_up_proj"].shape
        want = {"gate_proj": (two_i // 2, H), "up_proj": (two_i // 2, H), "down_proj": (H, two_i // 2)}
        if set(keys) != {(e, p) for e in range(E) for p in projs}:
            continue
        wrong = [(keys[(e, p)], tuple(state[keys[(e, p)]].shape), want[p]) for e in range(E) for p in projs
                 if tuple(state[keys[(e, p)]].shape) != want[p]]
        if wrong:
            bad += wrong
            continue
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([out.pop(keys[(e, "gate_proj")]), out.pop(keys[(e, "up_proj")])])
                                                     for e in range(E)])
        out[f"{prefix}.down_proj"] = torch.stack([out.pop(keys[(e, "down_proj")]) for e in range(E)])
    return out, bad


def split_expert_tensor(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The per-expert tensors (native names) of a stacked expert parameter; ``[(key, tensor)]`` for anything else."""
    m = _STACKED.match(key)
    if m is None:
        return [(key, tensor)]
    prefix = m["prefix"]
    if m["param"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    half = tensor.shape[1] // 2
    return [(f"{prefix}.{e}.{proj}.weight", part) for e in range(tensor.shape[0])
            for proj, part in (("gate_proj", tensor[e, :half]), ("up_proj", tensor[e, half:]))]


def per_expert_names(key: str, num_experts: int) -> list[str]:
    """Native per-expert names behind a stacked parameter's name (for error messages); ``[key]`` otherwise."""
    m = _STACKED.match(key)
    if m is None:
        return [key]
    projs = ("down_proj",) if m["param"] == "down_proj" else ("gate_proj", "up_proj")
    return [f"{m['prefix']}.{e}.{p}.weight" for e in range(num_experts) for p in projs]


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of ``torch._grouped_mm``: [M, K] x [E, K, N] (per-group rows) or [M, K] x [K, N] split along K."""
    if len(b_shape) == 3 and len(a_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:  # batched
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    return 2 * a_shape[0] * a_shape[1] * b_shape[-1]


def _register_flop_formula() -> None:
    """torch's FLOP counter has no formula for the grouped GEMM (it counts 0): give it one."""
    try:
        from torch.utils.flop_counter import flop_registry, register_flop_formula
    except ImportError:
        return
    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None or op.default in flop_registry or op in flop_registry:
        return
    register_flop_formula(op)(_grouped_mm_flops)


_register_flop_formula()

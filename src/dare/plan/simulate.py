"""Run dare's own training code at full size on a CPU without the memory: fake weights and activations, real data.

``Simulation`` stacks two dispatch modes. ``FakeTensorMode`` gives every tensor that touches a weight (parameters,
activations, logits, gradients, optimizer states, KV caches) shape, dtype and storage size but no data, so an 8B
model "runs" in seconds and bytes can be counted. ``_RealData`` above it runs, for real, every op whose inputs are
all real tensors and every small factory: token ids, attention and block masks, position ids, noise levels and
the masks drawn from ``torch.Generator``s are computed exactly as in training, so the data-dependent checks and
indexing of the model and the algorithms (``bool(mask.all())``, ``mask.nonzero()``, packed rows) see the values a
real step sees. What cannot be known without weights is answered by a stated assumption, counted in
``Simulation.assumptions``:

- a Python scalar read from a fake tensor (``.item()``, ``bool(...)`` of a loss or a logit): True / 1 / 1.0;
- ``nonzero`` of a fake tensor: every element selected (the largest shape, an upper bound on memory);
- MoE routing (``dare.models.experts.route``): every expert receives the same number of tokens
  (balanced routing; a real step's imbalance is not modelled);
- with ``cuda_kernels``, attention (``dare.models.modules.planned_attention``) is CUDA's memory-efficient
  kernel, as on a GPU, instead of the CPU kernel a fake CPU tensor would take.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from ..models import planning
from ..models.planning import is_fake

aten = torch.ops.aten

# A factory (no tensor input) is materialised for real below this size, except FSDP's own buffers (always fake).
# Generator draws are always real, so the noise of a planned step is the noise of a real step. A fake value
# written into a real tensor (a loss assembled chunk by chunk into a buffer) leaves the buffer's values stale, but
# autograd records the write, so the backward through the model still runs in full.
REAL_FACTORY_BYTES = 32 * 2**20

_state: dict = {"propagating": 0, "fsdp": 0}


def _meta_outputs(func, args, kwargs) -> Optional[list]:
    """The outputs of a factory op as meta tensors (shape and dtype without memory), None if it has no device."""
    try:
        kw = dict(kwargs)
        kw["device"] = "meta"
        kw.pop("pin_memory", None)
        out = func(*args, **kw)
    except Exception:
        return None
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


_UNINITIALISED = (aten.empty.memory_format, aten.empty_strided.default)
_INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)


def _bool_indices_as_long(func, args):
    """A real bool mask indexing a fake tensor: its positions are known, so give the fake side the equivalent
    long indices (a fake tensor cannot take a bool index: its result size would be unknown)."""
    indices = list(args[1])
    out = []
    for ix in indices:
        if isinstance(ix, torch.Tensor) and not is_fake(ix) and ix.dtype == torch.bool:
            with _disable_current_modes():
                out.extend(ix.nonzero(as_tuple=True))
        else:
            out.append(ix)
    return (args[0], out, *args[2:])


_GROUPED_MM = getattr(aten, "_grouped_mm", None)
_GROUPED_MM = _GROUPED_MM.default if _GROUPED_MM is not None else None


def _grouped_mm_output(a, b, offs=None, bias=None, out_dtype=None):
    """``torch._grouped_mm``'s output in fp32 / fp64: the CPU kernel takes them (transformers' MoE experts call it
    there), its fake-tensor rule only bf16. The same output shapes as that rule."""
    if a.dim() == 2 and b.dim() == 2:
        size = (offs.shape[0], a.shape[0], b.shape[1])
    elif a.dim() == 2:
        size = (a.shape[0], b.shape[-1])
    elif b.dim() == 2:
        size = (a.shape[1], b.shape[1])
    else:
        size = (a.shape[0], a.shape[1], b.shape[-1])
    return torch.empty(size, dtype=out_dtype or a.dtype, device=a.device)


class _RealData(TorchDispatchMode):
    def __init__(self, sim: "Simulation"):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        fake = any(is_fake(t) for t in tensors)
        if not fake and self._run_real(func, tensors, args, kwargs):
            with _disable_current_modes():
                out = func(*args, **kwargs)
                if func in _UNINITIALISED and out.is_floating_point():
                    out.zero_()  # a buffer a fake value will be written into: stale zeros, never NaN garbage
                return out
        if fake and func in _INDEXING:
            args = _bool_indices_as_long(func, args)
        if fake and func is aten._local_scalar_dense.default:
            dtype = args[0].dtype
            self.sim.assume(f"scalar read from a fake tensor ({dtype}) taken as {'True' if dtype == torch.bool else 1}")
            return True if dtype == torch.bool else (1 if not dtype.is_floating_point else 1.0)
        if fake and func is _GROUPED_MM and args[0].dtype != torch.bfloat16:
            return _grouped_mm_output(*args, **kwargs)
        if fake and func is aten.nonzero.default:
            x = args[0]
            self.sim.assume("nonzero of a fake tensor: every element selected")
            return torch.empty((x.numel(), x.dim()), dtype=torch.long, device=x.device)
        return func(*args, **kwargs)

    @staticmethod
    def _run_real(func, tensors, args, kwargs) -> bool:
        if tensors:
            return True
        if kwargs.get("generator") is not None:
            return True
        if _state["propagating"]:  # DTensor's metadata tensors: never data (and never worth zero-filling)
            return False
        meta = _meta_outputs(func, args, kwargs)
        if meta is None:
            return False
        # FSDP's buffers become parameters and gradients: fake, or garbage would reach the gradient norm.
        if _state["fsdp"] and any(t.is_floating_point() for t in meta):
            return False
        return sum(t.numel() * t.element_size() for t in meta) <= REAL_FACTORY_BYTES


def propagating() -> bool:
    """True while DTensor derives an op's output metadata (fake tensors that are no allocation of the step)."""
    return _state["propagating"] > 0


@contextlib.contextmanager
def _wrapped(owner, names, wrap):
    """While inside, ``owner.<name>`` is ``wrap(original)`` for each of ``names`` (restored on exit)."""
    originals = {name: getattr(owner, name) for name in names if hasattr(owner, name)}
    for name, fn in originals.items():
        setattr(owner, name, wrap(fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(owner, name, fn)


def _counting(owner, names, key: str):
    """While inside, every call of ``owner.<name>`` is counted in ``_state[key]``."""
    def counted(fn):
        def inner(*args, **kwargs):
            _state[key] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                _state[key] -= 1
        return inner
    return _wrapped(owner, names, counted)


def _mark_propagation():
    """DTensor computes output metadata under the active fake mode when there is one (ours), so a memory tracker
    would count those metadata tensors as allocations. Mark the calls, so the planner's trackers skip them."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    return _counting(ShardingPropagator, ("_propagate_tensor_meta_non_cached",), "propagating")


_FSDP_METHODS = ("lazy_init", "unshard", "wait_for_unshard", "reshard", "pre_forward", "post_forward", "pre_backward",
                 "post_backward", "finalize_backward", "_to_sharded", "_to_unsharded", "_to_sharded_post_forward")


def _mark_fsdp():
    """Mark the calls of FSDP2's parameter-group machinery (all-gather, reduce-scatter, resharding)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    return _counting(FSDPParamGroup, _FSDP_METHODS, "fsdp")


# Lists longer than this are split. DTensor derives a foreach op's sharding by walking every argument once per
# tensor of the list (quadratic in its length: an optimizer step over LLaDA2.0-mini's 20 x 256 experts' DTensors took
# minutes); foreach ops are elementwise per list entry, so running them chunk by chunk is the same computation.
FOREACH_CHUNK = 64


def _chunked(fn):
    def inner(*args, **kwargs):
        n = len(args[0]) if args and isinstance(args[0], (list, tuple)) else 0
        if n <= FOREACH_CHUNK:
            return fn(*args, **kwargs)

        def part(a, lo):
            return a[lo:lo + FOREACH_CHUNK] if isinstance(a, (list, tuple)) and len(a) == n else a
        outs = [fn(*(part(a, lo) for a in args), **{k: part(v, lo) for k, v in kwargs.items()})
                for lo in range(0, n, FOREACH_CHUNK)]
        if all(o is None for o in outs):
            return None
        return [t for o in outs for t in o]
    return inner


def _chunked_foreach():
    """While inside, ``torch._foreach_*`` run over lists in chunks of ``FOREACH_CHUNK`` (see there)."""
    return _wrapped(torch, [n for n in dir(torch) if n.startswith("_foreach_")], _chunked)


def real_data():
    """A context in which tensors are made for real (the planner's stand-in data), whatever modes are active."""
    return _disable_current_modes()


class Simulation:
    """Context of one planning run: ``fake`` (the FakeTensorMode), the assumptions it had to make."""

    def __init__(self, cuda_kernels: bool = False):
        from torch._subclasses.fake_tensor import FakeTensorMode
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.cuda_kernels = cuda_kernels  # plan the memory of the kernels a GPU runs (``planned_attention``)
        self.assumptions: Counter = Counter()
        self._routing: dict = {}  # balanced_routing's cache
        self._stack: Optional[contextlib.ExitStack] = None

    def assume(self, what: str) -> None:
        self.assumptions[what] += 1

    def balanced_routing(self, num_tokens: int, top_k: int, num_experts: int, device):
        """``dare.models.experts.Routing`` that gives every expert the same number of tokens (+-1), k distinct
        experts per token. Made once per shape (every MoE layer of a pass routes alike) as fake tensors, so they are
        not converted at each use."""
        from ..models.experts import Routing
        key = (num_tokens, top_k, num_experts, str(device))
        if key not in self._routing:
            with _disable_current_modes():
                flat = torch.arange(num_tokens * top_k, device=device) % num_experts
                order = torch.argsort(flat, stable=True)
                counts = torch.bincount(flat, minlength=num_experts)
                self._routing[key] = Routing(*(self.fake.from_tensor(t) for t in (order, order // top_k, counts)),
                                             host=tuple(counts.tolist()))
        return self._routing[key]

    def __enter__(self) -> "Simulation":
        planning.set_active(self)  # first: a second simulation is refused before anything is entered
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(_mark_propagation())
        self._stack.enter_context(_mark_fsdp())
        self._stack.enter_context(_chunked_foreach())
        self._stack.enter_context(self.fake)
        self._stack.enter_context(_RealData(self))
        return self

    def __exit__(self, *exc) -> None:
        planning.set_active(None)
        self._stack.__exit__(*exc)

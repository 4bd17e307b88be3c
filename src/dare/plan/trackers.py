"""The memory trackers of a planned step: torch's ``FSDPMemTracker`` / ``MemTracker``, made to keep only the global
peak, to forget a root module called again (a step has several micro-batches and scoring passes), and to ignore
DTensor's metadata propagation; and the category names of their snapshots as the plan tables show them."""
from __future__ import annotations


def _optimizers(built) -> list:
    """The policy's optimizer and the companion models'."""
    return [built.optimizer, *[c.optimizer for c in built.companions.items.values()]]


def _fast_peak(self, peak_state) -> None:
    """The global peak only (the trackers' per-module peaks cost O(modules) per op, and a plan reads none)."""
    for dev, snap in self._curr_mem_snap.items():
        if self._peak_mem.get(dev, 0) < snap["Total"]:
            self._peak_mem[dev] = snap["Total"]
            self._peak_mem_snap[dev] = dict(snap)


def _forget_repeated_root(self, module) -> None:
    """The trackers refuse a top-level module called a second time in forward ("multiple iterative calls"): a step
    has several micro-batches and scoring passes. Their per-module statistics are not used; start them afresh."""
    if module in self.memory_tracking and not self._mod_tracker.is_bw:
        fqn = self._mod_tracker.get_known_fqn(module)
        if fqn is not None and self._mod_tracker.parents - {fqn} == {"Global"}:
            del self.memory_tracking[module]


def _skip_propagation(cls):
    """A tracker class that ignores DTensor's metadata propagation (``simulate.propagating``)."""
    from .simulate import propagating

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if propagating():
            return func(*args, **(kwargs or {}))
        return cls.__torch_dispatch__(self, func, types, args, kwargs)
    return __torch_dispatch__


def _tracker(built, fsdp: bool):
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType
    from torch.distributed._tools.mem_tracker import MemTracker

    extra = [m for m in (getattr(built.reference, "module", None), *built.companions.modules().values()) if m is not None]
    if fsdp:
        class PlanFSDPTracker(FSDPMemTracker):
            _update_peak_stats = _fast_peak
            __torch_dispatch__ = _skip_propagation(FSDPMemTracker)

            def _fsdp_state_pre_forward(self, fsdp_mod, orig):
                inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

                def pre_forward(*args, **kwargs):
                    _forget_repeated_root(self, fsdp_mod)
                    return inner(*args, **kwargs)
                return pre_forward

        tracker = PlanFSDPTracker(built.model, built.optimizer)
        for module in extra:  # FSDPMemTracker follows the policy only; the other models' shards are parameters too
            for p in module.parameters():
                tracker._update_and_maybe_create_winfos(p.to_local() if hasattr(p, "to_local") else p, _FSDPRefType.SHARDED_PARAM)
    else:
        class PlanTracker(MemTracker):
            _update_peak_stats = _fast_peak
            __torch_dispatch__ = _skip_propagation(MemTracker)

            def _pre_fw_hook(self, module, inputs):
                _forget_repeated_root(self, module)
                super()._pre_fw_hook(module, inputs)

        tracker = PlanTracker()
        # MemTracker hooks every parameter's gradient, and a frozen one (a reference copy, LoRA's base) refuses a
        # hook: mark those as hooked with a handle that removes nothing.
        from types import SimpleNamespace
        no_hook = SimpleNamespace(remove=lambda: None)
        for module in (built.model, *extra):
            for p in module.parameters():
                if not p.requires_grad:
                    tracker._param_to_grad_hook_handles[p] = (no_hook, no_hook)
        tracker.track_external(built.model, *extra, *_optimizers(built))
    return tracker


_CATEGORIES = {"Sharded Param": "parameters", "Parameter": "parameters", "Unsharded Param": "gathered parameters",
               "Buffer": "buffers", "Sharded Grad": "gradients", "Gradient": "gradients",
               "Unsharded Grad": "unsharded gradients", "Activation": "activations", "Temp": "backward temporaries",
               "All Gather": "all-gather buffers", "Reduce Scatter": "reduce-scatter buffers",
               "OptState": "optimizer states", "Optstate": "optimizer states", "Inputs": "inputs", "Other": "other"}


def _snapshot(snap: dict) -> dict:
    out: dict = {}
    for k, v in snap.items():
        name = getattr(k, "value", k)
        if name == "Total" or not v:
            continue
        label = _CATEGORIES.get(name, str(name))
        out[label] = out.get(label, 0) + int(v)
    return out

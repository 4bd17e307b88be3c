"""Repeated forwards of a planned step, simulated until they repeat themselves and then replayed.

Some methods score many forwards of the same shapes without gradients: d-OPSD's teacher runs one forward per
recorded denoising state (a 256-step rollout: 256 states per sample, each a forward of the whole 7B model), d2 and
TraceRL replay their traces. On fake tensors every one of them costs as much CPU as a real forward dispatches ops
(an 8B forward is ~2 s here), while none of them can hold memory another one of the same shapes does not: a no-grad
forward frees what it made except its output. So in the **score** phase, a forward of a model whose inputs have the
shapes of earlier ones (tensor shapes and dtypes, the non-zero count of boolean and float data, the other arguments
equal) is not simulated again:

* it runs for real (on fake tensors) until two runs in a row agree: the same FLOPs and the same transient memory
  (the peak above what was allocated when it began), per category. The first can differ from the rest (measured on
  the tiny d-OPSD: its first teacher forward peaked 31 KB lower; a unit's first backward allocates the gradients
  the others add to);
* then a call allocates an output of the same shapes, adds the last real run's FLOPs to the phase, and raises the
  phase's peak wherever what is allocated at that moment plus that run's transient passes it;
* after ``CHECK_EVERY`` (8) replays one call runs for real again; if it disagrees, the key is never replayed again,
  and each check that agrees doubles the replays before the next one (up to 64).

The same holds in the **update** phase for the per-view forward + backward units of
``dare.algorithms.common.scoring.backward_each_view`` (one graph alive at a time; d-OPSD distils one state per unit,
TraceRL and d2 replay trace steps): after the step's first unit the gradients exist and every further unit adds to
them in place, so a unit, too, leaves nothing behind but the loss value and metrics it returns. A unit is keyed by
its view's shapes only, since what it scores also comes from the batch's state; the agreement of real runs decides.

Other forwards with gradients (activations kept for a later backward), forwards with a KV cache (state the next
forward reads) and the rollout probes always run. ``tests/plan/test_plan.py`` holds every RL method's tiny plan
equal to its plan without replays, to the byte and the FLOP.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Optional

import torch


def _signature(value, counts: bool = True):
    """What decides a forward's memory and FLOPs: tensors by shape / dtype / device and (``counts``) a real (data)
    tensor of bools or floats also by how many of its entries are non-zero (a padding mask decides whether a forward
    builds a mask at all); dataclasses (layouts, logits requests, views) field by field, containers item by item,
    everything else by value."""
    if isinstance(value, torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor
        count = None
        if counts and not isinstance(value, FakeTensor) and (value.dtype == torch.bool or value.is_floating_point()):
            count = int(torch.count_nonzero(value))
        return ("T", tuple(value.shape), value.dtype, value.device.type, count)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple(_signature(getattr(value, f.name), counts)
                                            for f in dataclasses.fields(value)))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v, counts) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _signature(v, counts)) for k, v in value.items())))
    if isinstance(value, slice):
        return ("slice", value.start, value.stop, value.step)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return (type(value).__name__, id(value))  # unknown objects: equal only to themselves


CHECK_EVERY = 8  # replays of a key before the first real run that checks it; each agreeing check doubles it
MAX_CHECK_EVERY = 64


@dataclasses.dataclass(frozen=True)
class _Spec:
    shape: tuple
    dtype: torch.dtype
    device: torch.device


def _template(out):
    """``out`` with its tensors replaced by their specs (so the record holds no memory the tracker would count)."""
    if isinstance(out, torch.Tensor):
        return _Spec(tuple(out.shape), out.dtype, out.device)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: _template(getattr(out, f.name)) for f in dataclasses.fields(out)
                                           if f.init})
    if isinstance(out, (list, tuple)):
        return type(out)(_template(v) for v in out)
    return out


def _output_like(template):
    """A fresh (fake) output of a ``_template``: new empty tensors in the same structure."""
    if isinstance(template, _Spec):
        return torch.empty(template.shape, dtype=template.dtype, device=template.device)
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        return dataclasses.replace(template, **{f.name: _output_like(getattr(template, f.name))
                                                for f in dataclasses.fields(template) if f.init})
    if isinstance(template, (list, tuple)):
        return type(template)(_output_like(v) for v in template)
    return template


@dataclasses.dataclass
class _KeyRecord:
    last: Optional["_Recorded"] = None  # the last real run
    agreed: bool = False  # its FLOPs and transient equal the real run before it
    broken: bool = False  # a check after replays disagreed: this key is always run
    since_check: int = 0  # replays since the last real run
    interval: int = CHECK_EVERY  # replays between checks


@dataclasses.dataclass
class _Recorded:
    output: object  # what the run kept of its result (a forward's output _template; a unit's loss and metrics)
    flops: int
    transient: dict  # device -> {category: bytes above the call's start at its peak}; "Total" included


class NoGradReplay:
    """Installed on the models of a planned step (``install``). ``meter`` is the planner's phase meter (``current``
    phase name, ``counter``: the phase's FLOP counter); ``tracker`` the memory tracker whose peak (``_peak_mem`` /
    ``_peak_mem_snap`` per device over ``_curr_mem_snap``) the replays raise.

    Two kinds of repetition: no-grad forwards of a model in the score phase (``_wrap``), and the per-view forward +
    backward units of ``backward_each_view`` in the update phase (``unit``; after the first unit of a step the
    gradients exist and each further one adds to them in place, so a unit too leaves nothing but what it returns)."""

    def __init__(self, meter, tracker):
        self.meter, self.tracker = meter, tracker
        self.recorded: dict = {}
        self.replayed = 0

    @contextlib.contextmanager
    def install(self, modules):
        originals = []
        for m in {id(m): m for m in modules if m is not None}.values():
            originals.append((m, m.__dict__.get("forward")))
            m.forward = self._wrap(m, m.forward)
        try:
            yield self
        finally:
            for m, original in originals:
                if original is None:
                    del m.forward
                else:
                    m.forward = original

    def _wrap(self, module, forward: Callable) -> Callable:
        adapters = [m for m in module.modules() if hasattr(m, "_disable_adapters")]  # LoRA layers (peft)

        def replayable(*args, **kwargs):
            if (self.meter.current != "score" or torch.is_grad_enabled()
                    or kwargs.get("past_key_values") is not None):
                return forward(*args, **kwargs)
            # LoRA's disabled adapters (the reference of lora_disabled) are another forward of the same module
            state = (module.training, torch.is_autocast_enabled(), tuple(m._disable_adapters for m in adapters[:1]))
            key = (id(module), state, _signature(args), _signature(kwargs))
            return self._run(key, lambda: forward(*args, **kwargs), _template, _output_like)
        return replayable

    def unit(self, key, run: Callable):
        """``backward_each_view``'s runner: a view's forward + backward (``run() -> (loss value, metrics)``)."""
        if self.meter.current != "update":
            return run()
        # Shapes only: what a unit scores comes from the batch's state as well as the view (d-OPSD's states mask
        # different positions of one shape and score a fixed number of them; MDPO's steps score different numbers),
        # so whether the key decides a unit is left to the agreement of real runs (``_run``).
        return self._run(("unit", _signature(key, counts=False)), run, lambda out: out, lambda out: out)

    def _run(self, key, run: Callable, keep: Callable, again: Callable):
        """``run()`` until two real runs of ``key`` in a row agree (FLOPs and transient memory, per category); then
        replays of the last one (``again`` of what ``keep`` kept of its result, its FLOPs, the peak raised by its
        transient), checked by a real run after 8, 16, 32, 64, 64, ... replays: one that disagrees ends the key's
        replays."""
        rec = self.recorded.setdefault(key, _KeyRecord())
        if rec.agreed and not rec.broken and rec.since_check < rec.interval:
            rec.since_check += 1
            return again(self._replay(rec.last))
        out, new = self._measure(run, keep)
        if rec.last is not None:
            same = new.flops == rec.last.flops and new.transient == rec.last.transient
            rec.broken = rec.broken or (rec.agreed and not same)  # a check that found the key does not decide
            if rec.agreed and same:  # a check that agreed: the next one comes twice as late
                rec.interval = min(2 * rec.interval, MAX_CHECK_EVERY)
            rec.agreed = same
        rec.last, rec.since_check = new, 0
        return out

    def _measure(self, run: Callable, keep: Callable):
        t = self.tracker
        start = {dev: dict(snap) for dev, snap in t._curr_mem_snap.items()}
        saved_peak, saved_snap = dict(t._peak_mem), {dev: dict(s) for dev, s in t._peak_mem_snap.items()}
        t._peak_mem = {dev: snap["Total"] for dev, snap in start.items()}
        t._peak_mem_snap = {dev: dict(snap) for dev, snap in start.items()}
        flops0 = self.meter.counter.get_total_flops()
        try:
            out = run()
        finally:
            within, within_snap = dict(t._peak_mem), {dev: dict(s) for dev, s in t._peak_mem_snap.items()}
            t._peak_mem, t._peak_mem_snap = saved_peak, saved_snap
            for dev, peak in within.items():  # the phase's peak: the larger of before and within the call
                if peak > t._peak_mem.get(dev, -1):
                    t._peak_mem[dev], t._peak_mem_snap[dev] = peak, within_snap[dev]
        transient = {dev: {k: v - start.get(dev, {}).get(k, 0) for k, v in snap.items()}
                     for dev, snap in within_snap.items()}
        return out, _Recorded(keep(out), self.meter.counter.get_total_flops() - flops0, transient)

    def _replay(self, seen: _Recorded):
        t = self.tracker
        for dev, extra in seen.transient.items():
            now = t._curr_mem_snap.get(dev)
            if now is None:
                continue
            if now["Total"] + extra.get("Total", 0) > t._peak_mem.get(dev, -1):
                snap = {k: now.get(k, 0) + extra.get(k, 0) for k in set(now) | set(extra)}
                t._peak_mem[dev], t._peak_mem_snap[dev] = snap["Total"], snap
        self.meter.counter.total += seen.flops
        self.replayed += 1
        return seen.output


def replaying(meter, tracker, modules, enabled: bool = True) -> Optional[contextlib.AbstractContextManager]:
    """``NoGradReplay(meter, tracker).install(modules)``, or a null context when not ``enabled``."""
    return NoGradReplay(meter, tracker).install(modules) if enabled else contextlib.nullcontext()

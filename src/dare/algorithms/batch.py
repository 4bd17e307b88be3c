"""What the hooks read and return: the typed RL batch, views, likelihood estimates and advantages.

Every container here is a set of per-sample fields (sample dimension first) that is sliced as one into
micro-batches (``select`` / ``split``) and moved as one (``to``): tensors ``[B, ...]``, lists of B items, dicts of
those per inner iteration, views, and dataclasses of per-sample tensors. A field whose ``metadata`` has
``"batch": True`` belongs to the whole step and is kept as it is.

* ``RLBatch``: one step of RL samples. Its fields say their shapes and which stage fills them: the rollout (1) and
  reward (2) stages (``dare.trainer.rl.RolloutStage.collect``, or a method's own ``collect``), the prepare stage (3)
  (``dare.trainer.stages.prepare``: the method's ``prepare`` state, the views of every inner iteration, old /
  reference log-probs, companion scores) and the advantage stage (4) (the method's ``advantages``). Hooks read
  attributes and return what they compute; the loop stores it.
* ``Batch``: the SFT and preference batches the data sources build (``dare.trainer.data``), named fields.
* ``View``, ``LogLik``, ``Advantages``: one forward's input and targets, a likelihood estimate, the advantages.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..rollout.result import Rollout


def _select(value: Any, idx: torch.Tensor, size: int, key: str):
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 or value.shape[0] != size:
            raise ValueError(f"batch field {key!r} has shape {tuple(value.shape)}; per-sample fields need {size} rows "
                             f"(put batch-level values in a batch-level field)")
        return value[idx.to(value.device)]
    if hasattr(value, "select") and not isinstance(value, (list, dict)):
        return value.select(idx)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # TokenLayout, rollout Trajectory, ...
        return dataclasses.replace(value, **{f.name: _select_or_keep(getattr(value, f.name), idx, size)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, dict):
        return {k: _select(v, idx, size, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        if value and all(isinstance(v, View) for v in value):
            return [v.select(idx) for v in value]
        if len(value) != size:
            raise ValueError(f"batch field {key!r} is a list of {len(value)} items, expected one per sample ({size})")
        return [value[i] for i in idx.tolist()]
    if value is None:
        return None
    raise TypeError(f"batch field {key!r}: cannot slice a {type(value).__name__} per sample")


def _select_or_keep(value: Any, idx: torch.Tensor, size: int):
    """Dataclass fields: per-sample tensors are sliced, anything else (sizes, names) is kept."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
        return value[idx.to(value.device)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _select(value, idx, size, type(value).__name__)
    return value


def _to(value: Any, device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, View):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _to(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], View):
        return [v.to(device) for v in value]
    return value


def batch_field(default=None, **kw):
    """A field of the whole step (not sliced per sample)."""
    return field(default=default, metadata={"batch": True}, **kw)


class Rows:
    """Slicing of a dataclass of per-sample fields (see the module docstring); ``size`` is the sample count."""

    @property
    def size(self) -> int:
        raise NotImplementedError

    def __len__(self) -> int:
        return self.size

    def select(self, idx):
        idx = torch.as_tensor(idx, dtype=torch.long)
        n = self.size
        return dataclasses.replace(self, **{f.name: _select(getattr(self, f.name), idx, n, f.name)
                                            for f in dataclasses.fields(self) if not f.metadata.get("batch")})

    def split(self, micro_batch_size: int) -> list:
        n = self.size
        return [self.select(torch.arange(s, min(n, s + micro_batch_size))) for s in range(0, n, max(1, micro_batch_size))]

    def to(self, device):
        return dataclasses.replace(self, **{f.name: _to(getattr(self, f.name), device) for f in dataclasses.fields(self)})


@dataclass
class View(Rows):
    """One corrupted model input (one forward pass) and the positions whose log-probability it scores.

    ``targets``/``labels``/``weight`` are ``[B, L]`` over the scored part of the input (``L`` can be shorter than
    ``input_ids``: a block-diffusion ``[x_t ; x_0]`` input scores its first half). ``score_index [B, K]`` maps the
    ``[B, L]`` log-probs to the estimator's K slots (e.g. the completion positions of an RL sample); None keeps
    the ``[B, L]`` grid. ``info`` holds per-sample extras such as the timestep ``t``.
    """
    input_ids: torch.Tensor
    targets: torch.Tensor
    labels: torch.Tensor
    weight: Optional[torch.Tensor] = None
    attention_mask: Optional[torch.Tensor] = None
    position_ids: Optional[torch.Tensor] = None
    layout: Any = None
    score_index: Optional[torch.Tensor] = None
    info: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class LogLik:
    """A likelihood estimate: ``value [B, K]`` (K token slots, or K = 1 for a sequence-level estimate), fp32, and
    the mean entropy of the same slots when asked for."""
    value: torch.Tensor
    entropy: Optional[torch.Tensor] = None


@dataclass
class Advantages(Rows):
    """What a method's ``advantages`` hook returns. ``values``: per sample ``[B]``, per step ``[B, S]`` (MDPO) or per
    token ``[B, Lc]`` (TraceRL's value baselines, d-TreeRPO's tree); ``active [B]`` float: 0 for samples whose group
    gives no signal and is filtered out (DAPO's zero-variance filter), 1 otherwise. A method that derives more from
    the whole step's advantages (wd1's group softmax weights, the value model's returns) subclasses it, so the extra
    fields are sliced with the micro-batches."""
    values: torch.Tensor
    active: torch.Tensor

    @property
    def size(self) -> int:
        return self.values.shape[0]


@dataclass
class RLBatch(Rows):
    """One step's RL samples (B = prompts x completions on this rank; groups stay within a rank).

    Filled by (1) the rollout: ``uid`` ... ``nfe`` (``from_rollout``: every field named as a ``Rollout`` field is that
    field), ``tree`` (a method's own ``collect``); (2) the reward: ``rewards``; (3) the prepare stage: ``state`` (the
    method's ``prepare``, its one writer), ``views`` (``corrupt``, every inner iteration), ``frozen`` (the method's
    ``score_frozen`` with the models the trainer lends), ``old_logp`` / ``ref_logp`` / ``ref_views`` (scored with the
    pre-update and reference policies when the method needs them); (4) ``advantages`` (the method's ``advantages``)."""
    uid: torch.Tensor  # [B] long: the global sample id (group * G + sample); keys every random draw of the sample
    group: torch.Tensor  # [B] long: the global id of the sample's prompt (GRPO group)
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] bool: real prompt tokens
    completion_ids: torch.Tensor  # [B, Lc] long
    completion_mask: torch.Tensor  # [B, Lc] bool: positions up to and including the first stop token
    rewards: torch.Tensor  # [B] float (or [B, S]: per step)
    step_map: Optional[torch.Tensor] = None  # [B, Lc] long: the denoising step that wrote each token (-1: never)
    # [B, Lc] float: entropy of the distribution each token was committed from (the method's ``record``)
    entropy_map: Optional[torch.Tensor] = None
    trajectory: Any = None  # dare.rollout.Trajectory: the recorded intermediate states (the method's ``record``)
    hint_mask: Optional[torch.Tensor] = None  # [B, Lc] bool: positions that held a hint, given, not decoded (IGPO)
    tree: Any = None  # each row's place in its rollout tree (d-TreeRPO's ``collect``)
    examples: Optional[list] = None  # B dicts: each sample's data row, with its "rollout" numbers
    completions: Optional[list] = None  # B decoded completion texts
    stop_token_ids: tuple = batch_field(())  # the model's stop tokens (decoded completions end at the first)
    nfe: int = batch_field(0)  # denoiser calls of the rollout on this rank
    state: Any = None  # the method's own per-sample state (its ``prepare``)
    views: dict = field(default_factory=dict)  # iteration -> [View]
    frozen: Any = None  # what the method's no-grad passes with the lent models returned (its ``score_frozen``)
    ref_views: Optional[dict] = None  # iteration -> [View] when the reference has noise of its own
    old_logp: Optional[dict] = None  # iteration -> [B, K] fp32
    ref_logp: Optional[dict] = None  # iteration -> [B, K] fp32
    advantages: Optional[Advantages] = None

    @property
    def size(self) -> int:
        return int(self.uid.shape[0])

    @property
    def active(self) -> torch.Tensor:
        """``[B]`` float: the advantages' active mask (all ones before the advantage stage)."""
        if self.advantages is None:
            return torch.ones(self.size, device=self.uid.device)
        return self.advantages.active

    @classmethod
    def rollout_fields(cls) -> tuple[str, ...]:
        """The fields a finished ``dare.rollout.Rollout`` fills: every field named as one of the rollout's fields or
        properties (no hand-kept list: a new rollout record reaches the batch by a field of the same name here)."""
        theirs = {f.name for f in dataclasses.fields(Rollout)} | {n for n, v in vars(Rollout).items()
                                                                  if isinstance(v, property)}
        return tuple(f.name for f in dataclasses.fields(cls) if f.name in theirs)

    @classmethod
    def from_rollout(cls, ro, uid: torch.Tensor, group: torch.Tensor, rewards: torch.Tensor,
                     examples: Optional[list] = None, completions: Optional[list] = None) -> "RLBatch":
        """Stages (1)-(2)'s batch from a finished ``dare.rollout.Rollout``: its fields under the same names
        (``rollout_fields``; masks as bool), with the samples' ids, prompt groups, rewards and, optionally, data rows
        and texts."""
        taken = {name: getattr(ro, name) for name in cls.rollout_fields()}
        taken = {k: v.bool() if k.endswith("_mask") and v is not None else v for k, v in taken.items()}
        return cls(uid=uid, group=group, rewards=rewards, examples=examples, completions=completions, **taken)

    def take_row(self, slot: int, ro, src: int, reward, example: Optional[dict] = None,
                 completion: Optional[str] = None) -> None:
        """Row ``slot`` becomes completion ``src`` of the rollout ``ro`` of the same prompt (another try: IGPO's hinted
        round, d-OPSD's pass@k): its completion and every per-position record both have (step and entropy maps,
        hints), its reward, data row and text; its uid, group and prompt stay. A recorded trajectory cannot follow
        (the methods that swap rows do not record one)."""
        if self.trajectory is not None:
            raise ValueError("a batch with a recorded trajectory cannot take a row of another rollout")
        dev = self.completion_ids.device
        if ro.completion_ids.shape[1] != self.completion_ids.shape[1]:
            raise ValueError(f"the other rollout has {ro.completion_ids.shape[1]} completion positions, the batch "
                             f"{self.completion_ids.shape[1]}")
        for name in self.rollout_fields():
            if name.startswith("prompt_"):  # the same prompt (padded to the other rollout's width)
                continue
            mine, theirs = getattr(self, name), getattr(ro, name)
            if not isinstance(mine, torch.Tensor) or mine.dim() != 2:
                continue
            if isinstance(theirs, torch.Tensor):
                mine[slot] = theirs[src].to(dev, mine.dtype)
            elif mine.dtype == torch.bool:  # a record of presence (hints): the other rollout has none
                mine[slot] = False
            else:
                raise ValueError(f"the batch records {name} but the other rollout does not: decode it with the same "
                                 f"record")
        self.rewards[slot] = torch.as_tensor(reward).to(self.rewards.device, self.rewards.dtype)
        if self.examples is not None and example is not None:
            self.examples[slot] = example
        if self.completions is not None and completion is not None:
            self.completions[slot] = completion


# What the prepare and advantage stages store on any batch (the same names as RLBatch's fields).
STAGE_FIELDS = ("state", "views", "frozen", "ref_views", "old_logp", "ref_logp", "advantages")


class Batch(Rows):
    """Named per-sample fields of an SFT or preference step (tensors ``[B, ...]``, lists of B items), as the data
    sources build them (``dare.trainer.data``), plus what the prepare stage stores (``STAGE_FIELDS``).

    ``uid`` (long ``[B]``) is required: the global sample id used to key noise. ``meta`` holds batch-level values."""

    def __init__(self, uid: torch.Tensor, meta: Optional[dict] = None, **fields):
        self.fields: dict[str, Any] = {"uid": uid.long(), **fields}
        self.meta: dict[str, Any] = dict(meta or {})
        self.state = self.frozen = self.ref_views = self.old_logp = self.ref_logp = self.advantages = None
        self.views: dict = {}

    @property
    def size(self) -> int:
        return int(self.fields["uid"].shape[0])

    def __getitem__(self, key: str):
        try:
            return self.fields[key]
        except KeyError:
            raise KeyError(f"batch has no field {key!r} (fields: {', '.join(sorted(self.fields))})") from None

    def __setitem__(self, key: str, value) -> None:
        self.fields[key] = value

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def get(self, key: str, default=None):
        return self.fields.get(key, default)

    def select(self, idx) -> "Batch":
        idx = torch.as_tensor(idx, dtype=torch.long)
        n = self.size
        out = Batch.__new__(Batch)
        out.fields = {k: _select(v, idx, n, k) for k, v in self.fields.items()}
        out.meta = dict(self.meta)
        for name in STAGE_FIELDS:
            setattr(out, name, _select(getattr(self, name), idx, n, name))
        return out

    def to(self, device) -> "Batch":
        out = Batch.__new__(Batch)
        out.fields = {k: _to(v, device) for k, v in self.fields.items()}
        out.meta = dict(self.meta)
        for name in STAGE_FIELDS:
            setattr(out, name, _to(getattr(self, name), device))
        return out


def concat_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate per-micro-batch results (right-padding with zeros when widths differ)."""
    width = max(p.shape[1] for p in parts) if parts[0].dim() > 1 else None
    if width is not None:
        parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(parts, dim=0)

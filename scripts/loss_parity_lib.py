"""Run the authors' own loss code on plain tensors (used by scripts/make_loss_parity.py; docs/loss_parity.md).

The reference losses live in trainer classes (TRL ``GRPOTrainer`` subclasses, an SDAR ``forward``) or in functions
nested inside a training script's ``main()``. Their files import TRL, transformers, accelerate, wandb, ... at the
top, none of which the loss expressions use. Three tools make them callable without those packages and without
re-typing any of their expressions:

* ``load_reference(path)`` imports one reference file with every third-party or sibling import replaced by an inert
  stub (``Stub``): a class that can be subclassed, called, used as a decorator (it returns the decorated function),
  indexed, iterated (empty) and used as a context manager, and that is falsy, so ``if is_peft_available():`` guards
  skip their branch. Only the standard library, torch, numpy and packaging are real.
* ``trainer(cls, **attrs)`` makes an instance of a reference trainer class without running its ``__init__`` and
  sets the attributes its ``compute_loss`` reads (``beta``, ``epsilon``, ``args``, ...). Unset attributes read as
  stubs (metric logging becomes a no-op).
* ``nested_function(path, name, **closure)`` compiles the exact source text of a function defined inside another
  function (TraceRL's ``forward_process``) with its closure variables (``model``, ``config``) given as globals.
* ``source_block(path, start, stop, **variables)`` runs the exact lines of a block inside a long function (IGPO's
  entropy filter in ``_generate_and_score_completions``), from the line holding ``start`` up to the one holding
  ``stop``, with the variables it reads, and returns the variables it leaves.

Nothing from these files is copied into the repository: the script imports them from a local checkout.

The rest of the module is the case registry (``@case``), the reference checkouts (``REPOS``) and the builders of the
small random inputs every case starts from.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import subprocess
import textwrap
import types
from pathlib import Path
from typing import Callable, Optional

import numpy  # noqa: F401  (imported before any stub is installed: their own imports stay real)
import torch  # noqa: F401

REAL_TOP_LEVEL = {"torch", "numpy", "packaging"}
STUB_PACKAGE = "_loss_parity_ref"


class _StubMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub()

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]  # used as a decorator
        return super().__call__(*args, **kwargs)

    def __getitem__(cls, item):
        return cls

    def __bool__(cls):
        return False


class Stub(metaclass=_StubMeta):
    """Inert stand-in for anything a reference file imports but its loss does not use."""

    def __init__(self, *args, **kwargs):
        self.__dict__.update(kwargs)  # a stubbed output class (CausalLMOutputWithPast(loss=...)) keeps its fields

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return Stub()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return Stub()

    def __getitem__(self, item):
        return Stub()

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _stub_class(name: str) -> type:
    return _StubMeta(name, (Stub,), {})


class _StubModule(types.ModuleType):
    __version__ = "0.0.0"
    __path__: list = []

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(name)
        setattr(self, name, value)
        return value


def _importer() -> str:
    """``__name__`` of the module whose code runs the import being resolved."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename.startswith("<frozen importlib")
                                 or frame.f_globals.get("__name__") == __name__):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "") if frame is not None else ""


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serve a stub module for the reference file's own imports outside the standard library and ``REAL_TOP_LEVEL``."""

    def __init__(self, target: str, overrides: dict):
        self.target = target
        self.overrides = overrides

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if fullname == self.target or top in REAL_TOP_LEVEL or top in sys.stdlib_module_names:
            return None
        if top != STUB_PACKAGE and not _importer().startswith(STUB_PACKAGE):
            return None  # an import made by a real package (torch importing sympy) stays real
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _StubModule(spec.name)
        for attr, value in self.overrides.get(spec.name, {}).items():
            setattr(module, attr, value)
        return module

    def exec_module(self, module):
        module.__path__ = []


def load_reference(path: Path, name: str, overrides: Optional[dict] = None):
    """Import the reference file ``path`` as module ``_loss_parity_ref.<name>`` with stubbed dependencies.

    ``overrides`` gives real values to stubbed names, ``{"accelerate.utils": {"gather": fn}}``, for the few framework
    helpers a reference's loss path calls for their value (a one-process ``gather`` is the identity)."""
    full = f"{STUB_PACKAGE}.{name}"
    overrides = overrides or {}
    for module_name in overrides:  # stubs made by an earlier load would not see the overrides
        sys.modules.pop(module_name, None)
    finder = _StubFinder(full, overrides)
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module(STUB_PACKAGE)
        spec = importlib.util.spec_from_file_location(full, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    finally:
        sys.meta_path.remove(finder)
    return module


def trainer(cls: type, **attrs):
    """An instance of reference class ``cls`` without its ``__init__``, with ``attrs`` set."""
    obj = object.__new__(cls)
    for key, value in attrs.items():
        object.__setattr__(obj, key, value)
    return obj


def nested_function(path: Path, name: str, **closure):
    """The function ``name`` defined inside another function of ``path``, compiled from its own source text.

    ``closure`` supplies the enclosing function's variables it reads (as globals of the new function).
    """
    source = Path(path).read_text()
    tree = ast.parse(source)
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == name]
    if len(found) != 1:
        raise ValueError(f"{path}: expected one function named {name!r}, found {len(found)}")
    node = found[0]
    start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
    text = textwrap.dedent("\n".join(source.splitlines()[start:node.end_lineno]))
    namespace = {"__name__": f"{STUB_PACKAGE}.nested", **closure}
    exec(compile(text, f"{path}:{name}", "exec"), namespace)
    return namespace[name]


def source_block(path: Path, start: str, stop: str, **variables) -> dict:
    """Run the lines of ``path`` from the first one containing ``start`` up to (without) the next one containing
    ``stop``, dedented, with ``variables`` as its globals; returns the namespace it leaves."""
    lines = Path(path).read_text().splitlines()
    first = next((i for i, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"{path}: no line contains {start!r}")
    end = next((i for i in range(first + 1, len(lines)) if stop in lines[i]), None)
    if end is None:
        raise ValueError(f"{path}: no line after {first + 1} contains {stop!r}")
    namespace = {"__name__": f"{STUB_PACKAGE}.block", **variables}
    exec(compile(textwrap.dedent("\n".join(lines[first:end])), f"{path}:{first + 1}-{end}", "exec"), namespace)
    return namespace


# ----------------------------------------------------------------------------------------------------------
# Reference checkouts and the case registry
# ----------------------------------------------------------------------------------------------------------

REPOS: dict[str, str] = {}  # key -> GitHub repository of the authors' code, declared by the case modules


def repository(key: str, repo: str) -> str:
    """Declare that cases of ``key`` run code of GitHub repository ``repo`` ("owner/name"); returns ``key``. Each
    case module declares its own, so a new method's cases add a module and edit no list."""
    if REPOS.setdefault(key, repo) != repo:
        raise ValueError(f"reference key {key!r} names {REPOS[key]} and {repo}")
    return key


def load_case_modules(folder: Path) -> list[str]:
    """Import every ``loss_parity_cases_*.py`` of ``folder`` (each registers its cases and repositories)."""
    import importlib
    names = sorted(p.stem for p in folder.glob("loss_parity_cases_*.py"))
    for name in names:
        importlib.import_module(name)
    return names


@dataclasses.dataclass
class Reference:
    key: str
    path: Path
    commit: str

    def file(self, rel: str) -> Path:
        p = self.path / rel
        if not p.is_file():
            raise FileNotFoundError(f"{REPOS[self.key]} checkout {self.path} has no {rel}")
        return p

    def meta(self, rel: str, code: str) -> dict:
        return {"repo": REPOS[self.key], "commit": self.commit, "file": rel, "code": code}


def find_reference(key: str, paths: dict, root: Optional[Path], commits: dict) -> Reference:
    """The checkout of ``REPOS[key]``: ``paths[key]``, else ``root/<key>``, ``root/<name>`` or ``root/<owner>+<name>``."""
    owner, name = REPOS[key].split("/")
    candidates = [Path(paths[key])] if key in paths else []
    if root is not None:
        candidates += [root / key, root / name, root / f"{owner}+{name}"]
    for path in candidates:
        if path.is_dir():
            commit = commits.get(key) or _git_head(path)
            if not commit:
                raise SystemExit(f"{path} is not a git checkout: give its commit with --commit {key}=<sha>")
            return Reference(key, path.resolve(), commit)
    raise SystemExit(f"no checkout of {REPOS[key]} (looked at {', '.join(map(str, candidates)) or 'nothing'}); "
                     f"pass --ref {key}=PATH or --refs-root DIR")


def _git_head(path: Path) -> str:
    out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""


CASES: dict[str, tuple[str, Callable]] = {}  # case name -> (reference key, function(Reference) -> case dict)


def case(name: str, ref_key: str):
    """Register ``fn(ref) -> case dict`` as the generator of ``tests/assets/loss_parity/<name>.pt``."""
    def register(fn):
        if name in CASES:
            raise ValueError(f"case {name!r} is registered twice")
        CASES[name] = (ref_key, fn)
        return fn
    return register


def record(method: str, config: dict, inputs: dict, leaves: dict, loss: torch.Tensor, reference: dict,
           runner: Optional[str] = None, note: str = "", xfail: str = "", doc: Optional[dict] = None) -> dict:
    """A case: inputs, the dare config, and the reference's loss and gradients w.r.t. the ``leaves``. ``doc``
    ({"authors": ..., "dare": ...}: the code each side runs) is the case's row in docs/loss_parity.md."""
    loss.backward()
    missing = [k for k, v in leaves.items() if v.grad is None]
    if missing:
        raise RuntimeError(f"the reference loss does not depend on {missing}")
    inputs = {k: _compact(v) for k, v in inputs.items()}
    inputs.update({k: v.detach().clone() for k, v in leaves.items()})
    return {"method": method, "runner": runner or method, "config": config, "inputs": inputs,
            "leaves": sorted(leaves), "expected": {"loss": loss.detach().double(),
                                                   "grad": {k: v.grad.detach().double() for k, v in leaves.items()}},
            "reference": reference, "note": note, "xfail": xfail, **({"doc": doc} if doc else {})}


def _compact(value):
    """Token ids and step indices are stored as int16 (``parity_io.load_case`` restores int64)."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.int64:
        if value.numel() and (value.min() < -2 ** 15 or value.max() >= 2 ** 15):
            raise ValueError("integer input out of int16 range")
        return value.to(torch.int16)
    return value


# ----------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------


def rl_inputs(seed: int, n_groups: int = 2, group: int = 3, prompt_len: int = 4, gen_len: int = 8,
              eos_rows: int = 2, pad: Optional[int] = None) -> dict:
    """Prompts (shared within a group), completions (the first ``eos_rows`` stop early: EOS then ``pad``, EOS by
    default) with their mask up to and including the first EOS, group ids, and binary rewards with at least one 0
    and one 1 per group. Tokens are in ``FIRST_TOKEN .. VOCAB-1`` (never the mask, EOS or PAD id)."""
    from tests.algorithms.parity_io import EOS, FIRST_TOKEN, VOCAB
    g = torch.Generator().manual_seed(seed)
    B = n_groups * group
    prompt = torch.randint(FIRST_TOKEN, VOCAB, (n_groups, prompt_len), generator=g).repeat_interleave(group, 0)
    comp = torch.randint(FIRST_TOKEN, VOCAB, (B, gen_len), generator=g)
    mask = torch.ones(B, gen_len, dtype=torch.bool)
    for i in range(eos_rows):
        stop = 2 + i
        comp[i, stop] = EOS
        comp[i, stop + 1:] = EOS if pad is None else pad
        mask[i, stop + 1:] = False
    rewards = torch.randint(0, 2, (B,), generator=g).double()
    rewards[::group] = 1.0
    rewards[1::group] = 0.0
    return {"prompt_ids": prompt, "prompt_mask": torch.ones(B, prompt_len, dtype=torch.bool), "completion_ids": comp,
            "completion_mask": mask, "group": torch.arange(B) // group, "rewards": rewards, "generator": g}


def log_probs(g: torch.Generator, *shape, low: float = -2.5, high: float = -0.05) -> torch.Tensor:
    """Per-token log-probabilities, uniform in [low, high] (float64)."""
    return low + (high - low) * torch.rand(*shape, generator=g, dtype=torch.float64)


def perturbed(g: torch.Generator, logp: torch.Tensor, scale: float = 0.4) -> torch.Tensor:
    """Another policy's log-probs near ``logp`` (ratios both inside and outside the clip range), kept < 0."""
    return (logp + scale * torch.randn(logp.shape, generator=g, dtype=torch.float64)).clamp(max=-0.01)


def centred(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """Values minus their group mean: zero-mean advantages, which dare's ``advantage: mean`` returns unchanged
    when they are given as rewards."""
    out = values.clone()
    for g in torch.unique(group):
        sel = group == g
        out[sel] = values[sel] - values[sel].mean()
    return out

"""Training methods as plug-ins: one module per method, registered with ``@register_algorithm``.

Every module in this package is imported on first use (``load_builtin_algorithms``), so adding a method is
adding a file; nothing else needs to list it. The hook interface is ``base.Algorithm``; the batch it reads is
``batch.RLBatch`` (RL) or ``batch.Batch`` (SFT, preference); shared machinery lives in ``common/``, the loss math
in ``losses``, advantage estimators and aggregation modes in ``advantages``.
"""
from __future__ import annotations

from .base import Algorithm, AlgorithmConfig, Companion, Services, StepContext, cost, cost_knobs
from .batch import Advantages, Batch, LogLik, RLBatch, View
from .registry import ALGORITHMS, build_algorithm, get_algorithm, load_builtin_algorithms, register_algorithm

__all__ = ["ALGORITHMS", "Advantages", "Algorithm", "AlgorithmConfig", "Batch", "Companion", "LogLik", "RLBatch",
           "Services", "StepContext", "View", "build_algorithm", "cost", "cost_knobs", "get_algorithm",
           "register_algorithm", "load_builtin_algorithms"]

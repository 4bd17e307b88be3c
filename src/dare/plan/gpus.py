"""Accelerators a plan is made for: memory and published dense bf16 peak (no sparsity)."""
from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 2 ** 30


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int  # nominal HBM capacity
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s (the vendor's figure without 2:4 sparsity)


GPUS = {
    "a100": GPU("A100 SXM 80GB", 80 * GIB, 312e12),
    "h100": GPU("H100 SXM 80GB", 80 * GIB, 989e12),
    "h200": GPU("H200 SXM 141GB", 141 * 10 ** 9, 989e12),
    "b200": GPU("B200 180GB", 180 * 10 ** 9, 2250e12),
}


def get_gpu(name: str) -> GPU:
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown --gpu {name!r}; known: {', '.join(GPUS)}")
    return GPUS[key]


def parse_bytes(text) -> int:
    """'80GiB', '80GB', '81920MiB', 85899345920 -> bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 80GiB, 80GB or 81920MiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper()
    powers = {"B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
              "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
    return int(value * powers[unit])

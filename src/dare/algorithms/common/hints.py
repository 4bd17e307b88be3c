"""Inpainting hints from a reference solution: chunks of its tokens revealed at stretched positions (IGPO).

What the authors' ``create_spacing_scaled_inpainting_sequence`` / ``scale_chunk_positions`` build
(facebookresearch/igpo ``utils/generate.py`` l.472-724), rewritten with dare's keyed generators:

1. The reference is tokenised; the last ``free_tail`` completion slots stay free (the effective length is
   ``gen_length - free_tail``), the reference is cut to it and stretched by ``s = clamp(eff / len, 1, max_stretch)``
   (never compressed).
2. It is cut left to right into chunks of ``randint(min_chunk, max_chunk)`` tokens; a trailing remainder shorter
   than ``min_chunk`` is never revealed.
3. ``int(n_chunks * (1 - ratio))`` chunks are hidden (a uniform random subset); the others are revealed, and the
   last chunk always is (the reference's ``inpaint_last_chunk_end`` default).
4. Revealed chunks keep their order and contiguity: the first starts at ``int(start * s)``, each next one
   ``min(int(gap * s), max_spacing)`` after the previous revealed chunk's end (``gap``: their distance in the
   reference); a chunk is cut at the effective length, and none is placed past it.

The result is a hint canvas ``[gen_length]`` of token ids, -1 where nothing is given (``dare.rollout.generate``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class ChunkHints:
    """How a reference becomes hints (defaults: the authors' released run, docs/algorithms/igpo.md)."""
    min_chunk: int = 5
    max_chunk: int = 10
    free_tail: int = 30
    max_spacing: int = 100
    max_stretch: float = 1.5

    def __post_init__(self):
        if not 1 <= self.min_chunk <= self.max_chunk:
            raise ValueError(f"hint chunks need 1 <= min_chunk <= max_chunk, got {self.min_chunk}, {self.max_chunk}")
        if self.free_tail < 0 or self.max_spacing < 0:
            raise ValueError(f"hint free_tail and max_spacing must be >= 0, got {self.free_tail}, {self.max_spacing}")
        if self.max_stretch < 1.0:
            raise ValueError(f"hint max_stretch must be >= 1 (references are never compressed), got {self.max_stretch}")


def reference_chunks(n: int, spec: ChunkHints, gen: torch.Generator) -> list[tuple[int, int]]:
    """``[start, end)`` chunks of a reference of ``n`` tokens (the last one dropped when shorter than min_chunk)."""
    chunks, i = [], 0
    while i < n:
        size = min(int(torch.randint(spec.min_chunk, spec.max_chunk + 1, (1,), generator=gen)), n - i)
        if size < spec.min_chunk:
            break
        chunks.append((i, i + size))
        i += size
    return chunks


def revealed_chunks(chunks: list[tuple[int, int]], ratio: float, gen: torch.Generator) -> list[tuple[int, int]]:
    """The chunks a hint ratio reveals, in order: all but ``int(n * (1 - ratio))`` random ones, and always the last."""
    n = len(chunks)
    hide = max(0, int(n * (1.0 - ratio))) if ratio < 1.0 else 0
    hidden = set(torch.randperm(n, generator=gen)[:hide].tolist()) if hide else set()
    return [c for i, c in enumerate(chunks) if i not in hidden or i == n - 1]


def placed_chunks(chunks: list[tuple[int, int]], length: int, stretch: float,
                  max_spacing: int) -> list[tuple[int, int]]:
    """Canvas ``[start, end)`` of every revealed chunk (in order; fewer when the canvas runs out)."""
    out: list[tuple[int, int]] = []
    for i, (start, end) in enumerate(chunks):
        if i == 0:
            at = int(start * stretch)
        else:
            at = out[-1][1] + min(int((start - chunks[i - 1][1]) * stretch), max_spacing)
        stop = at + end - start
        if stop > length:
            if at >= length:
                break
            stop = length
        out.append((at, stop))
    return out


def chunk_hint_canvas(reference: Sequence[int], gen_length: int, ratio: float, spec: ChunkHints,
                      gen: torch.Generator) -> torch.Tensor:
    """Hint canvas ``[gen_length]`` (long, -1 = no hint) revealing about ``ratio`` of the reference's chunks."""
    canvas = torch.full((gen_length,), -1, dtype=torch.long)
    eff = max(0, gen_length - spec.free_tail)
    ref = list(reference)[:eff]
    if ratio <= 0.0 or not ref:
        return canvas
    stretch = min(max(eff / len(reference), 1.0), spec.max_stretch)
    shown = revealed_chunks(reference_chunks(len(ref), spec, gen), ratio, gen)
    for (src0, _), (at, stop) in zip(shown, placed_chunks(shown, eff, stretch, spec.max_spacing)):
        canvas[at:stop] = torch.tensor(ref[src0:src0 + stop - at], dtype=torch.long)
    return canvas


def hint_ratios(n: int, low: float, high: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` hint ratios ``~ U[low, high]``, ascending (one per rollout of a group, as the reference sorts them)."""
    return (low + (high - low) * torch.rand(n, generator=gen, dtype=torch.float64)).sort().values


def reference_tokens(example: dict, tokenizer, data_cfg, stop_ids: Sequence[int] = ()) -> Optional[list[int]]:
    """The example's gold completion in the recipe's answer format (its template's SFT target: a math row's worked
    solution and boxed answer, a Sudoku solution, ...) as token ids, stop tokens left out; None when the row has none
    (e.g. a code row without a canonical solution)."""
    from ...data.prompts import build_sft_example
    try:
        _, text = build_sft_example(example, data_cfg.template, tokenizer, data_cfg.system_prompt,
                                    data_cfg.chat_template, data_cfg.generation_prefix)
    except (ValueError, KeyError, TypeError):  # DataError (a ValueError): no gold completion for this row
        return None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stops = set(int(s) for s in stop_ids)
    return [int(t) for t in ids if int(t) not in stops] or None

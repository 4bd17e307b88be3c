"""Speed beside quality: NFE per sample, tokens per forward (TPF) and tokens per second (definitions: docs/eval.md).

* NFE of a sample: the model forwards (denoiser calls) its row took part in (``Rollout.row_nfe``): what decoding it
  alone costs, whatever else shared its batch. A cache refresh or a block's storing step counts like any step.
* TPF: valid output tokens (cut at the first stop token, which is not counted) / denoiser calls, both summed over
  the samples (the ratio of totals, as d3LLM's AUP leaderboard and the dLLM leaderboards that adopted it report it).
  One token per step without caches gives TPF <= 1; parallel decoding (threshold, factor) raises it.
* tokens/s: valid output tokens / generation wall time of this invocation (batched, so it depends on batch size
  and hardware; TPF does not).
"""
from __future__ import annotations

from typing import Iterable, Optional


def rollout_speed(rollout) -> tuple[list[int], list[Optional[int]]]:
    """(valid tokens, NFE) of every row of a ``Rollout``; NFE is None for rollouts that did not count it."""
    valid = rollout.valid_lengths().tolist()
    nfe = rollout.row_nfe.tolist() if rollout.row_nfe is not None else [None] * len(valid)
    return valid, nfe


def speed_summary(records: Iterable[dict], run_seconds: float = 0.0, run_tokens: int = 0) -> dict:
    """``nfe_per_sample``, ``tpf`` and ``valid_tokens_per_sample`` over the records that carry both counts (records
    written before dare counted them carry neither: they are left out), plus ``tokens_per_second`` of this run."""
    counted = [r for r in records if r.get("nfe") is not None and r.get("valid_tokens") is not None]
    nfe = sum(int(r["nfe"]) for r in counted)
    tokens = sum(int(r["valid_tokens"]) for r in counted)
    n = len(counted)
    return {
        "nfe_per_sample": round(nfe / n, 3) if n else None,
        "tpf": round(tokens / nfe, 4) if nfe else None,
        "valid_tokens_per_sample": round(tokens / n, 3) if n else None,
        "tokens_per_second": round(run_tokens / run_seconds, 2) if run_seconds else None,
    }


def fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"

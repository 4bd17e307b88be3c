"""Shared by the loss-parity cases (tests/assets/loss_parity/*.pt, made by scripts/make_loss_parity.py) and their
test (test_loss_parity.py); see docs/loss_parity.md.

A case holds small inputs, the dare algorithm config that matches the reference's hyperparameters, and the loss value
and gradients that the authors' own code gave on those inputs. The "current-policy log-probs" are leaves: per-token
log-probs (per view, per draw or per step, as the method's estimator takes them). References that take logits get
``embed_logp(leaf)``: logits over a tiny vocabulary whose log-softmax at the label is exactly the leaf (the rest of
the mass sits on token ``OTHER``), so the reference's own ``log_softmax``/``cross_entropy``/``softmax`` calls see the
leaf and its gradient w.r.t. the leaf is the gradient w.r.t. the per-token log-probs. dare's estimators get the same
logits from ``TableModel``, a stand-in model whose hidden states are those logits and whose head is the identity.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

CASE_DIR = Path(__file__).resolve().parents[1] / "assets" / "loss_parity"
VOCAB = 16
OTHER = 0  # never a label: holds 1 - p
EOS = 1
MASK_ID = 2
PAD = 3  # padding after the EOS where a reference tells padding from the stop token (TraceRL, DiRL)
FIRST_TOKEN = 4  # real tokens are FIRST_TOKEN .. VOCAB-1
FILLER = -1.0e4  # logits of every other token (exp underflows to exactly 0)


def embed_logp(logp: torch.Tensor, labels: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    """Logits ``[..., vocab]`` with ``log_softmax(logits)[label] == logp`` (differentiable in ``logp``)."""
    if bool((labels == OTHER).any()):
        raise ValueError(f"token {OTHER} is reserved for the complementary mass")
    base = torch.full((*logp.shape, vocab), FILLER, dtype=logp.dtype)
    out = base.scatter(-1, labels.long().unsqueeze(-1), logp.unsqueeze(-1))
    rest = torch.log(-torch.expm1(logp))  # log(1 - p)
    return out.scatter(-1, torch.full_like(labels.long(), OTHER).unsqueeze(-1), rest.unsqueeze(-1))


def save_case(name: str, case: dict, directory: Path = CASE_DIR) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.pt"
    torch.save(case, path)
    return path


def load_case(path: Path) -> dict:
    case = torch.load(path, weights_only=True)
    case["inputs"] = {k: v.long() if isinstance(v, torch.Tensor) and v.dtype == torch.int16 else v
                      for k, v in case["inputs"].items()}
    return case


def case_paths(directory: Path = CASE_DIR) -> list[Path]:
    return sorted(directory.glob("*.pt"))


def cases_markdown(directory: Path = CASE_DIR) -> str:
    """docs/loss_parity.md's table of the cases, from the case files (``python scripts/generate.py`` writes it):
    one row per run of cases (by name) with the same reference and the same description (``doc``)."""
    rows: list[tuple[list[str], tuple]] = []
    for path in case_paths(directory):
        case = torch.load(path, weights_only=True)
        ref, doc = case["reference"], case.get("doc") or {}
        key = (f"{ref['repo']} @ `{ref['commit'][:7]}`",
               doc.get("authors") or f"`{ref['file']}` {ref['code']}",
               doc.get("dare") or f"`{case['method']}` (runner `{case['runner']}`)")
        if rows and rows[-1][1] == key:
            rows[-1][0].append(path.stem)
        else:
            rows.append(([path.stem], key))
    lines = ["| case | reference (commit) | the authors' code that runs | dare's code that runs |", "|---|---|---|---|"]
    lines += ["| " + ", ".join(f"`{n}`" for n in names) + " | " + " | ".join(key) + " |" for names, key in rows]
    return "\n".join(lines)


def stub_adapter(block_size=None):
    """The adapter fields the RL hooks read, for the tiny parity vocabulary (no model behind it)."""
    return SimpleNamespace(mask_token_id=MASK_ID, is_block_causal=block_size is not None, block_size=block_size,
                           is_encoder_decoder=False, noise="mask", logit_softcap=None,
                           attention="block_causal" if block_size else "bidirectional", all_stop_ids=[EOS],
                           prediction_rows=lambda col: col)


class TableModel(torch.nn.Module):
    """A model whose i-th forward returns ``hidden[i]`` (logits ``[B, T, V]``) with an identity head (a forward of
    several views' rows at once returns their tables, concatenated).

    ``dare.diffusion.logprob.score_targets`` computes ``log_softmax(hidden @ I)`` at the targets, so a view scored
    in the i-th forward sees exactly the logits the reference saw for it."""

    def __init__(self, hidden: list[torch.Tensor]):
        super().__init__()
        self.hidden = list(hidden)
        self.calls = 0
        self.lm_head = SimpleNamespace(weight=torch.eye(VOCAB, dtype=torch.float64))
        self.adapter = stub_adapter()

    def forward(self, input_ids, **kwargs):
        # Views of one shape run as one batched forward (``dare.algorithms.base.score_views``): the next tables in order
        parts, rows = [], 0
        while rows < input_ids.shape[0] and self.calls < len(self.hidden):
            parts.append(self.hidden[self.calls])
            rows += parts[-1].shape[0]
            self.calls += 1
        h = torch.cat(parts) if len(parts) > 1 else parts[0]
        if h.shape[:2] != input_ids.shape[:2]:
            raise ValueError(f"forward {self.calls}: table has shape {tuple(h.shape)}, input {tuple(input_ids.shape)}")
        return SimpleNamespace(hidden_states=h)


def completion_hidden(logp: torch.Tensor, prompt_len: int, completion_ids: torch.Tensor) -> torch.Tensor:
    """``[B, P + Lc, V]`` hidden states of one view: the embedded log-probs at the completion positions."""
    B = logp.shape[0]
    prompt = torch.zeros(B, prompt_len, VOCAB, dtype=logp.dtype)
    return torch.cat([prompt, embed_logp(logp, completion_ids)], dim=1)


def block_logits(block: torch.Tensor, states: torch.Tensor, prompt_len: int, block_length: int,
                 mask_id: int) -> torch.Tensor:
    """``[S, P + Lc, V]`` logits of sampler states ``states [S, P + Lc]`` whose current block (the one holding the
    first mask after the prompt) carries ``block [S, block_length, V]`` and every other position zeros
    (differentiable in ``block``). d-OPSD reads a state's logits only in its current block, so a case stores just
    that block (the d-OPSD cases)."""
    S, L = states.shape
    out = []
    for s in range(S):
        masked = (states[s, prompt_len:] == mask_id).nonzero().flatten()
        first = int(masked[0]) if masked.numel() else 0
        start = prompt_len + (first // block_length) * block_length
        row = torch.zeros(L, block.shape[-1], dtype=block.dtype)
        out.append(torch.cat([row[:start], block[s], row[start + block_length:]]))
    return torch.stack(out)

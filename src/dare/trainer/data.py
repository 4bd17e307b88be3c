"""Training data: tokenized SFT documents, preference pairs and RL prompts; a resumable sampler; packing.

Every step's global batch is a deterministic function of (seed, step): the sampler walks seeded epoch
permutations, so the data position is just the step number (exact resume, identical batches on every rank). Each
rank then takes its share (rows round-robin, padded with empty rows so that every rank runs the same number of
forwards, which FSDP's collectives require).

Packing: documents (prompt + answer + EOS) are placed first-fit into rows of ``max_length`` tokens; position ids
restart at 0 for every document, which is how the attention layout keeps documents apart
(``adapter.packed_layout``). Trailing padding forms its own document of EOS tokens that nothing attends to.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from ..algorithms.batch import Batch
from ..data.limits import check_characters, encode_within
from ..data.readers import read_records
from ..config.core import clip, shown
from ..data.schema import BadRowPolicy, DataError
from ..diffusion.noise import STREAM_DATA, keyed_generator

log = logging.getLogger(__name__)


@dataclass
class SFTDoc:
    uid: int
    prompt: list[int]
    answer: list[int]  # ends with EOS (and LLaDA-style EOS padding when pad_answer_to is set)

    def __len__(self) -> int:
        return len(self.prompt) + len(self.answer)


@dataclass
class PreferencePair:
    uid: int
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


# ----------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------


def _field(rec, *names):
    for n in names:
        if n in rec.data:
            return rec.data[n]
    raise DataError(f"{rec.loc}: missing field {names[0]!r} (row keys: {clip(', '.join(sorted(map(str, rec.data))), 300)})")


def _text(rec, value, name: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{rec.loc}: field {name!r} must be a string, got {type(value).__name__} {shown(value)}")
    if not value.strip():
        raise DataError(f"{rec.loc}: field {name!r} is empty")
    return value


def encode_chat_prompt(tokenizer, prompt: str, chat_template: str, max_tokens: Optional[int] = None,
                       loc: str = "prompt") -> list[int]:
    """The prompt's ids (in the tokenizer's chat template unless ``never``); a prompt that certainly has more than
    ``max_tokens`` is refused before it is tokenized (``dare.data.limits``)."""
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "always" and not has_chat:
        raise ValueError("data.chat_template: always, but the tokenizer has no chat template")
    what, limit_text = f"{loc}: field 'prompt'", f"data.max_length={max_tokens}"
    if has_chat and chat_template != "never":
        if max_tokens is not None:  # the raw text first: rendering a huge prompt would copy it once more
            check_characters(tokenizer, prompt, max_tokens, what, limit_text)
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        return encode_within(tokenizer, text, max_tokens, what, limit_text, add_special_tokens=False)
    return encode_within(tokenizer, prompt, max_tokens, what, limit_text, add_special_tokens=True)


def _answer_ids(tokenizer, text: str, eos: int, pad_to: Optional[int], loc: str, name: str = "response",
                max_tokens: Optional[int] = None) -> list[int]:
    ids = encode_within(tokenizer, text, max_tokens, f"{loc}: field {name!r}", f"data.max_length={max_tokens}",
                        add_special_tokens=False) + [eos]
    if pad_to is not None:
        if len(ids) > pad_to:
            raise DataError(f"{loc}: answer has {len(ids)} tokens (with EOS), over data.pad_answer_to={pad_to}")
        ids = ids + [eos] * (pad_to - len(ids))
    return ids


def _sft_texts(data_cfg, tokenizer, policy: BadRowPolicy):
    """(location, prompt ids, answer text) for every row of the configured source."""
    if data_cfg.pairs:
        for rec in read_records(data_cfg.pairs, policy.handle):
            def parse(rec=rec):
                prompt = _text(rec, _field(rec, "prompt", "question", "instruction"), "prompt")
                answer = _text(rec, _field(rec, "response", "completion", "answer", "output"), "response")
                return rec.loc, encode_chat_prompt(tokenizer, prompt, data_cfg.chat_template, data_cfg.max_length,
                                                   rec.loc), answer
            yield parse
    else:
        from ..data import build_sft_example, encode_prompt, load_examples
        from ..data.prompts import _uses_chat
        from ..data.templates import get_template
        ds = data_cfg.dataset
        chat = _uses_chat(tokenizer, get_template(ds.template), ds.chat_template)
        for ex in load_examples(ds):
            def parse(ex=ex):
                prompt_text, completion = build_sft_example(ex, ds.template, tokenizer, ds.system_prompt, ds.chat_template,
                                                            ds.generation_prefix)
                loc = f"{ds.describe()}, example {ex['id']}"
                if not completion.strip():
                    raise DataError(f"{loc}: empty gold completion")
                return loc, encode_prompt(prompt_text, tokenizer, chat, data_cfg.max_length, f"{loc}: prompt",
                                          f"data.max_length={data_cfg.max_length}"), completion
            yield parse


def _check_source(data_cfg, kind: str) -> None:
    if (data_cfg.pairs is None) == (data_cfg.dataset is None):
        raise ValueError(f"data: set exactly one of data.pairs (a JSONL file) or data.dataset (a dare.data source) for {kind}")


def load_sft_docs(data_cfg, tokenizer) -> list[SFTDoc]:
    """Tokenized SFT documents; rows longer than ``max_length`` or with empty fields follow ``on_bad_row``."""
    _check_source(data_cfg, "SFT")
    eos = tokenizer.eos_token_id
    policy = BadRowPolicy(data_cfg.on_bad_row, what="SFT row")
    docs: list[SFTDoc] = []
    for parse in _sft_texts(data_cfg, tokenizer, policy):
        try:
            loc, prompt, answer_text = parse()
            if not prompt:
                raise DataError(f"{loc}: the prompt encodes to no tokens")
            answer = _answer_ids(tokenizer, answer_text, eos, data_cfg.pad_answer_to, loc, max_tokens=data_cfg.max_length)
            if len(prompt) + len(answer) > data_cfg.max_length:
                raise DataError(f"{loc}: prompt + answer have {len(prompt) + len(answer)} tokens, over "
                                f"data.max_length={data_cfg.max_length}")
        except DataError as e:
            policy.handle(e)
            continue
        docs.append(SFTDoc(len(docs), prompt, answer))
    policy.summary(data_cfg.pairs or "data.dataset")
    if not docs:
        raise DataError(f"{data_cfg.pairs or 'data.dataset'}: no usable SFT rows")
    return docs


def load_preference_pairs(data_cfg, tokenizer) -> list[PreferencePair]:
    """``{prompt, chosen, rejected}`` rows (JSONL/parquet/...), tokenized; bad rows name the file and row."""
    if not data_cfg.pairs:
        raise ValueError("DPO/VRPO needs data.pairs: a file of {prompt, chosen, rejected} rows")
    eos = tokenizer.eos_token_id
    policy = BadRowPolicy(data_cfg.on_bad_row, what="preference row")
    out: list[PreferencePair] = []
    for rec in read_records(data_cfg.pairs, policy.handle):
        try:
            limit = data_cfg.max_length
            prompt = encode_chat_prompt(tokenizer, _text(rec, _field(rec, "prompt"), "prompt"), data_cfg.chat_template,
                                        limit, rec.loc)
            chosen = _answer_ids(tokenizer, _text(rec, _field(rec, "chosen"), "chosen"), eos, None, rec.loc, "chosen", limit)
            rejected = _answer_ids(tokenizer, _text(rec, _field(rec, "rejected"), "rejected"), eos, None, rec.loc,
                                   "rejected", limit)
            longest = len(prompt) + max(len(chosen), len(rejected))
            if longest > data_cfg.max_length:
                raise DataError(f"{rec.loc}: prompt + response have {longest} tokens, over data.max_length={data_cfg.max_length}")
        except DataError as e:
            policy.handle(e)
            continue
        out.append(PreferencePair(len(out), prompt, chosen, rejected))
    policy.summary(data_cfg.pairs)
    if not out:
        raise DataError(f"{data_cfg.pairs}: no usable preference rows")
    return out


# ----------------------------------------------------------------------------------------------------------
# Sampling and sharding
# ----------------------------------------------------------------------------------------------------------


class EpochSampler:
    """Global example indices of a step: seeded epoch permutations walked ``batch_size`` at a time."""

    def __init__(self, n: int, batch_size: int, seed: int):
        if n <= 0:
            raise ValueError("empty dataset")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self._perm_cache: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: torch.randperm(self.n, generator=keyed_generator(self.seed, STREAM_DATA, epoch))}
        return self._perm_cache[epoch]

    def indices(self, step: int) -> list[int]:
        start = step * self.batch_size
        return [int(self._perm(p // self.n)[p % self.n]) for p in range(start, start + self.batch_size)]

    def epoch(self, step: int) -> float:
        return step * self.batch_size / self.n


def rank_share(n_items: int, rank: int, world: int) -> list[int]:
    """Round-robin share of ``n_items`` for ``rank``, padded with -1 (an empty item) to the same count on every rank."""
    per_rank = -(-n_items // world)
    mine = list(range(rank, n_items, world))
    return mine + [-1] * (per_rank - len(mine))


# ----------------------------------------------------------------------------------------------------------
# SFT rows
# ----------------------------------------------------------------------------------------------------------


def pack_first_fit(docs: list[SFTDoc], capacity: int) -> list[list[SFTDoc]]:
    rows: list[list[SFTDoc]] = []
    room: list[int] = []
    for d in docs:
        for i, free in enumerate(room):
            if len(d) <= free:
                rows[i].append(d)
                room[i] -= len(d)
                break
        else:
            rows.append([d])
            room.append(capacity - len(d))
    return rows


def sft_rows_batch(rows: list[Optional[list[SFTDoc]]], row_uids: list[int], pad_id: int, pad_in_loss: bool) -> Batch:
    """Tensors of SFT rows (``None`` = an empty row). Padding is EOS: its own document, or (``pad_in_loss``,
    padded one-document rows) a continuation of the answer, as in LLaDA's SFT."""
    length = max([sum(len(d) for d in r) for r in rows if r] + [1])
    R = len(rows)
    ids = torch.full((R, length), pad_id, dtype=torch.long)
    pos = torch.zeros(R, length, dtype=torch.long)
    doc = torch.full((R, length), -1, dtype=torch.long)
    answer = torch.zeros(R, length, dtype=torch.bool)
    for r, row in enumerate(rows):
        c = 0
        for d in row or []:
            n = len(d)
            ids[r, c:c + n] = torch.tensor(d.prompt + d.answer)
            pos[r, c:c + n] = torch.arange(n)
            doc[r, c:c + n] = d.uid
            answer[r, c + len(d.prompt):c + n] = True
            c += n
        if c < length:
            if pad_in_loss and row:
                last = row[-1]
                pos[r, c:] = torch.arange(len(last), len(last) + length - c)
                doc[r, c:] = last.uid
                answer[r, c:] = True
            else:
                pos[r, c:] = torch.arange(length - c)
    return Batch(uid=torch.tensor(row_uids), input_ids=ids, position_ids=pos, doc_uid=doc, answer_mask=answer)


class SFTSource:
    """Per-step SFT rows of this rank (packed, or one padded document per row)."""

    def __init__(self, docs: list[SFTDoc], data_cfg, batch_size: int, seed: int, pad_id: int, rank: int = 0, world: int = 1):
        self.docs, self.cfg, self.pad_id, self.rank, self.world = docs, data_cfg, pad_id, rank, world
        self.sampler = EpochSampler(len(docs), batch_size, seed)

    def batch(self, step: int) -> Batch:
        picked = [self.docs[i] for i in self.sampler.indices(step)]
        # A document may be drawn twice in one step (tiny datasets): give each draw its own uid, so noise differs.
        picked = [SFTDoc(step * self.sampler.batch_size + j, d.prompt, d.answer) for j, d in enumerate(picked)]
        rows = pack_first_fit(picked, self.cfg.max_length) if self.cfg.packing else [[d] for d in picked]
        share = rank_share(len(rows), self.rank, self.world)
        mine = [rows[i] if i >= 0 else None for i in share]
        uids = [step * 1_000_000 + (i if i >= 0 else 999_999 - k) for k, i in enumerate(share)]
        return sft_rows_batch(mine, uids, self.pad_id, pad_in_loss=self.cfg.loss_on_padding and not self.cfg.packing)


class PreferenceSource:
    """Per-step preference pairs of this rank: left-padded prompts, right-padded chosen / rejected responses."""

    def __init__(self, pairs: list[PreferencePair], batch_size: int, seed: int, pad_id: int, rank: int = 0, world: int = 1):
        self.pairs, self.pad_id, self.rank, self.world = pairs, pad_id, rank, world
        self.sampler = EpochSampler(len(pairs), batch_size, seed)

    def batch(self, step: int) -> Batch:
        idx = self.sampler.indices(step)
        share = rank_share(len(idx), self.rank, self.world)
        items = [self.pairs[idx[i]] if i >= 0 else None for i in share]
        uids = [step * self.sampler.batch_size + i if i >= 0 else -1 - k for k, i in enumerate(share)]
        real = [p for p in items if p is not None] or [self.pairs[0]]
        P = max(len(p.prompt) for p in real)
        out = {}
        for name, (width, side) in {"prompt": (P, "left"),
                                    "chosen": (max(len(p.chosen) for p in real), "right"),
                                    "rejected": (max(len(p.rejected) for p in real), "right")}.items():
            ids = torch.full((len(items), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros(len(items), width, dtype=torch.bool)
            for b, p in enumerate(items):
                seq = getattr(p, name) if p is not None else [self.pad_id]
                sl = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
                ids[b, sl] = torch.tensor(seq)
                mask[b, sl] = p is not None or name == "prompt"
            out[f"{name}_ids"], out[f"{name}_mask"] = ids, mask
        weight = torch.tensor([1.0 if p is not None else 0.0 for p in items])
        return Batch(uid=torch.tensor(uids), pair_weight=weight, **out)

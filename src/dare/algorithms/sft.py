"""Supervised fine-tuning of diffusion LMs: the masked-diffusion NELBO on answer tokens (algorithms.md 0.1-0.4).

One algorithm covers every family through the adapter:

* masked models (LLaDA, LLaDA-MoE, Dream): the prompt is never masked; one ``t ~ U(t_min, t_max]`` per document;
  each answer token is masked with probability t; the loss is the masked cross-entropy weighted by ``weighting``
  (``scheduler`` = 1/t for the linear schedule, LLaDA; ``uniform``; Dream's ``cart``). Dream's shifted logits are
  handled by ``score_targets`` via ``adapter.prediction_rows``.
* block models (``adapter.is_block_causal``: SDAR, LLaDA2): the block NELBO with the one-pass ``[x_t ; x_0]``
  layout (logits from the noisy half). LLaDA2's recipe is ``t_min: 0.3, t_max: 0.8, weighting: uniform,
  normalize: masked_tokens``.

* uniform-noise encoder-decoder models (``adapter.is_encoder_decoder``: DiffusionGemma, NeMo AutoModel's recipe): each
  answer token is replaced by a uniform random token with probability t; the encoder reads the clean rows, the canvas
  holds the (corrupted) answers, blocked by the canvas length from each answer's first token. The loss is the
  cross-entropy over every answer position (``score_clean``: corrupted or not) plus ``encoder_loss_weight`` times the
  encoder's autoregressive cross-entropy over all next-token pairs of the documents (normalised by their count); a
  row is self-conditioned (a first pass without, a second fed its logits) with probability ``self_conditioning_p``.
  NeMo's recipe is ``weighting: uniform, normalize: answer_tokens`` (every answer position scored); with the default
  ``weighting: scheduler`` only corrupted positions are scored, weighted 1/t: the uniform-noise ELBO of
  docs/algorithms/uniform_noise.md.

* LLaDA2.1's editing stream (``edit_ratio`` > 0, masked families): answer tokens the mask left visible are replaced
  by uniform random tokens with that probability and scored at the same position (weight ``edit_weight``), so the
  model learns the token-to-token edits of its decoder; our reading of the report (its training code is not public).

``normalize``: ``answer_length`` (LLaDA: each document's sum divided by its own answer length, then the mean over
documents), ``answer_tokens`` (d1 SFT / SDAR: divided by all answer tokens of the step), ``masked_tokens``
(LLaDA2: the mean over masked tokens). All normalisers are global over the step.

Batch fields (packed or padded rows; see ``dare.trainer.data``): ``input_ids``, ``position_ids`` (restart at 0 for
every document), ``doc_uid`` (global example id per token, -1 for padding), ``answer_mask`` (tokens that may be
noised: answer + EOS). Noise is keyed by (iteration, document uid), so a document gets the same mask packed or
padded, in any row, on any rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Optional

import torch

from ..diffusion.corruption import apply_mask, block_diffusion_inputs, cart_weights
from ..diffusion.noise import sample_time
from ..diffusion.uniform import packed_canvas_view, uniform_replace
from ..models import masks as attn_masks
from .base import Algorithm, AlgorithmConfig, StepContext
from .batch import Batch, LogLik, View
from .registry import register_algorithm


@dataclass
class SFTConfig(AlgorithmConfig):
    name: str = "sft"
    t_min: float = 0.0
    t_max: float = 1.0
    eps: float = 1e-3  # LLaDA: t = (1 - eps) u + eps
    weighting: Literal["scheduler", "uniform", "cart"] = "scheduler"
    cart_geo_p: float = 0.3
    normalize: Literal["answer_length", "answer_tokens", "masked_tokens"] = "answer_length"
    # Uniform-noise encoder-decoder models (DiffusionGemma) only:
    # Also score the answer positions the corruption left clean (NeMo's flat canvas CE). None: yes unless the
    # weighting is 1/t ("scheduler": the uniform-noise ELBO scores the corrupted positions only).
    score_clean: Optional[bool] = None
    encoder_loss_weight: float = 1.0  # weight of the encoder's autoregressive cross-entropy
    self_conditioning_p: float = 0.5  # probability that a row is denoised twice, the second pass self-conditioned
    # LLaDA2.1's editing stream (token-to-token): of the answer tokens the mask left visible, this fraction is replaced
    # by uniform random tokens and predicted back (weight ``edit_weight`` x the token weight), so the model learns to
    # rewrite wrong tokens, what the editing decode (``rollout.sampler.editing_threshold``) does. 0: mask-only SFT.
    edit_ratio: float = 0.0
    edit_weight: float = 1.0
    # With the editing stream: the visible answer tokens left unchanged are scored too (predict themselves), at this
    # weight, so the decode's edits leave right tokens alone (measured: 0 lets it rewrite a quarter of them).
    keep_weight: float = 0.0
    # Fast-dLLM v2's training noise (block models): one t per block of the model's block size instead of one per
    # document, and each row trained twice, on its mask and on its complement (the answer tokens that mask left
    # visible), two forwards whose masked tokens all count. Its recipe: weighting uniform, normalize masked_tokens.
    t_per_block: bool = False
    complementary: bool = False
    # Nemotron-Labs-Diffusion's ``block_diff`` paradigm (bidirectional models): the one-pass ``[x_t ; x_0]`` input with
    # blocks of this size -- a noisy block sees itself and the earlier clean blocks, the clean half is token-causal --
    # and ``ar_loss_weight`` times the clean half's next-token cross-entropy (every next-token pair of a document, its
    # mean over them) beside the diffusion loss. None: off. Nemotron's published config: block_size 32, ar_loss_weight 1.
    block_diff: Optional[int] = None
    ar_loss_weight: float = 1.0

    def __post_init__(self):
        if not 0.0 <= self.t_min < self.t_max <= 1.0:
            raise ValueError(f"need 0 <= t_min < t_max <= 1, got t_min={self.t_min}, t_max={self.t_max}")
        if not 0.0 < self.cart_geo_p < 1.0:
            raise ValueError(f"cart_geo_p must be in (0, 1), got {self.cart_geo_p}")
        if self.encoder_loss_weight < 0 or not 0.0 <= self.self_conditioning_p <= 1.0:
            raise ValueError(f"need encoder_loss_weight >= 0 and 0 <= self_conditioning_p <= 1, got "
                             f"{self.encoder_loss_weight}, {self.self_conditioning_p}")
        if not 0.0 <= self.edit_ratio < 1.0 or self.edit_weight < 0 or self.keep_weight < 0:
            raise ValueError(f"need 0 <= edit_ratio < 1, edit_weight >= 0 and keep_weight >= 0, got {self.edit_ratio}, "
                             f"{self.edit_weight}, {self.keep_weight}")
        if self.keep_weight > 0 and self.edit_ratio == 0:
            raise ValueError("keep_weight scores the tokens the editing stream left unchanged: it needs edit_ratio > 0")
        if self.edit_ratio > 0 and self.weighting == "cart":
            raise ValueError("edit_ratio needs weighting scheduler or uniform (cart weights only masked positions)")
        if self.block_diff is not None and (self.block_diff < 1 or self.ar_loss_weight < 0):
            raise ValueError(f"need block_diff >= 1 and ar_loss_weight >= 0, got {self.block_diff}, {self.ar_loss_weight}")
        if self.complementary and (self.weighting != "uniform" or self.edit_ratio > 0):
            raise ValueError("complementary (Fast-dLLM v2's mask pairs) needs weighting uniform and no edit_ratio: "
                             "the complement masks each token with probability 1 - t, so 1/t weights do not fit it")


def _edit_draws(gen: torch.Generator, visible: torch.Tensor, clean: torch.Tensor, ratio: float, adapter):
    """(edited [n] bool, random tokens [n]): each ``visible`` token is replaced with probability ``ratio`` by a token
    drawn uniformly from the vocabulary without the mask token and the token itself (an edit that changes nothing
    teaches nothing)."""
    n = clean.shape[0]
    edit = (torch.rand(n, generator=gen) < ratio) & visible
    vocab = adapter.vocab_size
    # uniform over vocab \ {mask, clean}: draw from vocab - 2 values, then step over the two excluded ids
    draw = torch.randint(0, vocab - 2, (n,), generator=gen)
    excluded = torch.stack([torch.full_like(clean, int(adapter.mask_token_id)), clean], 1).sort(1).values
    tokens = draw + (draw >= excluded[:, 0]).long()
    tokens = tokens + (tokens >= excluded[:, 1]).long()
    return edit, tokens


def doc_segments(doc_uid_row: torch.Tensor) -> list[tuple[int, int, int]]:
    """(uid, start, end) of the documents of one row (consecutive runs of the same uid >= 0)."""
    out = []
    vals = doc_uid_row.tolist()
    start = 0
    for i in range(1, len(vals) + 1):
        if i == len(vals) or vals[i] != vals[start]:
            if vals[start] >= 0:
                out.append((vals[start], start, i))
            start = i
    return out


@register_algorithm
class SFT(Algorithm):
    """Masked-token cross-entropy / t on the answer (block NELBO over [x_t ; x_0] on block models)."""
    name = "sft"
    config_class = SFTConfig
    supports: ClassVar[tuple[str, ...]] = ("bidirectional", "block_causal", "encoder_decoder")
    data_kind = "sft"

    def corrupt(self, ctx: StepContext, batch: Batch, iteration: int) -> list[View]:
        cfg = self.config
        ids, pos, docs, answer = batch["input_ids"], batch["position_ids"], batch["doc_uid"], batch["answer_mask"]
        masked = torch.zeros(ids.shape, dtype=torch.bool)
        weight = torch.zeros(ids.shape, dtype=torch.float32)
        t_tok = torch.ones(ids.shape, dtype=torch.float32)
        answer_cpu = answer.bool().cpu()
        uniform = ctx.adapter.noise == "uniform"
        if cfg.edit_ratio > 0 and uniform:
            raise ValueError("edit_ratio is the masked families' editing stream; a uniform-noise model's corruption "
                             "already replaces tokens (weighting / score_clean set what it scores)")
        if (cfg.t_per_block or cfg.complementary) and not ctx.adapter.is_block_causal:
            raise ValueError("t_per_block and complementary are Fast-dLLM v2's training noise for block-diffusion "
                             f"models; {ctx.adapter.family} is not one")
        if cfg.block_diff is not None and (ctx.adapter.attention != "bidirectional" or ctx.adapter.shift_logits):
            raise ValueError(f"block_diff (Nemotron-Labs-Diffusion's paradigm) trains a bidirectional model with "
                             f"unshifted logits on [x_t ; x_0]; {ctx.adapter.family} is not one (block models train "
                             f"[x_t ; x_0] already)")
        # the complementary view's scored tokens and weights (its tokens weigh what the first view's would)
        complement = torch.zeros(ids.shape, dtype=torch.bool) if cfg.complementary else None
        complement_weight = torch.zeros(ids.shape, dtype=torch.float32) if cfg.complementary else None
        noisy = ids.cpu().clone()
        edited = torch.zeros(ids.shape, dtype=torch.bool)
        for r in range(ids.shape[0]):
            for uid, s, e in doc_segments(docs[r].cpu()):
                g = ctx.generator(iteration, uid, 0)
                ans = answer_cpu[r, s:e]
                if cfg.t_per_block:  # one t per block the document's positions fall in, then the token draws
                    block = pos[r, s:e].cpu() // ctx.adapter.block_size
                    t = torch.tensor([sample_time(g, cfg.t_min, cfg.t_max, cfg.eps)
                                      for _ in range(int(block.max()) + 1)])[block]
                else:
                    t = sample_time(g, cfg.t_min, cfg.t_max, cfg.eps)
                m = (torch.rand(e - s, generator=g) < t) & ans
                if uniform:  # the doc's random tokens, from its own generator (the same packed or padded)
                    noisy[r:r + 1, s:e] = uniform_replace(noisy[r:r + 1, s:e], m[None], ctx.adapter.vocab_size,
                                                          [ctx.generator(iteration, uid, "uniform")])
                    score_clean = cfg.weighting != "scheduler" if cfg.score_clean is None else cfg.score_clean
                    m = ans if score_clean else m  # scored positions
                masked[r, s:e] = m
                t_tok[r, s:e] = t
                if cfg.weighting == "scheduler":
                    w = 1.0 / t if cfg.t_per_block else torch.full((e - s,), 1.0 / t)
                elif cfg.weighting == "uniform":
                    w = torch.ones(e - s)
                else:  # cart: context-adaptive, replaces the time weight
                    w = cart_weights(m, ~m, cfg.cart_geo_p)
                if cfg.normalize == "answer_length":
                    w = w / max(int(ans.sum()), 1)
                weight[r, s:e] = w * m
                if complement is not None:
                    complement[r, s:e] = ans & ~m
                    complement_weight[r, s:e] = w * (ans & ~m)
                if cfg.edit_ratio > 0:  # its own stream: the masks above are those of mask-only SFT
                    edit, tokens = _edit_draws(ctx.generator(iteration, uid, "edit"), ans & ~m, ids.cpu()[r, s:e],
                                               cfg.edit_ratio, ctx.adapter)
                    noisy[r, s:e] = torch.where(edit, tokens, noisy[r, s:e])
                    keep = ans & ~m & ~edit & (cfg.keep_weight > 0)
                    edited[r, s:e] = edit | keep
                    weight[r, s:e] += w * (cfg.edit_weight * edit + cfg.keep_weight * keep)
        dev = ids.device
        masked, weight = masked.to(dev), weight.to(dev)
        if ctx.adapter.is_encoder_decoder:
            return [self._canvas_view(ctx, batch, iteration, noisy.to(dev), weight, t_tok.to(dev))]
        noisy = apply_mask(noisy.to(dev) if cfg.edit_ratio > 0 else ids, masked, ctx.adapter.mask_token_id)
        masked = masked | edited.to(dev)  # the edited (and kept) tokens are scored too, at their own weight
        if cfg.block_diff is not None:
            return [self._block_diff_view(noisy, ids, pos, docs, masked, weight, t_tok.to(dev))]
        if ctx.adapter.is_block_causal:
            input_ids, layout = block_diffusion_inputs(noisy, ids, pos)
        else:
            input_ids = noisy
            layout = attn_masks.TokenLayout.plain(pos, doc=attn_masks.doc_ids_from_positions(pos))
        views = [View(input_ids, masked, ids, weight, layout=layout, info={"t": t_tok.to(dev)})]
        if complement is not None:  # the same rows under the complementary mask: a second forward
            complement = complement.to(dev)
            other, other_layout = block_diffusion_inputs(apply_mask(ids, complement, ctx.adapter.mask_token_id), ids,
                                                         pos)
            views.append(View(other, complement, ids, complement_weight.to(dev), layout=other_layout,
                              info={"t": (1 - t_tok).to(dev)}))
        return views

    def _block_diff_view(self, noisy, ids, pos, docs, masked, weight, t_tok) -> View:
        """Nemotron's ``block_diff`` view: ``[x_t ; x_0]`` with a token-causal clean half; the first half scores the
        masked tokens, the second every next-token pair of a document (weight 1, label the next token)."""
        input_ids, layout = block_diffusion_inputs(noisy, ids, pos, clean_causal=True, block_size=self.config.block_diff)
        docs = docs.to(ids.device)
        pair = torch.zeros_like(masked)
        pair[:, :-1] = (docs[:, :-1] == docs[:, 1:]) & (docs[:, :-1] >= 0)
        nxt = torch.zeros_like(ids)
        nxt[:, :-1] = ids[:, 1:]
        return View(input_ids, torch.cat([masked, pair], 1), torch.cat([ids, nxt], 1),
                    torch.cat([weight, pair.float()], 1), layout=layout, info={"t": t_tok})

    def _ar_split(self, view: View) -> int:
        """The view's scored columns ``[:n]`` / ``[n:]`` split between the autoregressive and the diffusion term:
        (n, AR first) -- an encoder-decoder's encoder rows lead, ``block_diff``'s clean half trails (negative n)."""
        if self.config.block_diff is not None:
            return -(view.targets.shape[1] // 2)
        return getattr(view.layout, "enc_len", 0)

    def _canvas_view(self, ctx: StepContext, batch: Batch, iteration: int, noisy, weight, t_tok) -> View:
        """The encoder / canvas view of packed rows (uniform-noise encoder-decoder models)."""
        cfg = self.config
        flags = torch.tensor([bool(torch.rand((), generator=ctx.generator(iteration, int(u), "self_cond")) < cfg.self_conditioning_p)
                              for u in batch["uid"].tolist()], device=noisy.device)
        ids, pos, docs, answer = batch["input_ids"], batch["position_ids"], batch["doc_uid"], batch["answer_mask"].bool()
        input_ids, targets, labels, w, layout = packed_canvas_view(ids, pos, docs, answer, noisy, weight, ctx.adapter.block_size,
                                                                   flags if cfg.self_conditioning_p > 0 else None)
        return View(input_ids, targets, labels, w, layout=layout, info={"t": t_tok, "self_conditioned": flags.float()})

    def normalizers(self, batch: Batch) -> dict[str, float]:
        docs = batch["doc_uid"]
        n_docs = sum(len(doc_segments(docs[r].cpu())) for r in range(docs.shape[0]))
        out = {"docs": float(n_docs), "answer_tokens": float(batch["answer_mask"].sum()), "samples": float(batch.size)}
        if batch.views:
            views = batch.views[0]
            parts = [_columns(v.targets, self._ar_split(v)) for v in views]
            out["masked_tokens"] = float(sum(d.sum() for d, _ in parts))
            out["ar_tokens"] = float(sum(a.sum() for _, a in parts))
        return out

    def loss(self, ctx: StepContext, batch: Batch, current: LogLik, iteration: int):
        key = {"answer_length": "docs", "answer_tokens": "answer_tokens", "masked_tokens": "masked_tokens"}[self.config.normalize]
        view = batch.views[iteration][0]
        split = self._ar_split(view)  # the autoregressive columns: an encoder's rows, block_diff's clean half
        value, ar_value = _columns(current.value, split)
        diffusion = -value.sum() / max(ctx.norms[key], 1.0)
        loss = diffusion
        targets, _ = _columns(view.targets, split)
        metrics = {"masked_frac": float(targets.sum()) / max(ctx.norms["answer_tokens"], 1.0)}
        if split:
            ar = -ar_value.sum() / max(ctx.norms.get("ar_tokens", 0.0), 1.0)
            weight = self.config.ar_loss_weight if self.config.block_diff is not None else self.config.encoder_loss_weight
            loss = diffusion + weight * ar
            metrics.update({"diffusion_loss": float(diffusion.detach()), "ar_loss": float(ar.detach())})
        return loss, metrics


def _columns(t: torch.Tensor, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(diffusion columns, autoregressive columns) of ``t [B, W]`` for ``SFT._ar_split``'s ``split``: the AR columns
    lead (``split > 0``), trail (``split < 0``) or are none (0)."""
    if split >= 0:
        return t[:, split:], t[:, :split]
    return t[:, :split], t[:, split:]

"""lm-evaluation-harness plugin: ``LM`` subclass ``"dare"`` backed by the diffusion sampler and the ELBO.

Import this module (``import dare.eval.lm_eval_plugin`` or ``dare.eval.register_lm_eval()``) to register
the model, then ``lm_eval.simple_evaluate(model="dare", model_args="pretrained=PATH,mc_num=32", tasks=[...])``
or pass a ``DareLM`` instance. ``pip install "dare[eval]"`` provides lm-eval; dare itself never imports it.

* ``generate_until``: ``dare.rollout.generate`` with the configured ``SamplerConfig`` (``max_gen_toks`` sets the
  generation length, rounded up to whole blocks, unless ``fixed_gen_length``); text is cut at the first ``until``
  string. Documents of a task
  exported by ``dare.eval.lm_eval_tasks`` are decoded with the seed ``dare eval`` uses for them.
* ``loglikelihood``: the ELBO Monte-Carlo estimate (``mc_num`` samples, prompt clean, stratified mask counts,
  ``L/l`` weights; Dream's shifted logits and block-diffusion layouts handled); ``is_greedy`` from greedy
  low-confidence decoding of the continuation (``greedy_check=False`` skips it and reports False).
* ``loglikelihood_rolling``: disjoint windows of ``max_length`` tokens, each scored with the ELBO given the
  preceding window as context.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Optional

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..diffusion.noise import derive_seed
from ..rollout import SamplerConfig, generate
from .likelihood import elbo_loglikelihood, greedy_matches
from .speed import rollout_speed

log = logging.getLogger(__name__)
_SAMPLER_FIELDS = {f.name for f in dataclasses.fields(SamplerConfig)}


def _as_bool(v) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("dare")
class DareLM(LM):
    def __init__(self, pretrained: Optional[str] = None, model=None, tokenizer=None, *, dtype: Optional[str] = None,
                 device: Optional[str] = None, mask_token_id: Optional[int] = None, mc_num: int = 32,
                 mc_batch_size: int = 32, greedy_check: bool = True, seed: int = 0, batch_size=1,
                 max_length: Optional[int] = None, add_bos_token: bool = False, fixed_gen_length: bool = False,
                 sampler: Optional[SamplerConfig] = None, **sampler_kwargs):
        super().__init__()
        unknown = set(sampler_kwargs) - _SAMPLER_FIELDS
        if unknown:
            raise ValueError(f"dare lm-eval model: unknown argument(s) {sorted(unknown)}; sampler fields are "
                             f"{', '.join(sorted(_SAMPLER_FIELDS))}")
        if model is None:
            if pretrained is None:
                raise ValueError("dare lm-eval model: give pretrained=PATH (or model= and tokenizer= objects)")
            from ..models.model_spec import load_model_spec, resolve_device
            model, tokenizer = load_model_spec(str(pretrained), dtype=dtype, device=resolve_device(device),
                                               mask_token_id=mask_token_id)
        elif tokenizer is None:
            raise ValueError("dare lm-eval model: a model object needs its tokenizer=")
        self.model, self.tokenizer = model.eval(), tokenizer
        if sampler is None and pretrained is not None:  # the checkpoint's own decoding settings fill what args do not
            from ..models.decoding import read_decoding, sampler_defaults
            own = read_decoding(pretrained, _SAMPLER_FIELDS)
            if own is not None:
                sampler_kwargs = {**sampler_defaults(own[0].get("sampler", {}), sampler_kwargs), **sampler_kwargs}
        base = sampler or SamplerConfig()
        self.sampler = dataclasses.replace(base, **sampler_kwargs) if sampler_kwargs else base
        self.mc_num, self.mc_batch_size = int(mc_num), int(mc_batch_size)
        self.greedy_check, self.seed = _as_bool(greedy_check), int(seed)
        self.batch_size = 1 if str(batch_size).startswith("auto") else int(batch_size)
        self.max_length = int(max_length) if max_length else None
        self.add_bos_token = _as_bool(add_bos_token)
        # A recipe that publishes a generation length per task (DARE's Table 2 settings) keeps it whatever the
        # task's max_gen_toks says.
        self.fixed_gen_length = _as_bool(fixed_gen_length)
        # task -> {samples, nfe, valid_tokens, seconds} of generate_until requests (speed beside the score)
        self.speed: dict[str, dict] = {}
        self._device = model.device

    # --- chat support (lm-eval --apply_chat_template) ---------------------------------------------
    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "dare")).replace("/", "__")

    def chat_template(self, chat_template=False):
        return getattr(self.tokenizer, "chat_template", None)

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # --- tokens ------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _prefix_token(self) -> list[int]:
        for tid in (getattr(self.tokenizer, "bos_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if tid is not None:
                return [int(tid)]
        return []

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Word-boundary spaces belong to the continuation (as lm-eval's HF model does).
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        whole = self._encode(context + continuation)
        ctx = self._encode(context)
        ctx, cont = whole[:len(ctx)], whole[len(ctx):]
        if self.add_bos_token or not ctx:
            ctx = self._prefix_token() + ctx
        return ctx, cont

    def _gen(self, *key) -> torch.Generator:
        return torch.Generator().manual_seed(derive_seed(self.seed, "lm-eval", *key))

    # --- LM API ------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False):
        from tqdm import tqdm

        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="dare loglikelihood"):
            context, continuation = req.args
            ctx, cont = self._pair(context, continuation)
            if self.max_length and len(ctx) + len(cont) > self.max_length:
                ctx = ctx[-max(1, self.max_length - len(cont)):]
            ll = elbo_loglikelihood(self.model, ctx, cont, mc_num=self.mc_num, batch_size=self.mc_batch_size,
                                    generator=self._gen("ll", context, continuation))
            # The greedy replay is masked decoding: uniform-noise canvas models report False, as greedy_check=False.
            greedy = greedy_matches(self.model, ctx, cont) if self.greedy_check and not self.model.adapter.is_encoder_decoder else False
            out.append((ll, bool(greedy)))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), (ll, bool(greedy)))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        out = []
        for req in requests:
            (text,) = req.args
            tokens = self._encode(text)
            window = self.max_length or max(1, len(tokens))
            total, prev = 0.0, self._prefix_token()
            for start in range(0, len(tokens), window):
                piece = tokens[start:start + window]
                ctx = prev[-window:] if prev else self._prefix_token()
                total += elbo_loglikelihood(self.model, ctx, piece, mc_num=self.mc_num, batch_size=self.mc_batch_size,
                                            generator=self._gen("rolling", text, start))
                prev = piece
            out.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        return out

    def _sampler_for(self, gen_kwargs: dict) -> SamplerConfig:
        cfg = self.sampler
        changes = {}
        max_toks = gen_kwargs.get("max_gen_toks")
        if max_toks and not self.fixed_gen_length:
            block = cfg.block_length
            length = int(math.ceil(int(max_toks) / block) * block)
            if length != cfg.gen_length:
                changes["gen_length"] = length
                if cfg.steps is not None:  # keep the tokens-per-step ratio
                    changes["steps"] = max(1, round(cfg.steps * length / cfg.gen_length))
        if "temperature" in gen_kwargs and gen_kwargs.get("do_sample", True):
            changes["temperature"] = float(gen_kwargs["temperature"])
        return dataclasses.replace(cfg, **changes) if changes else cfg

    def _gen_seed(self, request) -> int:
        """A document exported from a dare benchmark (``dare.eval.lm_eval_tasks``) carries the seed ``dare eval``
        gives that example, so both harnesses draw the same samples; any other request's seed comes from its text."""
        doc = getattr(request, "doc", None)
        if isinstance(doc, dict) and doc.get("dare_seed") is not None:
            return int(doc["dare_seed"])
        return derive_seed(self.seed, "lm-eval-gen", request.args[0])

    def generate_until(self, requests, disable_tqdm: bool = False):
        from tqdm import tqdm

        out: list[Optional[str]] = [None] * len(requests)
        def kwargs_key(i):
            return repr(sorted((requests[i].args[1] or {}).items(), key=lambda kv: kv[0]))

        # Batch requests that share generation settings; similar prompt lengths together.
        order = sorted(range(len(requests)), key=lambda i: (kwargs_key(i), -len(requests[i].args[0])))
        batches, current = [], []
        for i in order:
            if current and (len(current) == self.batch_size or kwargs_key(current[0]) != kwargs_key(i)):
                batches.append(current)
                current = []
            current.append(i)
        if current:
            batches.append(current)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="dare generate_until")
        for idx in batches:
            kw = requests[idx[0]].args[1] or {}
            cfg = self._sampler_for(kw)
            prompts = []
            for i in idx:
                ids = self._encode(requests[i].args[0])
                if self.add_bos_token:
                    ids = self._prefix_token() + ids
                if self.max_length and len(ids) + cfg.gen_length > self.max_length:
                    ids = ids[-max(1, self.max_length - cfg.gen_length):]
                prompts.append(ids or self._prefix_token())
            seeds = [self._gen_seed(requests[i]) for i in idx]
            t0 = time.perf_counter()
            ro = generate(self.model, prompts, cfg, seeds=seeds)
            seconds = time.perf_counter() - t0
            texts = ro.texts(self.tokenizer)
            for i, valid, nfe in zip(idx, *rollout_speed(ro)):
                # Counted per task (lm-eval's Instance.task_name); a batch's time is shared out by rows.
                c = self.speed.setdefault(getattr(requests[i], "task_name", None) or "?", dict.fromkeys(
                    ("samples", "nfe", "valid_tokens", "seconds"), 0))
                c["samples"] += 1
                c["nfe"] += int(nfe)
                c["valid_tokens"] += int(valid)
                c["seconds"] += seconds / len(idx)
            for i, text in zip(idx, texts):
                until = (requests[i].args[1] or {}).get("until") or []
                for stop in [until] if isinstance(until, str) else until:
                    if stop and stop in text:
                        text = text[:text.index(stop)]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            bar.update(len(idx))
        bar.close()
        return out

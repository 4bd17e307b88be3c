"""OpenCompass model class for dare models (no OpenCompass fork needed).

In an OpenCompass config::

    from dare.eval.opencompass_model import DareOpenCompassModel
    models = [dict(type=DareOpenCompassModel, abbr="llada-8b-instruct", path="GSAI-ML/LLaDA-8B-Instruct",
                   sampler=dict(gen_length=256, block_length=32, steps=256), mc_num=32, max_out_len=256,
                   batch_size=8, run_cfg=dict(num_gpus=1))]

OpenCompass pins numpy<2 and datasets<4, so it lives in its own environment (docs/eval.md). This module
imports it only if present: without OpenCompass the class derives from a small stand-in base with the same
constructor, so dare's own tests can exercise it. ``generate`` runs the diffusion sampler; ``get_ppl`` and
``get_loglikelihood`` use the ELBO Monte-Carlo estimate (``dare.eval.likelihood``).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import torch

from ..diffusion.noise import derive_seed
from ..rollout import SamplerConfig, generate
from .likelihood import elbo_loglikelihood

try:  # OpenCompass is optional (its own environment)
    from opencompass.models.base import BaseModel as _Base
    from opencompass.registry import MODELS as _MODELS
    HAVE_OPENCOMPASS = True
except ImportError:
    HAVE_OPENCOMPASS = False
    _MODELS = None

    class _Base:  # the attributes OpenCompass's BaseModel sets, for use without OpenCompass
        is_api = False

        def __init__(self, path: str, max_seq_len: int = 2048, tokenizer_only: bool = False,
                     meta_template: Optional[Dict] = None, generation_kwargs: Optional[Dict] = None, sync_rank: bool = False):
            self.path, self.max_seq_len, self.tokenizer_only = path, max_seq_len, tokenizer_only
            self.meta_template, self.generation_kwargs, self.sync_rank = meta_template, generation_kwargs or {}, sync_rank
            self.eos_token_id = (meta_template or {}).get("eos_token_id")


class DareOpenCompassModel(_Base):
    def __init__(self, path: str, max_seq_len: int = 4096, tokenizer_only: bool = False,
                 meta_template: Optional[Dict] = None, generation_kwargs: Optional[Dict] = None,
                 sampler: Optional[Dict] = None, mc_num: int = 32, mc_batch_size: int = 32, seed: int = 0,
                 dtype: Optional[str] = None, device: Optional[str] = None, mask_token_id: Optional[int] = None,
                 tokenizer_path: Optional[str] = None, chat_template: bool = False, model=None, tokenizer=None, **kwargs):
        super().__init__(path=path, max_seq_len=max_seq_len, tokenizer_only=tokenizer_only,
                         meta_template=meta_template, generation_kwargs=generation_kwargs or {})
        if model is None or tokenizer is None:
            from ..models.model_spec import load_model_spec, resolve_device
            model, tokenizer = load_model_spec(path, dtype=dtype, device=resolve_device(device), mask_token_id=mask_token_id,
                                               tokenizer=tokenizer_path)
        self.model, self.tokenizer = model, tokenizer
        self.sampler = SamplerConfig(**(sampler or {}))
        self.mc_num, self.mc_batch_size, self.seed = int(mc_num), int(mc_batch_size), int(seed)
        # Wrap plain-string prompts as one user turn of the tokenizer's chat template (instruct models
        # evaluated without an OpenCompass meta_template).
        self.chat_template = bool(chat_template)

    # --- tokens ------------------------------------------------------------------------------------
    def encode(self, prompt: str) -> torch.Tensor:
        return torch.tensor([self._ids(prompt)], dtype=torch.long)

    def decode(self, tokens: torch.Tensor) -> str:
        return self.tokenizer.decode(torch.as_tensor(tokens).flatten().tolist(), skip_special_tokens=True)

    def get_token_len(self, prompt: str) -> int:
        return len(self._ids(prompt))

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(str(text), add_special_tokens=True)["input_ids"]

    def _prompt(self, text: str) -> list[int]:
        if self.chat_template and getattr(self.tokenizer, "chat_template", None):
            rendered = self.tokenizer.apply_chat_template([{"role": "user", "content": str(text)}], tokenize=False,
                                                          add_generation_prompt=True)
            ids = self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = self._ids(text)
        return ids[-self.max_seq_len:]

    # --- OpenCompass API ---------------------------------------------------------------------------
    def generate(self, inputs: List[str], max_out_len: int, stopping_criteria: Optional[List[str]] = None,
                 **kwargs) -> List[str]:
        cfg = self.sampler
        block = cfg.block_length
        length = -(-int(max_out_len) // block) * block  # whole blocks, at least max_out_len tokens
        if length != cfg.gen_length:
            steps = None if cfg.steps is None else max(1, round(cfg.steps * length / cfg.gen_length))
            cfg = dataclasses.replace(cfg, gen_length=length, steps=steps)
        prompts = [self._prompt(t) for t in inputs]
        seeds = [derive_seed(self.seed, "opencompass", str(t)) for t in inputs]
        texts = generate(self.model, prompts, cfg, seeds=seeds).texts(self.tokenizer)
        stops = list(stopping_criteria or []) + list(self.generation_kwargs.get("stop", []) if self.generation_kwargs else [])
        out = []
        for text in texts:
            for s in stops:
                if s and s in text:
                    text = text[:text.index(s)]
            out.append(text)
        return out

    def _elbo(self, ctx: list[int], cont: list[int], key: str) -> float:
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "opencompass-ll", key))
        return elbo_loglikelihood(self.model, ctx, cont, mc_num=self.mc_num, batch_size=self.mc_batch_size, generator=gen)

    def get_ppl(self, inputs: List[str], mask_length: Optional[List[int]] = None) -> List[float]:
        """Mean negative log-likelihood per scored token (OpenCompass's "ppl" is the mean CE, not its exp).

        The first ``mask_length[i]`` tokens (at least one, the BOS/first token) are context, the rest scored.
        """
        out = []
        for i, text in enumerate(inputs):
            ids = self._ids(text)[-self.max_seq_len:]
            n_ctx = max(1, mask_length[i] if mask_length is not None else 1)
            ctx, cont = ids[:n_ctx], ids[n_ctx:]
            out.append(-self._elbo(ctx, cont, f"ppl:{text}:{n_ctx}") / max(1, len(cont)))
        return out

    def get_loglikelihood(self, inputs: List[str], conts: List[str], mask_length: Optional[List[int]] = None) -> List[float]:
        """ELBO of each continuation given its input (``inputs[i]`` ends with ``conts[i]``, as OpenCompass passes)."""
        out = []
        for text, cont in zip(inputs, conts):
            text = str(text)
            context = text[:len(text) - len(cont)] if cont and text.endswith(cont) else text
            whole, ctx = self._ids(context + cont), self._ids(context)
            out.append(self._elbo(whole[:len(ctx)], whole[len(ctx):], f"ll:{context}:{cont}"))
        return out


if _MODELS is not None:
    _MODELS.register_module(name="DareOpenCompassModel", module=DareOpenCompassModel, force=True)

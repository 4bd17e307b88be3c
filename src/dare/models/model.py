"""``DiffusionLM``: the one native decoder behind every family.

``model(input_ids, attention_mask=None, position_ids=None).logits`` returns raw logits exactly as the
family's reference code does (Dream unshifted; use ``model.adapter.prediction_logits``). Beyond the HF-style
call it takes what diffusion samplers and trainers need (``forward`` documents each argument):

* ``past_key_values=KVCache`` with ``store_kv`` / ``kv_start`` (see ``cache.py``),
* ``layout=TokenLayout`` for packed and block-diffusion training batches (see ``masks.py``),
* ``request=LogitsRequest(...)`` (``outputs.py``): which rows get logits and/or hidden states. ``rows`` (a slice or
  per-row positions) makes the last layer compute queries, attention and MLP only for them (every row still gives
  its keys and values); ``keep`` (bool over those rows) packs the kept rows ``[k, V]`` and runs the last MLP, the
  final norm and the LM head for them alone (samplers: masked positions); ``LogitsRequest.hidden_states()`` returns
  the final hidden states for chunked linear + cross-entropy.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import masks
from .adapter import FamilyAdapter
from .arch import ModelArch
from .cache import KVCache
from .checkpoint import save_pretrained
from .fused import FusedProjections
from .lean import lean_layer, run_compiled, snapshot_layer, stack_signature
from .sequence_parallel import SequenceGroup, ShardedInputs, check_heads, split_sequence
from .modules import AttnInputs, DecoderLayer, RMSNorm, RotaryEmbedding, SparseMoE, pack_rows, query_scale, take_rows
from .outputs import ALL_LOGITS, LogitsRequest, ModelOutput, QuerySel

ATTN_BACKENDS = ("auto", "sdpa", "flex", "flash_attn")
# CPU GEMM kernels round a row differently when the product has fewer rows than this (a small-M code path), so
# packed ``LogitsRequest.keep`` rows are padded up to it: a kept row then gets the bits it gets among all rows.
MIN_EXACT_GEMM_ROWS = 16


def _kept_rows(keep: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Flat indices of the True entries of ``keep [B, n]`` (padded with index 0 up to ``MIN_EXACT_GEMM_ROWS`` or
    B * n rows, whichever is smaller) and how many are real."""
    flat = keep.reshape(-1).nonzero().flatten()
    k = flat.numel()
    pad = min(MIN_EXACT_GEMM_ROWS, keep.numel()) - k
    if pad > 0:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat, k


class Backbone(nn.Module):
    def __init__(self, arch: ModelArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
        return torch.cuda.is_available()
    except ImportError:
        return False


class DiffusionLM(nn.Module):
    supports_sequence_parallel = True  # ``sequence_parallel=`` in ``forward`` (``sequence_parallel.py``)

    def __init__(self, arch: ModelArch, adapter: FamilyAdapter, hf_config: dict, family: str, attn_backend: str = "auto"):
        super().__init__()
        self.arch, self.adapter, self.hf_config, self.family = arch, adapter, dict(hf_config), family
        self.model = Backbone(arch)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(arch.rotary_dim, arch.rope_theta, arch.rope_inv_freq_follows_dtype,
                                      arch.rope_scaling)
        self.set_attn_backend(attn_backend)
        self.gradient_checkpointing = False

    # --- configuration ---------------------------------------------------------------------------
    def set_attn_backend(self, backend: str) -> None:
        if backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {backend!r}")
        if backend == "flash_attn" and not _flash_attn_available():
            raise ValueError("attn_backend='flash_attn' needs the flash-attn package and a CUDA device (pip install 'dare[gpu]')")
        self.attn_backend = backend

    def gradient_checkpointing_enable(self, enabled: bool = True) -> None:
        self.gradient_checkpointing = enabled

    def fuse_projections(self) -> "DiffusionLM":
        """Run q/k/v and gate/up as one GEMM each at inference (see ``fused.py``); checkpoints keep their layout.
        Done at load; redone after ``.to()`` and friends, which give the weights new storage."""
        for m in self.modules():
            if isinstance(m, FusedProjections):
                m.fuse_projections()
        self._fuse_wanted = True
        return self

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        if self.__dict__.get("_fuse_wanted"):
            self.fuse_projections()
        return out

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def get_input_embeddings(self):
        return self.model.embed_tokens

    @contextlib.contextmanager
    def decoding(self, compile: bool = False) -> Iterator["DiffusionLM"]:
        """For a sampler's loop (weights fixed, no gradients): forwards run each dense layer as plain functions over
        a snapshot of its inference weights taken here (``lean.py``), bit for bit the module path minus its
        per-call overhead. Layers that must run through their modules still do; forwards under autograd ignore it.
        ``compile``: cached steps whose every layer has a snapshot run the layer stack as one ``torch.compile``d
        graph (not bit-exact; see ``lean.compiled_stack``)."""
        layers = [snapshot_layer(layer) for layer in self.model.layers]
        previous = self.__dict__.get("_lean"), self.__dict__.get("_lean_compile")
        self.__dict__["_lean"] = layers if any(p is not None for p in layers) else None
        # compiling: the signature its graphs are keyed by (None: no compiled steps)
        self.__dict__["_lean_compile"] = stack_signature(layers) if compile and None not in layers else None
        try:
            yield self
        finally:
            self.__dict__["_lean"], self.__dict__["_lean_compile"] = previous

    def new_cache(self, capacity: Optional[int] = None) -> KVCache:
        return KVCache(self.arch.num_layers, capacity)

    # --- masks -----------------------------------------------------------------------------------
    def _layout_inputs(self, layout: masks.TokenLayout, x: torch.Tensor) -> AttnInputs:
        block = layout.block_size if layout.block_size is not None else self.adapter.attn_block_size
        backend = self.attn_backend
        on_gpu = x.is_cuda
        all_clean_bidir = block is None and bool((layout.seg == 1).all()) and bool(layout.valid.all())
        if backend in ("flash_attn",) or (backend == "auto" and on_gpu and all_clean_bidir and _flash_attn_available()):
            if all_clean_bidir:
                cu = masks.cu_seqlens_from_doc_ids(layout.doc)
                return AttnInputs(cu_seqlens=cu, max_seqlen=int((cu[1:] - cu[:-1]).max()))
        # FlexAttention has no backward on CPU: there, build the dense mask from the same predicate.
        if backend == "flex" or (backend == "auto" and on_gpu):
            if on_gpu or not torch.is_grad_enabled():
                return AttnInputs(block_mask=masks.flex_block_mask(layout, layout, block, x.device))
        return AttnInputs(mask=masks.dense_mask(layout, layout, block))

    def _attn_inputs(self, B: int, L: int, position_ids, attention_mask, cache, layout, x) -> AttnInputs:
        if layout is not None:
            return self._layout_inputs(layout, x)
        if attention_mask is not None:
            if attention_mask.dim() == 4:
                return AttnInputs(mask=attention_mask, cache=cache)
            if attention_mask.dim() != 2:
                raise ValueError(f"attention_mask must be 2D [B, L] or 4D [B, 1, Lq, Lk], got shape {tuple(attention_mask.shape)}")
            valid = attention_mask.bool()
            if cache is not None or valid.shape[1] != L:
                return AttnInputs(mask=valid[:, None, None, :], cache=cache)
            if bool(valid.all()) and not self.adapter.is_block_causal:
                return AttnInputs(cache=cache)
            return AttnInputs(mask=self.adapter.inference_mask(position_ids, valid), cache=cache)
        if self.adapter.is_block_causal:
            if cache is None:
                return AttnInputs(mask=self.adapter.inference_mask(position_ids))
            # Keys are [cached ; new], cached contiguously from position 0 (prefill, then finished blocks).
            start = cache.length if cache.start is None else cache.start
            visible = max(cache.length, start + L)
            k_pos = torch.arange(visible, device=x.device).expand(B, visible)
            mask = masks.dense_mask(masks.TokenLayout.plain(position_ids), masks.TokenLayout.plain(k_pos), self.adapter.block_size)
            return AttnInputs(mask=None if bool(mask.all()) else mask, cache=cache)
        return AttnInputs(cache=cache)

    def _check_sequence_parallel(self, sp: SequenceGroup, ids: torch.Tensor, cache, request: LogitsRequest) -> slice:
        """The positions this rank owns in a sequence-parallel forward (errors for what it cannot do)."""
        if cache is not None or request.rows is not None or request.keep is not None:
            raise ValueError("a sequence-parallel forward takes no KV cache and no row selection (LogitsRequest rows / "
                             "keep): it returns this rank's hidden states; see score_targets")
        if ids.shape[1] % sp.size:
            raise ValueError(f"a sequence-parallel forward needs a length divisible by distributed.sequence_parallel="
                             f"{sp.size}, got {ids.shape[1]} (score_targets pads it)")
        check_heads(self.arch.num_heads, self.arch.num_kv_heads, sp.size)
        return sp.local(ids.shape[1])

    def sequence_parallel_inputs(self, sp: SequenceGroup, input_ids, attention_mask=None, position_ids=None,
                                 layout=None) -> ShardedInputs:
        """The inputs of a ``sequence_parallel=sp`` forward and the rows this rank holds: one slice of the positions
        (padded to a multiple of the group's size)."""
        return split_sequence(sp, input_ids, attention_mask, position_ids, layout)

    def _compiled_step(self, lean, cache: Optional[KVCache], prune: bool, sel: Optional[QuerySel], B: int, L: int):
        """(stack signature, KV slots, last-layer query rows) when this forward runs the compiled stack
        (``decoding(compile=True)``, every layer lean, a cached step that does not store and attends to whole buffers,
        rows a plain slice)."""
        signature = self.__dict__.get("_lean_compile")
        if lean is None or signature is None or not prune or cache is None:
            return None
        rows = None
        if sel is not None:
            if not isinstance(sel, slice):  # per-row positions: a gather the graph would specialise on
                return None
            rows = range(L)[sel]
            if rows.step != 1:
                return None
        slots = cache.slot_writes(B)
        return None if slots is None else (signature, slots, rows)

    # --- forward ---------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        *,
        past_key_values: Optional[KVCache] = None,
        store_kv: bool = False,
        kv_start: Optional[int] = None,
        layout: Optional[masks.TokenLayout] = None,
        request: Optional[LogitsRequest] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        sequence_parallel: Optional[SequenceGroup] = None,
    ) -> ModelOutput:
        """Raw logits (and/or final hidden states) of a batch, exactly as the family's reference code computes them.

        Args:
            input_ids: token ids [B, L] (ignored where ``inputs_embeds`` is given, except for its shape).
            attention_mask: 2D padding mask [B, L] (positions default to its cumsum - 1, so left padding is exact;
                with a KV cache it covers every visible key, [B, cache + L]), or an explicit 4D bool / additive mask
                [B, 1, L, Lk]. None: every position valid (block-causal families mask by blocks themselves).
            position_ids: [B, L] or [L]; default from the mask, the layout, or ``kv_start + arange(L)`` with a cache.
            past_key_values: a ``KVCache`` (``model.new_cache()``): the new keys and values are written at
                ``kv_start`` (default: the cached length) and attention sees ``cache[:max(length, kv_start + L)]``.
            store_kv: advance the cache's length past the written slots (False: a scratch step that is overwritten).
            kv_start: the cache slot of the first new position.
            layout: a ``TokenLayout`` (packed documents, ``[x_t ; x_0]`` block-diffusion training rows) instead of the
                mask; positions come from it.
            request: which rows get logits / hidden states (``LogitsRequest``; default: logits of every row).
            inputs_embeds: input embeddings [B, L, H] instead of looking up ``input_ids``.
            sequence_parallel: a ``SequenceGroup``: this rank runs its slice of the sequence (no cache, no row
                selection) and returns its own rows' hidden states.
        Returns:
            ``ModelOutput``: ``logits`` [B, L, V] (fp as the weights; [B, n, V] with ``request.rows``, [k, V] with
            ``request.keep``) and ``hidden_states`` of the same rows, each None when not requested.
        """
        request = request or ALL_LOGITS
        sp = sequence_parallel
        if sp is not None:
            own = self._check_sequence_parallel(sp, input_ids if inputs_embeds is None else inputs_embeds,
                                                past_key_values, request)
            x = self.model.embed_tokens(input_ids[:, own]) if inputs_embeds is None else inputs_embeds[:, own]
            B, L = x.shape[0], x.shape[1] * sp.size  # masks and positions span the whole sequence
        else:
            x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            B, L = x.shape[:2]
        cache = past_key_values
        if position_ids is None:
            if layout is not None:
                position_ids = layout.pos
            elif attention_mask is not None and attention_mask.dim() == 2 and cache is None and attention_mask.shape[1] == L:
                position_ids = masks.positions_from_padding(attention_mask)
            else:
                start = (cache.length if kv_start is None else kv_start) if cache is not None else 0
                position_ids = torch.arange(start, start + L, device=x.device).expand(B, L)
        elif position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, L)
        request.check(B, L)
        rows = request.rows
        keep, n_keep = _kept_rows(request.keep) if request.keep is not None else (None, 0)
        if cache is not None:
            cache.begin(L, kv_start, store_kv)
        try:
            attn = self._attn_inputs(B, L, position_ids, attention_mask, cache, layout, x)
            if sp is not None:
                attn.sequence = sp
                position_ids = position_ids[:, own]
            cos, sin = self.rotary(position_ids, x.dtype)
            if self.arch.query_scale_beta:
                attn.query_scale = query_scale(position_ids, self.arch.query_scale_beta, self.arch.query_scale_span,
                                               x.dtype)
            # Rows nobody reads leave at the last layer (the fused attention kernels take whole rows only). Not with
            # a sparse-MoE last layer: its expert GEMMs group the tokens, and fewer of them change the bits.
            prune = (attn.block_mask is None and attn.cu_seqlens is None and bool(self.model.layers)
                     and not isinstance(self.model.layers[-1].mlp, SparseMoE) and sp is None)
            last = len(self.model.layers) - 1
            lean = None if torch.is_grad_enabled() else self.__dict__.get("_lean")
            # the compiled stack takes the mask alone: a query scale runs the layers one by one
            step = self._compiled_step(lean, cache, prune, rows, B, L) if attn.query_scale is None else None
            if step is not None:
                x = run_compiled(lean, x, cos, sin, attn.mask, *step, keep)
            for i, layer in enumerate(self.model.layers if step is None else ()):
                sel, kept = (rows, keep) if prune and i == last else (None, None)
                if lean is not None and lean[i] is not None:
                    x = lean_layer(lean[i], x, cos, sin, attn, sel, kept)
                elif self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                    x = checkpoint(layer, x, cos, sin, attn, sel, kept, use_reentrant=False)
                else:
                    x = layer(x, cos, sin, attn, sel, kept)
            if not prune:
                x = take_rows(x, rows)
                if keep is not None:
                    x = pack_rows(x, keep)
        finally:
            if cache is not None:
                cache.end()
        h = self.model.norm(x)
        logits = None
        if request.logits:
            logits = self.lm_head(h)
            if keep is not None:
                logits = logits[:n_keep]  # drop the padding rows (after the last GEMM)
        if keep is not None:
            h = h[:n_keep]
        return ModelOutput(logits=logits, hidden_states=h if request.hidden else None)

    def save_pretrained(self, path, tokenizer=None, max_shard_bytes: int = 5 * 2**30) -> None:
        """config.json + safetensors in the family's published layout (``dare.models.checkpoint.save_pretrained``)."""
        save_pretrained(self, path, tokenizer=tokenizer, max_shard_bytes=max_shard_bytes)

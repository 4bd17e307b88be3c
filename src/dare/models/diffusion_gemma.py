"""``DiffusionGemmaLM``: dare's model API over transformers' own ``DiffusionGemmaForBlockDiffusion``.

transformers maintains DiffusionGemma (``transformers.models.diffusion_gemma``), so nothing here reimplements a layer:
the encoder, the decoder (with self-conditioning), the MoE and the caches are transformers' modules; this class only
drives them the way dare's trainers and samplers need:

* ``model(input_ids, layout=CanvasLayout, request=LogitsRequest.hidden_states())`` -- the training / scoring
  forward. ``input_ids`` is ``[clean encoder ids ; canvas ids]``; the encoder runs over the clean part (causal, its
  KV kept for every layer), the decoder over the canvas with block-causal masks (``dare.models.canvas``). The
  returned hidden states are ``[encoder rows ; canvas rows]``: encoder row i predicts token i+1 (the encoder's
  autoregressive loss), canvas row j predicts the clean token of canvas position j. Samples flagged in
  ``layout.self_condition`` are denoised twice, the second pass fed the first pass's (detached) logits.
* ``encode`` / ``denoise`` / ``new_cache`` -- the sampler's steps (``dare.rollout.canvas``) on transformers' cache.
* ``save_pretrained`` -- transformers' own, so the checkpoint is the published layout (tied weights dropped, the
  vision tower kept).

The encoder and the decoder share every weight (Gemma's "encoder-denoiser patch"; transformers ties the parameters).
Here they share the *modules* (``share_encoder_modules``), so LoRA wraps each projection once for both modes and
FSDP shards encoder layer i and decoder layer i as one unit. The vision tower is kept (loaded and saved) but frozen
and never run: dare is text-only.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from .adapter import FamilyAdapter
from .arch import ModelArch
from .canvas import FULL, SLIDING, CanvasLayout
from .checkpoint import CheckpointError
from .families import FamilySpec, UnsupportedModelError
from .modules import take_rows
from .outputs import ALL_LOGITS, LogitsRequest, ModelOutput
from .sequence_parallel import SequenceGroup, ShardedInputs, check_heads, hf_attention_layers, owned_rows, pad_end

# Per-layer submodules of transformers' encoder and decoder text layers that hold the shared weights.
LAYER_MODULES = ("mlp", "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "router", "experts", "post_feedforward_layernorm_1",
                 "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2")
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def share_encoder_modules(model: nn.Module) -> None:
    """Make the decoder use the encoder's module objects for every shared weight (and tie the LM head).

    The encoder comes first in ``named_modules()``, so module surgery that walks it (peft's LoRA injection and merge)
    lands on the encoder's path; calling this afterwards points the decoder at the same (new) modules.
    """
    enc, dec = model.model.encoder.language_model, model.model.decoder
    dec.embed_tokens = enc.embed_tokens
    dec.norm = enc.norm
    for le, ld in zip(enc.layers, dec.layers):
        for name in LAYER_MODULES:
            setattr(ld, name, getattr(le, name))
        for name in ATTN_MODULES:
            setattr(ld.self_attn, name, getattr(le.self_attn, name))
    model.lm_head.weight = dec.embed_tokens.weight


class DiffusionGemmaLM(nn.Module):
    lora_exclude = r"\.vision_tower\.|\.embed_vision\."  # text-only: the vision tower gets no adapters
    # ``sequence_parallel=`` in ``forward``: the encoder part and the canvas are each split over the group, and
    # transformers' attention runs inside Ulysses' swaps (``sequence_parallel.hf_attention``).
    supports_sequence_parallel = True

    def __init__(self, hf_model, arch: ModelArch, adapter: FamilyAdapter, hf_config: dict, family: str = "diffusion_gemma"):
        super().__init__()
        # The wrapper owns transformers' children directly (same state-dict keys as the published checkpoint);
        # the transformers object is kept unregistered for its save_pretrained / generate.
        self.model = hf_model.model
        self.lm_head = hf_model.lm_head
        object.__setattr__(self, "hf", hf_model)
        self.adapter, self.hf_config, self.family = adapter, dict(hf_config), family
        self.text_config = hf_model.config.get_text_config()
        self.arch = arch
        self.softcap = self.text_config.final_logit_softcapping
        share_encoder_modules(self)
        for p in self.vision_parameters():
            p.requires_grad_(False)
        self.gradient_checkpointing = False
        self.attn_backend = "sdpa"
        self._experts_default = self.text_config._experts_implementation
        self._experts_for_dtype()

    # --- configuration ---------------------------------------------------------------------------
    def vision_parameters(self):
        enc = self.model.encoder
        return list(enc.vision_tower.parameters()) + list(enc.embed_vision.parameters())

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        self._experts_for_dtype()  # .to(dtype) and friends
        return out

    def _experts_for_dtype(self) -> None:
        """transformers' MoE experts run ``torch._grouped_mm``, which takes bf16 and fp32 but not fp64: fp64 weights
        (dare's exactness checks) run transformers' own per-expert loop ("eager") instead."""
        fp64 = self.lm_head.weight.dtype == torch.float64
        self.text_config._experts_implementation = "eager" if fp64 else self._experts_default

    def set_attn_backend(self, backend: str) -> None:
        if backend not in ("auto", "sdpa"):
            raise ValueError(f"{self.family} runs transformers' sdpa attention (its masks are explicit 4D bool masks); "
                             f"attn_backend={backend!r} is not supported, use auto or sdpa")
        self.attn_backend = "sdpa"

    def gradient_checkpointing_enable(self, enabled: bool = True) -> None:
        """Checkpoint encoder layer i and decoder layer i as one unit (``_encode_decode``). transformers checkpoints the
        decoder layers only: an encoder layer writes the shared KV cache, which a recompute would append twice. A pair
        recomputed with a cache of its own writes it once (and the encoder's activations, most of a 26B model's, are
        checkpointed too)."""
        self.gradient_checkpointing = enabled
        for layer in self.model.decoder.layers:
            layer.gradient_checkpointing = False  # the pair is the checkpointed unit

    def fsdp_units(self) -> list:
        """FSDP2 units: encoder layer i and decoder layer i share their weights, so they are sharded together."""
        return [[le, ld] for le, ld in zip(self.model.encoder.language_model.layers, self.model.decoder.layers)]

    def retie(self) -> None:
        share_encoder_modules(self)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def get_input_embeddings(self):
        return self.model.decoder.embed_tokens

    @property
    def sliding_window(self) -> Optional[int]:
        return getattr(self.text_config, "sliding_window", None)

    # --- logits ----------------------------------------------------------------------------------
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 soft-capped logits, exactly as ``DiffusionGemmaForBlockDiffusion.forward`` computes them."""
        z = self.lm_head(hidden).float()
        return torch.tanh(z / self.softcap) * self.softcap if self.softcap else z

    # --- training / scoring forward --------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, *, layout: Optional[CanvasLayout] = None,
                request: Optional[LogitsRequest] = None,
                sequence_parallel: Optional[SequenceGroup] = None) -> ModelOutput:
        """The training / scoring forward over ``[clean encoder ids ; canvas ids]``.

        Args:
            input_ids: [B, Le + C]: the clean context (``layout.enc_len`` = Le tokens) then the noisy canvases.
            attention_mask, position_ids: not used (the layout carries masks and positions); accepted so callers
                pass the native model's arguments unchanged.
            layout: the ``CanvasLayout`` (required): encoder / decoder positions, masks, self-conditioning coins.
            request: which rows get logits / hidden states (``LogitsRequest``; default: logits of every row). The
                rows are selected after the final norm (the encoder-decoder stack runs every row).
            sequence_parallel: a ``SequenceGroup``: this rank runs its slice of the encoder part and its slice of the
                canvas (each a multiple of the group's size: ``sequence_parallel_inputs`` pads them) and returns
                their hidden states, ``[my encoder rows ; my canvas rows]`` (no row selection).
        Returns:
            ``ModelOutput`` over the rows ``[encoder rows ; canvas rows]`` ([B, Le + C, .], or as ``request``
            selects): encoder row i predicts token i+1, canvas row j the clean token of canvas position j. Logits
            are fp32 and soft-capped.
        """
        request = request or ALL_LOGITS
        if not isinstance(layout, CanvasLayout):
            raise ValueError(f"{self.family} is an encoder-decoder model: its forward takes [clean context ; canvas] ids "
                             f"with a dare.models.canvas.CanvasLayout (layout=...); sampling goes through dare.rollout")
        request.check(input_ids.shape[0], input_ids.shape[1])
        Le = layout.enc_len
        sw = self.sliding_window
        sp = sequence_parallel
        enc_ids, canvas = input_ids[:, :Le], input_ids[:, Le:]
        enc_pos, dec_pos = layout.enc_pos, layout.dec_pos
        enc_masks, dec_masks = layout.encoder_masks(sw), layout.decoder_masks(sw)  # whole-sequence masks
        if sp is not None:
            self._check_sequence_parallel(sp, Le, canvas.shape[1], request)
            own_e, own_c = sp.local(Le), sp.local(canvas.shape[1])
            enc_ids, canvas, enc_pos, dec_pos = enc_ids[:, own_e], canvas[:, own_c], enc_pos[:, own_e], dec_pos[:, own_c]
        sc_logits = sc_mask = None
        if layout.self_condition is not None:
            # The first pass only provides the conditioning signal (Analog-Bits style), so it runs without gradients,
            # encoder included, before the differentiated passes: FSDP2 then sees plain no-grad forwards followed by
            # one forward/backward (a no-grad pass between the encoder's and the decoder's differentiated uses of the
            # same units crashes its backward). It runs whatever the per-row coins say, so every rank issues the same
            # collectives.
            with torch.no_grad():
                _, first = self._encode_decode(enc_ids, enc_masks, enc_pos, canvas, dec_masks, dec_pos, None, None, sp)
                sc_logits = self.logits_of(first).to(self.model.decoder.embed_tokens.weight.dtype)
            sc_mask = layout.self_condition.bool()
        enc, dec = self._encode_decode(enc_ids, enc_masks, enc_pos, canvas, dec_masks, dec_pos, sc_logits, sc_mask, sp)
        h = take_rows(torch.cat([enc, dec], dim=1), request.rows)
        if request.keep is not None:
            h = h[request.keep]
        logits = self.logits_of(h) if request.logits else None
        return ModelOutput(logits=logits, hidden_states=h if request.hidden else None)

    def _encode_decode(self, enc_ids, enc_masks, enc_pos, canvas, dec_masks, dec_pos, sc_logits, sc_mask, sp=None):
        """(encoder, decoder) final hidden states of the differentiated pass, the layers run as pairs: encoder layer i
        then decoder layer i (which reads only layer i's keys). transformers' own forward runs every encoder layer,
        then every decoder layer; the values are the same, but the order matters for training. Each shared weight is
        used twice, and autograd completes its gradient only when both uses are differentiated: in the sequential
        order it holds every layer's (unsharded, under FSDP2) gradient from the decoder's backward until the encoder's
        (51 GiB per GPU for the 26B model's full SFT, ``dare plan``). Paired, layer i's gradient completes right after
        its pair's backward, and FSDP2 reduce-scatters it there.

        With ``sp`` the inputs and positions are this rank's slices and every attention runs inside Ulysses' swaps
        (``hf_attention``); the decoder's keys are ``[encoder keys ; canvas keys]``, whose encoder part is swapped on
        its own (``dare_prefix_keys``). Set per pair, so a checkpoint's recompute runs the same way."""
        from transformers.cache_utils import DynamicCache
        lm, dec = self.model.encoder.language_model, self.model.decoder
        h_enc = self.model.encoder.get_input_embeddings()(enc_ids)
        h_dec = self._decoder_inputs(canvas, sc_logits, sc_mask)
        enc_rope = {t: lm.rotary_emb(h_enc, enc_pos, t) for t in lm.unique_layer_types}
        dec_rope = {t: dec.rotary_emb(h_dec, dec_pos, t) for t in dec.unique_layer_types}
        types = self.text_config.layer_types
        checkpointed = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        # Unconfigured caches keep every key of every layer (the decoder masks pick what each canvas block sees)
        cache = None if checkpointed else DynamicCache()

        enc_sp, dec_sp = ({"dare_sequence": sp}, {"dare_sequence": sp, "dare_prefix_keys": enc_ids.shape[1]}) if sp else ({}, {})

        def pair(i, h_enc, h_dec, cache):
            cache = DynamicCache() if cache is None else cache  # a recompute gets a cache of its own
            kind = types[i]
            with hf_attention_layers(self._attention_configs(i), sp):
                h_enc = lm.layers[i](h_enc, position_embeddings=enc_rope[kind], attention_mask=enc_masks[kind],
                                     position_ids=enc_pos, cache=cache, **enc_sp)
                h_dec = dec.layers[i](h_dec, position_embeddings=dec_rope[kind], attention_mask=dec_masks[kind],
                                      position_ids=dec_pos, cache=cache, **dec_sp)
            return h_enc, h_dec

        for i in range(self.text_config.num_hidden_layers):
            if checkpointed:
                from torch.utils.checkpoint import checkpoint
                h_enc, h_dec = checkpoint(pair, i, h_enc, h_dec, None, use_reentrant=False)
            else:
                h_enc, h_dec = pair(i, h_enc, h_dec, cache)
        return lm.norm(h_enc), dec.norm(h_dec)

    def _attention_configs(self, i: int) -> list:
        """The distinct config objects the attention modules of pair ``i`` read their implementation from."""
        mods = (self.model.encoder.language_model.layers[i].self_attn, self.model.decoder.layers[i].self_attn)
        return list({id(m.config): m.config for m in mods}.values())

    # --- sequence parallelism --------------------------------------------------------------------
    def _check_sequence_parallel(self, sp: SequenceGroup, enc_len: int, canvas_len: int, request: LogitsRequest) -> None:
        if request.rows is not None or request.keep is not None:
            raise ValueError("a sequence-parallel forward takes no row selection (LogitsRequest rows / keep): it "
                             "returns this rank's hidden states; see score_targets")
        if enc_len % sp.size or canvas_len % sp.size:
            raise ValueError(f"a sequence-parallel forward of {self.family} needs an encoder part ({enc_len}) and a "
                             f"canvas ({canvas_len}) divisible by distributed.sequence_parallel={sp.size} "
                             f"(sequence_parallel_inputs pads them)")
        check_heads(self.arch.num_heads, self.arch.num_kv_heads, sp.size)

    def sequence_parallel_inputs(self, sp: SequenceGroup, input_ids, attention_mask=None, position_ids=None,
                                 layout: Optional[CanvasLayout] = None) -> ShardedInputs:
        """``[encoder ids ; canvas ids]`` with each part padded at its end to a multiple of the group's size (padding
        is document -1: no query sees it, it sees itself), and the input rows this rank holds: its slice of the
        encoder part, then its slice of the canvas."""
        if not isinstance(layout, CanvasLayout):
            raise ValueError(f"{self.family}'s forward takes a CanvasLayout (layout=...)")
        Le, C = layout.enc_len, input_ids.shape[1] - layout.enc_len
        pe, pc = -Le % sp.size, -C % sp.size
        ids = torch.cat([pad_end(input_ids[:, :Le], pe, 0), pad_end(input_ids[:, Le:], pc, 0)], dim=1)
        padded = CanvasLayout(pad_end(layout.enc_pos, pe, 0), pad_end(layout.enc_doc, pe, -1),
                              pad_end(layout.dec_pos, pc, 0), pad_end(layout.dec_doc, pc, -1),
                              pad_end(layout.dec_block_start, pc, 0), layout.self_condition)
        rows = torch.cat([owned_rows(sp, Le + pe, Le), owned_rows(sp, C + pc, C, offset=Le)]).to(input_ids.device)
        return ShardedInputs(ids, None, None, padded, rows)

    def _decoder_inputs(self, canvas, sc_logits, sc_mask) -> torch.Tensor:
        """The decoder's input embeddings: the canvas tokens' embeddings combined with the self-conditioning signal
        (the softmax of the previous pass's logits times the embedding table; zeros without one), as the decoder
        model computes them."""
        dec = self.model.decoder
        table = dec.embed_tokens
        x = table(canvas)
        if sc_logits is None:
            soft = torch.zeros_like(x)
        else:
            soft = sc_logits.softmax(dim=-1, dtype=torch.float32).to(table.weight.dtype) @ table.weight
            soft = soft * table.embed_scale.to(x.dtype)
            if sc_mask is not None:
                soft = soft * sc_mask.to(soft.dtype)[:, None, None]
        return dec.self_conditioning(x, soft)

    def _decode(self, canvas, positions, cache, masks, sc_logits, sc_mask) -> torch.Tensor:
        out = self.model.decoder(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc_logits,
                                 self_conditioning_mask=sc_mask, decoder_attention_mask=masks,
                                 decoder_position_ids=positions)
        return out.last_hidden_state

    # --- sampler steps ---------------------------------------------------------------------------
    def new_cache(self, capacity: Optional[int] = None):
        """transformers' cache with this model's layer types (sliding layers keep ``sliding_window - 1`` keys)."""
        from transformers.cache_utils import DynamicCache
        return DynamicCache(config=self.text_config)

    def cached_keys(self, cache) -> dict[str, int]:
        """Keys each layer type holds in ``cache`` now (before the next forward appends to it)."""
        types = list(self.text_config.layer_types)
        out = {}
        for kind in (FULL, SLIDING):
            if kind in types:
                layer = cache.layers[types.index(kind)] if len(cache.layers) > types.index(kind) else None
                keys = getattr(layer, "keys", None) if layer is not None else None
                out[kind] = int(keys.shape[-2]) if keys is not None and getattr(layer, "is_initialized", True) else 0
        return out

    def encode(self, ids: torch.Tensor, position_ids: torch.Tensor, cache, masks: dict) -> None:
        """Append the clean tokens ``ids`` to the encoder cache."""
        self.model.encoder(input_ids=ids, attention_mask=masks, position_ids=position_ids, cache=cache)

    def denoise(self, canvas: torch.Tensor, position_ids: torch.Tensor, cache, masks: dict,
                sc_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """fp32 soft-capped logits ``[B, C, V]`` of one denoising pass over ``canvas`` (cache read only)."""
        return self.logits_of(self._decode(canvas, position_ids, cache, masks, sc_logits, None))

    # --- saving ----------------------------------------------------------------------------------
    def save_pretrained(self, path, tokenizer=None, max_shard_bytes: int = 5 * 2**30) -> None:
        """transformers' ``save_pretrained``: config.json + safetensors in the published layout."""
        self.retie()
        with quiet_transformers():
            self.hf.save_pretrained(str(path), max_shard_size=max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(path))


@contextlib.contextmanager
def parameters_on_meta():
    """Create parameters on the meta device and everything else (non-persistent buffers: RoPE frequencies, the
    embedding scale) for real, so a skeleton filled by ``load_state_dict(assign=True)`` is complete."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


@contextlib.contextmanager
def quiet_transformers():
    """transformers' per-call progress bars (loading / writing shards) stay out of dare's logs."""
    from transformers.utils import logging as hf_logging
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


# --- the builder (``dare.models.builder.BUILDERS["diffusion_gemma"]``) ------------------------------------------------
def _require_transformers_model(spec: FamilySpec) -> None:
    try:
        import transformers.models.diffusion_gemma  # noqa: F401
    except ImportError as e:
        raise UnsupportedModelError(f"{spec.name} needs transformers >= 5.x with transformers.models.diffusion_gemma "
                                    f"(pip install -U transformers): {e}") from e


def _hf_config(cfg: dict, attn: str = "sdpa"):
    """transformers' ``DiffusionGemmaConfig`` of a config.json dict (``tiny(num_layers=n)``: n - 1 sliding layers and a
    full last one when the layer types do not say)."""
    from transformers import DiffusionGemmaConfig
    cfg = json.loads(json.dumps(cfg))
    text = cfg.get("text_config", {})
    n = text.get("num_hidden_layers")
    if n and len(text.get("layer_types") or []) != n:
        text["layer_types"] = ["sliding_attention"] * (n - 1) + ["full_attention"]
    config = DiffusionGemmaConfig.from_dict(cfg)
    config._attn_implementation = attn
    return config


def build_diffusion_gemma(spec: FamilySpec, cfg: dict, mask_token_id: int = -1, dtype=None, device=None,
                          attn_backend: str = "auto", init: bool = True) -> DiffusionGemmaLM:
    """transformers' model of ``cfg`` behind dare's API (random init, or parameters on the meta device)."""
    _require_transformers_model(spec)
    from transformers import DiffusionGemmaForBlockDiffusion
    arch, adapter = spec.read_arch(cfg), spec.adapter(cfg, mask_token_id)
    config = _hf_config(cfg)
    if init:
        model = DiffusionGemmaLM(DiffusionGemmaForBlockDiffusion(config), arch, adapter, cfg, spec.name)
        return model.to(dtype=dtype, device=device)
    with parameters_on_meta():
        return DiffusionGemmaLM(DiffusionGemmaForBlockDiffusion(config), arch, adapter, cfg, spec.name)


def load_diffusion_gemma(spec: FamilySpec, folder: Path, cfg: dict, mask_token_id: int, dtype,
                         attn_backend: str = "auto") -> DiffusionGemmaLM:
    """transformers' ``from_pretrained`` of ``folder``; a missing, unexpected or misshapen tensor is a
    ``CheckpointError`` naming it (transformers itself only warns)."""
    _require_transformers_model(spec)
    from transformers import DiffusionGemmaForBlockDiffusion
    arch, adapter = spec.read_arch(cfg), spec.adapter(cfg, mask_token_id)
    try:
        with quiet_transformers():
            hf, info = DiffusionGemmaForBlockDiffusion.from_pretrained(str(folder), dtype=dtype, attn_implementation="sdpa",
                                                                   output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{folder}: transformers could not load this DiffusionGemma checkpoint: {e}") from e
    missing = [k for k in info.get("missing_keys", []) if k not in hf.all_tied_weights_keys]
    problems = {"missing": missing, "unexpected": list(info.get("unexpected_keys", [])),
                "mismatched": [str(m) for m in info.get("mismatched_keys", [])]}
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        detail = "; ".join(f"{k} tensor(s) {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}" for k, v in bad.items())
        raise CheckpointError(f"{folder}: {detail} (config.json implies another architecture)")
    return DiffusionGemmaLM(hf, arch, adapter, cfg, spec.name)

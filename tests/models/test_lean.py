"""The lean decoding path (``DiffusionLM.decoding()``, ``dare.models.lean``): every forward a sampler makes gives
the bits of the module path, and layers the snapshot cannot cover run through their modules."""
import contextlib

import pytest
import torch

from dare.models import lean, load_model
from dare.models.lora import apply_lora
from dare.rollout import SamplerConfig, generate
from tests.conftest import FIXTURES

PROMPTS = [[11, 17, 99, 3, 41, 8], [7, 7, 120, 64]]  # two lengths: left padding gives an attention mask

MODES = {
    "llada-tiny": [dict(cache="none"), dict(cache="prefix"), dict(cache="dual", threshold=0.5),
                   dict(cache="dual", temperature=1.0, cfg_scale=0.5)],
    "dream-tiny": [dict(cache="none", remasking="entropy"), dict(cache="dual", remasking="maskgit_plus")],
    "sdar-tiny": [dict(cache="block", block_length=4, steps_per_block=4), dict(cache="block", block_length=4, threshold=0.5)],
}


def _logits_of_every_forward(model, cfg, lean_on: bool):
    seen = []
    hook = model.register_forward_hook(lambda m, args, out: seen.append(out.logits.clone()))
    if not lean_on:
        model.decoding = lambda **kw: contextlib.nullcontext()  # the module path
    try:
        r = generate(model, PROMPTS, cfg, n=2, seeds=[3, 4])
    finally:
        hook.remove()
        model.__dict__.pop("decoding", None)
    return seen, r.completion_ids


@pytest.mark.parametrize("name,mode", [(n, m) for n, ms in MODES.items() for m in ms])
def test_every_sampler_forward_has_the_bits_of_the_module_path(name, mode, monkeypatch):
    model = load_model(FIXTURES / name, dtype=torch.float32, mask_token_id=5)
    base = {"gen_length": 16, "block_length": 8} if "steps_per_block" in mode else {"gen_length": 16, "block_length": 8, "steps": 16}
    cfg = SamplerConfig(**{**base, **mode})
    calls = []
    real = lean.lean_layer
    monkeypatch.setattr("dare.models.model.lean_layer", lambda *a, **k: calls.append(1) or real(*a, **k))
    lean_logits, lean_ids = _logits_of_every_forward(model, cfg, True)
    assert calls, "the sampler did not take the lean path"
    n_lean = len(calls)
    module_logits, module_ids = _logits_of_every_forward(model, cfg, False)
    assert len(calls) == n_lean  # the module path really ran through the modules
    assert torch.equal(lean_ids, module_ids)
    assert len(lean_logits) == len(module_logits)
    for a, b in zip(lean_logits, module_logits):
        assert torch.equal(a, b)


def test_layers_the_snapshot_cannot_cover_run_through_their_modules():
    moe = load_model(FIXTURES / "lladamoe-tiny", dtype=torch.float32, mask_token_id=5)
    with torch.no_grad():
        kinds = [lean.snapshot_layer(layer) is not None for layer in moe.model.layers]
    assert kinds == [type(layer.mlp).__name__ == "MLP" for layer in moe.model.layers]  # MoE layers: modules
    assert not any(lean.snapshot_layer(layer) is not None for layer in
                   load_model(FIXTURES / "llada2-tiny", dtype=torch.float32, mask_token_id=5).model.layers)  # native fused q/k/v

    model = load_model(FIXTURES / "llada-tiny", dtype=torch.float32)
    layer = model.model.layers[0]
    assert lean.snapshot_layer(layer) is None  # gradients on: training forwards need the modules
    with torch.no_grad():
        assert lean.snapshot_layer(layer) is not None
        handle = layer.mlp.down_proj.register_forward_hook(lambda *a: None)
        assert lean.snapshot_layer(layer) is None  # a hook would be skipped
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
        assert lean.snapshot_layer(layer) is None
        handle.remove()
        apply_lora(model, r=2)
        assert lean.snapshot_layer(model.model.layers[0]) is None  # wrapped projections


def test_a_forward_under_autograd_inside_decoding_uses_the_modules(monkeypatch):
    model = load_model(FIXTURES / "llada-tiny", dtype=torch.float32)
    ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    calls = []
    monkeypatch.setattr("dare.models.model.lean_layer", lambda *a, **k: calls.append(1))
    with torch.no_grad(), model.decoding():  # the snapshot is taken ...
        assert model.__dict__.get("_lean") is not None
        with torch.enable_grad():
            model(ids).logits.sum().backward()  # ... but a forward under autograd never runs lean
    assert not calls and model.lm_head.weight.grad is not None
    assert model.__dict__.get("_lean") is None  # the context restores the previous state


def test_compile_needs_the_native_decoder_and_a_working_compiler(monkeypatch):
    model = load_model(FIXTURES / "llada-tiny", dtype=torch.float32, mask_token_id=500)
    cfg = SamplerConfig(gen_length=8, block_length=8, cache="dual", compile=True)

    class Foreign(torch.nn.Module):
        adapter = model.adapter

    with pytest.raises(ValueError, match="compile=True compiles the native decoder"):
        generate(Foreign(), [[1, 2, 3]], cfg)
    monkeypatch.setattr(lean, "compile_problem", lambda: "CppCompileError: no C++ compiler")
    with pytest.raises(ValueError, match="could not: CppCompileError: no C\\+\\+ compiler"):
        generate(model, [[1, 2, 3]], cfg)

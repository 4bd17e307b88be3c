"""LoRA layers whose adapter costs more than their weight run through the merged weight ``W + s B A``: the same
function and gradients as peft's ``W x + s B (A x)`` (rounding apart), chosen by FLOPs, with peft's behaviour for
disabled adapters and merging."""
import copy

import torch

from dare.models import tiny
from dare.models.lora import _adapter_costs_more_than_its_weight, adapters_disabled, apply_lora, merge_lora


def _layers(model):
    from peft.tuners.lora.layer import Linear
    return [m for m in model.modules() if isinstance(m, Linear)]


def _adapted(i, o, r, dropout=0.0):
    outer, inner = torch.nn.Module(), torch.nn.Module()
    inner.q_proj = torch.nn.Linear(i, o, bias=False)
    outer.attn = inner
    apply_lora(outer, r=r, alpha=2 * r, dropout=dropout, targets=("q_proj",))
    return inner.q_proj


def test_the_merged_weight_is_chosen_by_flops():
    merged = lambda layer: type(layer).__name__.startswith("Merged")
    assert merged(_adapted(128, 128, 128))  # the embedded task's model, the papers' rank
    assert merged(_adapted(128, 384, 64))  # 49152 < 3 * 64 * 512
    assert not merged(_adapted(128, 384, 16))  # 49152 > 3 * 16 * 512
    assert not merged(_adapted(4096, 4096, 128))  # an 8B model's projection: peft's two GEMMs
    assert not merged(_adapted(128, 128, 128, dropout=0.1))  # dropout on x cannot be merged
    assert _adapter_costs_more_than_its_weight(_adapted(128, 128, 128))


def test_merged_forward_equals_peft_in_values_and_gradients():
    torch.manual_seed(0)
    model = apply_lora(tiny("llada", dtype=torch.float64), r=64, alpha=32, seed=0)
    for layer in _layers(model):  # a trained adapter: B is zero at initialisation
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.05)
    merged = [m for m in _layers(model) if type(m).__name__.startswith("Merged")]
    assert merged and len(merged) == len(_layers(model))  # 64-wide tiny layers, rank 64
    reference = copy.deepcopy(model)
    for m in _layers(reference):
        m.__class__ = type(m).__mro__[2]  # peft's own class back
    ids = torch.randint(0, 100, (2, 12))
    outs = []
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        logits = m(ids).logits
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = outs
    assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert ga.keys() == gb.keys() and all("lora_" in n for n in ga)
    for n in ga:
        assert torch.allclose(ga[n], gb[n], rtol=1e-9, atol=1e-12), n
    with adapters_disabled(model), adapters_disabled(reference):  # the base model, as peft runs it
        assert torch.equal(model(ids).logits, reference(ids).logits)
    merge_lora(model)
    assert not _layers(model)
    assert torch.allclose(model(ids).logits, a, rtol=0, atol=1e-12)

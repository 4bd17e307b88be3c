"""The OpenCompass model class, exercised with a minimal fake OpenCompass (the real one needs its own venv)."""
import importlib
import sys
import types

import pytest
import torch

from dare.diffusion.noise import derive_seed
from dare.eval.likelihood import elbo_loglikelihood


class FakeBaseModel:
    is_api = False

    def __init__(self, path, max_seq_len=2048, tokenizer_only=False, meta_template=None, generation_kwargs=dict(),
                 sync_rank=False):
        self.path, self.max_seq_len, self.generation_kwargs = path, max_seq_len, generation_kwargs
        self.init_called = True


class FakeRegistry:
    def __init__(self):
        self.modules = {}

    def register_module(self, name=None, module=None, force=False):
        self.modules[name] = module


@pytest.fixture()
def oc_module(monkeypatch):
    registry = FakeRegistry()
    pkg = types.ModuleType("opencompass")
    models = types.ModuleType("opencompass.models")
    base = types.ModuleType("opencompass.models.base")
    base.BaseModel = FakeBaseModel
    reg = types.ModuleType("opencompass.registry")
    reg.MODELS = registry
    for name, mod in (("opencompass", pkg), ("opencompass.models", models), ("opencompass.models.base", base),
                      ("opencompass.registry", reg)):
        monkeypatch.setitem(sys.modules, name, mod)
    import dare.eval.opencompass_model as m
    mod = importlib.reload(m)
    yield mod, registry
    monkeypatch.undo()
    importlib.reload(m)  # back to the stand-in base


def test_subclasses_opencompass_basemodel_and_registers(oc_module, tiny_llada, tiny_tok):
    mod, registry = oc_module
    assert mod.HAVE_OPENCOMPASS and issubclass(mod.DareOpenCompassModel, FakeBaseModel)
    assert registry.modules["DareOpenCompassModel"] is mod.DareOpenCompassModel
    oc = mod.DareOpenCompassModel(path="tiny", model=tiny_llada, tokenizer=tiny_tok, max_seq_len=64,
                                  sampler=dict(gen_length=8, block_length=8, steps=8), mc_num=4, seed=1)
    assert oc.init_called and oc.path == "tiny"
    outs = oc.generate(["2+2=", "abc"], max_out_len=5)
    assert len(outs) == 2 and all(isinstance(o, str) for o in outs)
    assert oc.get_token_len("abcd") == len(tiny_tok("abcd")["input_ids"])
    assert oc.decode(oc.encode("hello")) == "hello"
    # get_ppl: mean NLL per scored token from the ELBO; the first mask_length tokens are context.
    ppl = oc.get_ppl(["2+2=4"], mask_length=[4])[0]
    ids = tiny_tok("2+2=4")["input_ids"]
    gen = torch.Generator().manual_seed(derive_seed(1, "opencompass-ll", "ppl:2+2=4:4"))
    assert ppl == pytest.approx(-elbo_loglikelihood(tiny_llada, ids[:4], ids[4:], mc_num=4, generator=gen) / len(ids[4:]))
    ll = oc.get_loglikelihood(["2+2= 4"], [" 4"])[0]
    assert ll < 0


def test_importable_without_opencompass(tiny_llada, tiny_tok):
    import dare.eval.opencompass_model as m
    if m.HAVE_OPENCOMPASS:
        pytest.skip("opencompass is installed here")
    oc = m.DareOpenCompassModel(path="tiny", model=tiny_llada, tokenizer=tiny_tok,
                                sampler=dict(gen_length=8, block_length=8, steps=8))
    out = oc.generate(["2+2="], max_out_len=12, stopping_criteria=["\n"])
    assert len(out) == 1 and "\n" not in out[0]
    assert oc.sampler.gen_length == 8  # the configured sampler is not mutated by max_out_len

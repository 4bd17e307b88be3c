"""SFT and LoRA of DiffusionGemma (NeMo AutoModel's objective) through dare's trainer; FSDP2 over 2 processes (integration tier)."""
import sys

import pytest
import torch
import torch.nn.functional as F

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.sft import SFTConfig
from dare.models import load_model
from dare.models.canvas import completion_layout
from dare.models.lora import adapters_disabled, has_lora
from dare.trainer.data import SFTDoc, sft_rows_batch
from dare.trainer.loop import Trainer
from tests.conftest import FIXTURES
from tests.trainer.helpers import TOY_SFT, sft_recipe
from tests.trainer.two_processes import Case, register, same_history

FOLDER = FIXTURES / "diffusiongemma-tiny"


def _manual_loss(hf, prompt, answer, noisy, self_condition: bool):
    """NeMo's objective computed with transformers' model directly: each canvas block decoded by ``forward`` with the
    prompt and the clean blocks before it encoded; flat CE over the answer; the encoder's next-token CE."""
    ce, n = 0.0, len(answer)
    for s in range(0, n, 4):
        ctx = torch.tensor([prompt + answer[:s]])
        block = noisy[:, s:s + 4]
        logits = hf(input_ids=ctx, decoder_input_ids=block).logits
        if self_condition:
            logits = hf(input_ids=ctx, decoder_input_ids=block, self_conditioning_logits=logits).logits
        ce = ce + F.cross_entropy(logits[0], torch.tensor(answer[s:s + 4]), reduction="sum")
    seq = torch.tensor([prompt + answer])
    h = hf.model.encoder(input_ids=seq).last_hidden_state
    z = hf.lm_head(h).float()
    z = torch.tanh(z / 30.0) * 30.0
    ar = F.cross_entropy(z[0, :-1], seq[0, 1:])
    return ce / n + ar


@pytest.mark.parametrize("self_condition", [False, True])
def test_sft_objective_is_nemo_canvas_ce_plus_encoder_ar_ce(self_condition):
    from transformers import DiffusionGemmaForBlockDiffusion
    model = load_model(FOLDER)
    hf = DiffusionGemmaForBlockDiffusion.from_pretrained(str(FOLDER), attn_implementation="sdpa").eval()
    prompt, answer = [5, 9, 33, 40, 41, 7, 8, 9, 10], [60, 61, 62, 63, 64, 65, 1]  # 2 canvases; context > window 8
    batch = sft_rows_batch([[SFTDoc(0, prompt, answer)]], [0], 1, False)
    algo = build_algorithm(SFTConfig(weighting="uniform", normalize="answer_tokens",
                                     self_conditioning_p=1.0 if self_condition else 0.0))
    ctx = StepContext(step=3, seed=5, adapter=model.adapter)
    views = algo.corrupt(ctx, batch, 0)
    batch.views = {0: views}
    ctx.norms = algo.normalizers(batch)
    L = batch["input_ids"].shape[1]
    noisy = views[0].input_ids[:, L:]
    assert noisy.shape[1] == len(answer) and torch.equal(views[0].input_ids[0, :L], batch["input_ids"][0])  # clean encoder
    with torch.no_grad():
        loss, metrics = algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, views), 0)
        want = _manual_loss(hf, prompt, answer, noisy, self_condition)
    assert abs(float(loss) - float(want)) < 1e-4 * max(1.0, float(want))
    assert ctx.norms["ar_tokens"] == len(prompt) + len(answer) - 1 and ctx.norms["answer_tokens"] == len(answer)


def test_sft_trains_and_exports_in_the_published_layout(tmp_path):
    recipe = sft_recipe(tmp_path, "train.export=true", "algorithm.weighting=uniform", "algorithm.normalize=answer_tokens",
                        "data.packing=true", family="diffusion_gemma")
    trainer = Trainer(recipe)
    hist = trainer.run()
    assert len(hist) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    assert all(h["ar_loss"] > 0 and h["diffusion_loss"] > 0 for h in hist)
    again = load_model(tmp_path / "export")
    ids = torch.randint(4, 100, (2, 18), generator=torch.Generator().manual_seed(0))
    layout = completion_layout(torch.ones(2, 6, dtype=torch.bool), 8, 4, 4)
    with torch.no_grad():
        assert torch.allclose(again(ids, layout=layout).logits, trainer.model(ids, layout=layout).logits, atol=1e-5)


@pytest.mark.integration
def test_sft_loss_decreases_on_toy_data(tmp_path):
    recipe = sft_recipe(tmp_path, "train.steps=30", "train.batch_size=16", "model.tiny_sizes={hidden_size: 64, num_layers: 2}",
                        "algorithm.weighting=uniform", "algorithm.normalize=answer_tokens", "optim.lr=3e-3",
                        "optim.schedule=cosine_with_min_lr", "optim.warmup_steps=3", "optim.min_lr_ratio=0.1",
                        family="diffusion_gemma")
    hist = Trainer(recipe).run()
    first = sum(h["diffusion_loss"] for h in hist[:6]) / 6
    last = sum(h["diffusion_loss"] for h in hist[-6:]) / 6
    assert last < 0.75 * first, (first, last)


def test_lora_adapts_encoder_and_decoder_together_and_exports_merged(tmp_path):
    recipe = sft_recipe(tmp_path, "lora.enabled=true", "lora.r=4", "optim.lr=3e-2", "train.export=true",
                        "model.tiny_sizes={hidden_size: 32, num_layers: 2}", family="diffusion_gemma")
    trainer = Trainer(recipe)
    m = trainer.model
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable) and not any("vision" in n for n in trainable)
    enc, dec = m.model.encoder.language_model.layers[0], m.model.decoder.layers[0]
    assert enc.self_attn.q_proj is dec.self_attn.q_proj and hasattr(dec.self_attn.q_proj, "lora_A")  # one adapter, two modes
    trainer.run()
    merged = load_model(tmp_path / "export")
    assert not has_lora(merged)
    ids = torch.randint(4, 100, (2, 18), generator=torch.Generator().manual_seed(1))
    layout = completion_layout(torch.ones(2, 6, dtype=torch.bool), 8, 4, 4)
    with torch.no_grad():
        adapted = m(ids, layout=layout).logits
        with adapters_disabled(m):
            base = m(ids, layout=layout).logits
        assert torch.allclose(merged(ids, layout=layout).logits, adapted, atol=1e-5)
        assert not torch.allclose(adapted, base, atol=1e-4)


def test_gradient_checkpointing_gives_the_same_step(tmp_path):
    a = Trainer(sft_recipe(tmp_path / "a", family="diffusion_gemma")).run()
    b = Trainer(sft_recipe(tmp_path / "b", "model.gradient_checkpointing=true", family="diffusion_gemma")).run()
    assert [h["loss"] for h in a] == pytest.approx([h["loss"] for h in b], rel=1e-5)


DG_SFT = ("model.path=tiny:diffusion_gemma", "train.steps=3", "train.batch_size=8", "train.micro_batch_size=1",
          "algorithm.weighting=uniform", "algorithm.normalize=answer_tokens", f"data.pairs={TOY_SFT}")
FSDP2_CASES = register({"fsdp2_diffusion_gemma": Case("recipes/sft_tiny.yaml", DG_SFT),
                        "fsdp2_lora_diffusion_gemma": Case("recipes/sft_tiny.yaml",
                                                           (*DG_SFT, "lora.enabled=true", "optim.lr=1e-2"))})


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", FSDP2_CASES)
def test_fsdp2_two_processes_reproduce_one_process(two_process_runs, case):
    """FSDP2 over 2 CPU processes (gloo; encoder layer i and decoder layer i sharded as one unit) gives the losses
    and gradient norms of one process."""
    one, two = two_process_runs(case)
    assert len(one.metrics) == len(two.metrics) == 3
    same_history(one.metrics, two.metrics, ("loss", "grad_norm", "ar_loss"))
    assert all("ar_loss" in r for r in one.metrics)


def test_diffusion_gemma_recipes_are_valid():
    """The 26B-A4B recipes (8 GPUs) and their tiny CPU counterparts parse into typed configs."""
    from dare.config import from_dict, load_yaml
    from dare.trainer.recipe import load_recipe
    from dare.eval.config import EvalConfig
    from tests.trainer.helpers import ROOT
    folder = ROOT / "recipes/diffusion_gemma"
    names = sorted(p.name for p in folder.glob("*.yaml"))
    assert {"sft_26b.yaml", "lora_26b.yaml", "rl_26b.yaml", "eval_26b.yaml", "sft_tiny.yaml", "lora_tiny.yaml",
            "rl_tiny.yaml", "eval_tiny.yaml"} <= set(names)
    for name in names:
        if name.startswith("eval"):
            cfg = from_dict(EvalConfig, load_yaml(folder / name))
            assert cfg.sampler.t_min is not None and cfg.models
            continue
        recipe = load_recipe(folder / name)
        assert "diffusion_gemma" in recipe.model.path or "diffusiongemma" in recipe.model.path
        if name.endswith("26b.yaml"):
            assert recipe.distributed.nproc == 8
        if name.startswith("lora") or name == "rl_26b.yaml":
            assert recipe.lora.enabled

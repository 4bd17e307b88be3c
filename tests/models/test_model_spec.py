"""``load_model_spec``: the one loader of ``tiny:<family>`` / folder / hub-id specs behind the trainer, evaluation and
``dare generate``, with every check any of them made."""
import pytest
import torch

from dare.models import CheckpointError, load_model, load_model_spec, save_pretrained, tiny, tiny_tokenizer
from dare.models.model_spec import resolve_device
from tests.conftest import FIXTURES


def test_tiny_spec_is_the_seeded_tiny_model_in_eval_mode():
    model, tok = load_model_spec("tiny:sdar", tiny_seed=3, tiny_sizes={"num_layers": 1}, attn_backend="sdpa")
    ref = tiny("sdar", tokenizer=tiny_tokenizer(), seed=3, num_layers=1)
    assert not model.training and model.name_or_path == "tiny:sdar" and model.attn_backend == "sdpa"
    assert len(tok) == len(tiny_tokenizer()) and model.arch.num_layers == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    half, _ = load_model_spec("tiny:llada", dtype="bfloat16")
    assert half.dtype == torch.bfloat16


def test_tiny_sizes_only_apply_to_tiny_specs(caplog):
    # issue 40: a tiny recipe pointed at a real checkpoint (as its comment says) was refused; the sizes are ignored
    with caplog.at_level("WARNING", logger="dare"):
        model, _ = load_model_spec(str(FIXTURES / "llada-tiny"), tokenizer="tiny", tiny_sizes={"num_layers": 1})
    assert model.arch.num_layers == load_model(FIXTURES / "llada-tiny").arch.num_layers == 2
    assert "model.tiny_sizes {'num_layers': 1} ignored: it sizes tiny:<family> models" in caplog.text


def test_a_config_without_mask_id_takes_the_loaded_tokenizers(tmp_path):
    tok = tiny_tokenizer()
    save_pretrained(tiny("llada2_moe", tokenizer=tok, seed=0), tmp_path)  # LLaDA2's config carries no mask id
    with pytest.raises(CheckpointError, match="no mask token id"):
        load_model(tmp_path)
    model, _ = load_model_spec(str(tmp_path), tokenizer="tiny")
    assert model.adapter.mask_token_id == tok.mask_token_id
    explicit, _ = load_model_spec(str(tmp_path), tokenizer="tiny", mask_token_id=7)
    assert explicit.adapter.mask_token_id == 7


def test_the_tokenizer_must_fit_the_vocabulary(tmp_path):
    save_pretrained(tiny("llada", seed=0, vocab_size=64), tmp_path)
    with pytest.raises(ValueError, match="has 128 tokens but the model's vocabulary is 64"):
        load_model_spec(str(tmp_path), tokenizer="tiny")


def test_token_id_prompts_need_no_tokenizer():
    model, tok = load_model_spec(str(FIXTURES / "llada-tiny"), tokenizer_required=False, device="cpu")
    assert tok is None and model.family == "llada" and model.device.type == "cpu" and not model.training


def test_devices_this_machine_lacks_are_one_line_errors():
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model_spec("tiny:llada", device="cuda")

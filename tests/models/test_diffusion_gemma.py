"""DiffusionGemma: transformers' own model behind dare's API (load, save, round trip, the training forward)."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dare.models import CheckpointError, LogitsRequest, detect_family, load_model, tiny
from dare.models.canvas import CanvasLayout, completion_layout, encoded_completion_len
from dare.models.tokenizer import tiny_tokenizer
from tests.conftest import FIXTURES

FOLDER = FIXTURES / "diffusiongemma-tiny"


def _keys(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return sorted(f.keys())


def _no_dtype(cfg):
    # transformers stamps its own version into a saved config (5.24 -> 5.25 broke an exact comparison in CI)
    if isinstance(cfg, dict):
        return {k: _no_dtype(v) for k, v in cfg.items() if k not in ("dtype", "transformers_version")}
    return cfg


def _hf(folder=FOLDER):
    from transformers import DiffusionGemmaForBlockDiffusion
    return DiffusionGemmaForBlockDiffusion.from_pretrained(str(folder), attn_implementation="sdpa").eval()


def test_detected_and_adapter_describes_uniform_noise():
    model = load_model(FOLDER)
    a = model.adapter
    assert model.family == "diffusion_gemma" == detect_family(json.loads((FOLDER / "config.json").read_text())).name
    assert (a.noise, a.attention, a.mask_token_id, a.block_size, a.vocab_size) == ("uniform", "encoder_decoder", -1, 4, 128)
    assert a.logit_softcap == 30.0 and a.eos_token_id == 1 and a.cache_kinds == ("none", "block")
    # encoder and decoder share modules (one set of weights in two modes), the LM head is tied to the embedding
    enc, dec = model.model.encoder.language_model, model.model.decoder
    assert enc.layers[1].self_attn.q_proj is dec.layers[1].self_attn.q_proj and enc.layers[0].experts is dec.layers[0].experts
    assert model.lm_head.weight is dec.embed_tokens.weight
    assert not any(p.requires_grad for p in model.vision_parameters())


def test_round_trip_keeps_published_layout_and_vision_tower(tmp_path):
    model = load_model(FOLDER)
    model.save_pretrained(tmp_path)
    assert _keys(tmp_path) == _keys(FOLDER)  # decoder weights, encoder layer_scalar buffers, the vision tower
    assert any(k.startswith("model.encoder.vision_tower.") for k in _keys(tmp_path))
    saved, orig = json.loads((tmp_path / "config.json").read_text()), json.loads((FOLDER / "config.json").read_text())
    assert _no_dtype(saved) == _no_dtype(orig)  # transformers adds the sub-configs' dtype on a reload and its version
    a, b = load_file(str(FOLDER / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    again = _hf(tmp_path)  # loads in transformers' own class
    ref = _hf()
    ids, canvas = torch.tensor([[5, 9, 33, 40]]), torch.tensor([[7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids, decoder_input_ids=canvas).logits, ref(input_ids=ids, decoder_input_ids=canvas).logits)


def test_tiny_round_trip_with_tokenizer(tmp_path):
    tok = tiny_tokenizer()
    model = tiny("diffusion_gemma", tokenizer=tok, hidden_size=32, num_heads=2, num_layers=3, seed=3)
    assert model.text_config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    model.save_pretrained(tmp_path, tokenizer=tok)
    again = load_model(tmp_path)
    assert again.family == "diffusion_gemma" and again.arch.vocab_size == 128 and again.arch.num_layers == 3
    sd1, sd2 = model.state_dict(), again.state_dict()
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)


def test_training_forward_scores_each_block_as_transformers_decodes_it():
    """One block-causal forward over [prompt ; clean blocks ; noisy canvases] = transformers' forward on each canvas
    with the prompt and the clean blocks before it encoded (the sliding window 8 is shorter than the context)."""
    model, hf = load_model(FOLDER), _hf()
    g = torch.Generator().manual_seed(0)
    P, G = 9, 12
    prompt, clean, noisy = (torch.randint(2, 128, (1, n), generator=g) for n in (P, G, G))
    E = encoded_completion_len(G, 4)
    layout = completion_layout(torch.ones(1, P, dtype=torch.bool), G, 4, E)
    with torch.no_grad():
        out = model(torch.cat([prompt, clean[:, :E], noisy], 1), layout=layout, request=LogitsRequest(hidden=True))
        for b in range(3):
            ctx = torch.cat([prompt, clean[:, :4 * b]], 1)
            ref = hf(input_ids=ctx, decoder_input_ids=noisy[:, 4 * b:4 * b + 4]).logits
            got = out.logits[:, P + E + 4 * b:P + E + 4 * b + 4]
            assert (got - ref).abs().max() < 1e-4
        enc = hf.model.encoder(input_ids=torch.cat([prompt, clean[:, :E]], 1)).last_hidden_state
        assert (out.hidden_states[:, :P + E] - enc).abs().max() < 1e-5  # encoder rows: the AR loss reads them


def _sequential(model, ids, layout, sc_logits=None, sc_mask=None):
    """transformers' order: every encoder layer over the clean context, then every decoder layer over the canvases."""
    from transformers.cache_utils import DynamicCache
    Le, sw = layout.enc_len, model.sliding_window
    cache = DynamicCache()
    enc = model.model.encoder(input_ids=ids[:, :Le], attention_mask=layout.encoder_masks(sw), position_ids=layout.enc_pos,
                              cache=cache).last_hidden_state
    dec = model.model.decoder(decoder_input_ids=ids[:, Le:], cache=cache, self_conditioning_logits=sc_logits,
                              self_conditioning_mask=sc_mask, decoder_attention_mask=layout.decoder_masks(sw),
                              decoder_position_ids=layout.dec_pos).last_hidden_state
    return torch.cat([enc, dec], 1)


def test_paired_layers_equal_transformers_order_with_and_without_checkpointing():
    """The training forward runs encoder layer i then decoder layer i (so a shared weight's two gradients complete
    together); its values are transformers' encoder-then-decoder order, self-conditioning included, and a
    checkpointed pair (recomputed with a cache of its own) gives the same loss and gradients."""
    model = load_model(FOLDER)
    g = torch.Generator().manual_seed(3)
    P, G = 7, 12
    E = encoded_completion_len(G, 4)
    ids = torch.randint(2, 128, (2, P + E + G), generator=g)
    layout = completion_layout(torch.ones(2, P, dtype=torch.bool), G, 4, E)
    sc = torch.randn(2, G, 128, generator=g)
    with torch.no_grad():
        Le = layout.enc_len
        got = model._encode_decode(ids[:, :Le], layout.encoder_masks(model.sliding_window), layout.enc_pos, ids[:, Le:],
                                   layout.decoder_masks(model.sliding_window), layout.dec_pos, sc, torch.tensor([True, False]))
        assert torch.equal(torch.cat(got, 1), _sequential(model, ids, layout, sc, torch.tensor([True, False])))
    model.train()
    grads = []
    for ckpt in (False, True):
        model.gradient_checkpointing_enable(ckpt)
        model.zero_grad()
        h = model(ids, layout=layout, request=LogitsRequest.hidden_states()).hidden_states
        (model.logits_of(h).float().log_softmax(-1)[..., 5].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 20
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-6, msg=n)


def test_left_padding_and_packed_documents_are_exact():
    model = load_model(FOLDER)
    g = torch.Generator().manual_seed(1)
    prompt, clean, noisy = (torch.randint(2, 128, (1, n), generator=g) for n in (6, 8, 8))
    with torch.no_grad():
        base = model(torch.cat([prompt, clean[:, :4], noisy], 1),
                     layout=completion_layout(torch.ones(1, 6, dtype=torch.bool), 8, 4, 4)).logits
        padded = model(torch.cat([torch.full((1, 3), 0), prompt, clean[:, :4], noisy], 1),
                       layout=completion_layout(torch.tensor([[False] * 3 + [True] * 6]), 8, 4, 4)).logits
        assert (padded[:, 3:] - base).abs().max() < 1e-4
        # two documents packed in one row see nothing of each other
        other = torch.randint(2, 128, (1, 5), generator=g)
        enc = torch.cat([other, prompt, clean[:, :4]], 1)
        lay = CanvasLayout(enc_pos=torch.cat([torch.arange(5), torch.arange(10)])[None],
                           enc_doc=torch.tensor([[0] * 5 + [1] * 10]), dec_pos=(6 + torch.arange(8))[None],
                           dec_doc=torch.ones(1, 8, dtype=torch.long), dec_block_start=torch.tensor([[6] * 4 + [10] * 4]))
        packed = model(torch.cat([enc, noisy], 1), layout=lay).logits
        assert (packed[:, 15:] - base[:, 10:]).abs().max() < 1e-4


def test_forward_without_layout_is_a_clear_error():
    model = tiny("diffusion_gemma")
    with pytest.raises(ValueError, match="CanvasLayout"):
        model(torch.tensor([[1, 2, 3]]))


def test_bad_checkpoints_are_named(tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(FOLDER, dst)
    state = load_file(str(dst / "model.safetensors"))
    state.pop("model.decoder.layers.1.self_attn.o_proj.weight")
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing.*o_proj"):
        load_model(dst)
    cfg = json.loads((FOLDER / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        load_model(dst)

"""Attention layouts: packing, padding, the block-diffusion training mask (algorithms.md §0.4) and backends."""
import pytest
import torch

from dare.models import LogitsRequest, load_model, masks, tiny
from tests.conftest import FIXTURES

FAMILIES = ["llada", "llada_moe", "dream", "sdar", "sdar_moe", "llada2_moe"]


def brute_force_bd_mask(L, block):
    """[x_t ; x_0] mask written directly from the three-part definition (BD, OBC, BC)."""
    m = torch.zeros(2 * L, 2 * L, dtype=torch.bool)
    for q in range(2 * L):
        for k in range(2 * L):
            qb, kb = (q % L) // block, (k % L) // block
            if q < L and k < L:
                m[q, k] = qb == kb  # noisy block sees only itself
            elif q < L <= k:
                m[q, k] = kb < qb  # noisy block b sees clean blocks < b
            elif q >= L and k >= L:
                m[q, k] = kb <= qb  # clean copy is block-causal
    return m


@pytest.mark.parametrize("L,block", [(8, 2), (12, 4), (10, 4), (6, 6)])
def test_block_diffusion_mask_matches_brute_force(L, block):
    layout = masks.block_diffusion_layout(torch.arange(L)[None])
    assert torch.equal(masks.dense_mask(layout, layout, block)[0, 0], brute_force_bd_mask(L, block))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_documents_run_one_by_one(family):
    model = tiny(family, seed=1).eval()
    docs = [torch.randint(0, 400, (n,)) for n in (5, 9, 3)]
    packed = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with torch.no_grad():
        out = model(packed, layout=model.adapter.packed_layout(pos)).logits[0]
        start = 0
        for d in docs:
            single = model(d[None]).logits[0]
            assert (out[start:start + len(d)] - single).abs().max().item() < 1e-5
            start += len(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_is_exact(family):
    model = tiny(family, seed=2).eval()
    a, b = torch.randint(0, 400, (11,)), torch.randint(0, 400, (6,))
    batch = torch.full((2, 11), 7)
    batch[0], batch[1, 5:] = a, b
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :5] = 0
    with torch.no_grad():
        out = model(batch, attention_mask=mask).logits
        assert (out[0] - model(a[None]).logits[0]).abs().max().item() < 1e-5
        assert (out[1, 5:] - model(b[None]).logits[0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["sdar", "llada2_moe"])
def test_block_training_invariances(family):
    model = tiny(family, seed=3).eval()
    B = model.adapter.block_size
    L = 3 * B
    x0 = torch.randint(0, 400, (1, L))
    xt = x0.clone()
    xt[0, ::2] = model.adapter.mask_token_id
    pos = torch.arange(L)[None]
    layout = model.adapter.block_diffusion_layout(pos)
    with torch.no_grad():
        base = model(torch.cat([xt, x0], 1), layout=layout).logits[0, :L]
        # changing the noisy tokens of block 2 leaves the logits of blocks 0 and 1 unchanged
        xt2 = xt.clone()
        xt2[0, 2 * B:] = torch.randint(0, 400, (B,))
        changed = model(torch.cat([xt2, x0], 1), layout=layout).logits[0, :L]
        assert torch.allclose(base[:2 * B], changed[:2 * B], atol=1e-6)
        assert not torch.allclose(base[2 * B:], changed[2 * B:], atol=1e-3)


def test_block_size_equal_to_length_is_plain_masked_diffusion_on_the_noisy_half():
    model = tiny("sdar", seed=4).eval()
    L = model.adapter.block_size
    x0 = torch.randint(0, 400, (1, L))
    xt = x0.clone()
    xt[0, 1::2] = model.adapter.mask_token_id
    with torch.no_grad():
        bd = model(torch.cat([xt, x0], 1), layout=model.adapter.block_diffusion_layout(torch.arange(L)[None])).logits[0, :L]
        mdm = model(xt).logits[0]  # one block = bidirectional over the noisy sequence
    assert torch.allclose(bd, mdm, atol=1e-5)


def test_flex_attention_forward_matches_dense_on_cpu():
    model = tiny("sdar", seed=5).eval()
    L = 12
    x0 = torch.randint(0, 400, (2, L))
    pos = torch.arange(L).expand(2, L)
    layout = model.adapter.block_diffusion_layout(pos)
    ids = torch.cat([x0, x0], 1)
    with torch.no_grad():
        dense = model(ids, layout=layout).logits
        model.set_attn_backend("flex")
        flex = model(ids, layout=layout).logits
    assert (dense - flex).abs().max().item() < 1e-4


def test_flex_backend_falls_back_to_dense_mask_for_cpu_training():
    model = tiny("llada", seed=6)
    model.set_attn_backend("flex")
    ids = torch.randint(0, 400, (1, 10))
    layout = model.adapter.packed_layout(torch.cat([torch.arange(4), torch.arange(6)])[None])
    loss = model(ids, layout=layout).logits.logsumexp(-1).mean()
    loss.backward()  # FlexAttention has no CPU backward: this must not raise
    assert model.lm_head.weight.grad is not None


@pytest.mark.parametrize("family", ["llada", "llada2_moe"])
def test_gradient_checkpointing_gives_identical_gradients(family):
    ids = torch.randint(0, 400, (2, 10))
    grads = []
    for ckpt in (False, True):
        model = tiny(family, seed=7).train()
        model.gradient_checkpointing_enable(ckpt)
        model(ids).logits.float().pow(2).mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def test_kept_rows_and_hidden_outputs_agree_with_full_logits():
    model = load_model(FIXTURES / "dream-tiny", dtype=torch.float32)
    ids = torch.randint(0, 480, (2, 12))
    rows = torch.zeros(2, 12, dtype=torch.bool)
    rows[:, 4:9] = True
    with torch.no_grad():
        full = model(ids).logits
        part = model(ids, request=LogitsRequest(keep=rows)).logits
        hidden = model(ids, request=LogitsRequest.hidden_states()).hidden_states
    assert torch.equal(part, full[rows])
    assert torch.allclose(model.lm_head(hidden), full, atol=1e-6)


def test_dream_prediction_logits_shift_right_by_one():
    model = load_model(FIXTURES / "dream-tiny", dtype=torch.float32)
    logits = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)
    pred = model.adapter.prediction_logits(logits)
    assert torch.equal(pred[:, 0], logits[:, 0]) and torch.equal(pred[:, 3], logits[:, 2])
    assert torch.equal(model.adapter.prediction_rows(torch.tensor([0, 1, 7])), torch.tensor([0, 0, 6]))


def test_kv_cache_modes_prefix_and_dual_reproduce_full_forward_when_nothing_changes():
    model = load_model(FIXTURES / "llada-tiny", dtype=torch.float32)
    ids = torch.randint(0, 480, (1, 20))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        model(ids, past_key_values=cache, store_kv=True)
        cache.crop(8)  # prefix cache: keep keys before the block, feed the rest
        prefix = model(ids[:, 8:], past_key_values=cache).logits
        cache = model.new_cache()
        model(ids, past_key_values=cache, store_kv=True)
        dual = model(ids[:, 8:12], past_key_values=cache, kv_start=8).logits  # overwrite the block's slots in place
    assert (prefix - full[:, 8:]).abs().max().item() < 1e-5
    assert (dual - full[:, 8:12]).abs().max().item() < 1e-5

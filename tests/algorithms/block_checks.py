"""Golden checks of the block-diffusion ``[x_t ; x_0]`` views of RL estimators (d1, wd1, Coupled-GRPO, SPG, ESPO).

A view of a block-causal model holds ``[noisy ; clean]`` rows of width ``2W`` (``W`` = padded prompt + completion).
The checks compare its per-token log-probs with a brute-force computation that runs one plain block-causal forward
per completion block: the clean half up to the block, then the block's noisy tokens (algorithms.md 0.4).
"""
import torch

from dare.diffusion.logprob import score_targets
from dare.models import tiny, tiny_tokenizer


def block_model(family="sdar"):
    """A tiny block-causal model whose block (4) is smaller than the test completions (LLaDA2's default is 32)."""
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, num_layers=1)
    model.adapter.block_size = 4
    return model


def token_logp(model, view, input_ids=None):
    """Per-token log-probs ``[B, W]`` of the view's targets (0 elsewhere)."""
    ids = view.input_ids if input_ids is None else input_ids
    lp, _ = score_targets(model, ids, view.targets, view.labels, attention_mask=view.attention_mask,
                          position_ids=view.position_ids, layout=view.layout)
    return lp


def row_blocks(batch, i, block_size):
    """Row i's completion blocks as buffer-column ranges ``[start, end)`` (blocks over absolute positions)."""
    P = batch.prompt_ids.shape[1]
    pad = P - int(batch.prompt_mask[i].sum())
    Lc = batch.completion_ids.shape[1]
    out, col = [], P
    while col < P + Lc:
        end = min(pad + ((col - pad) // block_size + 1) * block_size, P + Lc)
        out.append((col, end))
        col = end
    return out


def brute_force_logp(model, batch, view, block_size):
    """``[B, W]``: each completion block b scored by its own plain forward over ``clean[:b] + noisy[b]``."""
    W = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
    noisy, clean = view.input_ids[:, :W], view.input_ids[:, W:]
    attn = torch.cat([batch.prompt_mask.bool(), torch.ones_like(batch.completion_mask, dtype=torch.bool)], 1)
    out = torch.zeros(view.targets.shape)
    for i in range(batch.size):
        for s, e in row_blocks(batch, i, block_size):
            # A first block that holds the prompt's tail takes it from the clean half: both halves agree on the prompt.
            x = torch.cat([clean[i, :s], noisy[i, s:e]])[None]
            logits = model(x, attention_mask=attn[i:i + 1, :e]).logits.float().log_softmax(-1)[0]
            lab = view.labels[i, s:e]
            out[i, s:e] = torch.where(view.targets[i, s:e], logits[torch.arange(s, e), lab], torch.zeros(e - s))
    return out


def assert_matches_brute_force(model, batch, views, block_size=4, atol=1e-5):
    """Every view: its one-pass per-token log-probs equal the per-block brute force at every target."""
    for v in views:
        assert v.layout is not None and v.input_ids.shape[1] == 2 * v.targets.shape[1]
        assert v.targets.any()
        one_pass, brute = token_logp(model, v), brute_force_logp(model, batch, v, block_size)
        assert torch.allclose(one_pass[v.targets], brute[v.targets], atol=atol), (one_pass - brute).abs().max()


def assert_future_blocks_invisible(model, batch, views, block_size=4, seed=0):
    """Rewriting every token (noisy and clean copies) after a row's first completion block leaves that block's
    log-probs bit-identical, while rewriting the clean copy of that block changes the later blocks' log-probs."""
    g = torch.Generator().manual_seed(seed)
    W = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
    checked = changed = 0
    for v in views:
        base = token_logp(model, v)
        later = v.input_ids.clone()
        earlier = v.input_ids.clone()
        cut = []
        for i in range(batch.size):
            s, e = row_blocks(batch, i, block_size)[0]
            cut.append(e)
            for half in (0, W):
                later[i, half + e:half + W] = torch.randint(10, 100, (W - e,), generator=g)
            earlier[i, W + s:W + e] = torch.randint(10, 100, (e - s,), generator=g)  # the clean copy of the block
        moved = token_logp(model, v, later)
        shifted = token_logp(model, v, earlier)
        for i, e in enumerate(cut):
            first = v.targets[i, :e]
            assert torch.equal(base[i, :e][first], moved[i, :e][first])
            checked += int(first.sum())
            rest = v.targets[i, e:]
            changed += int((base[i, e:][rest] != shifted[i, e:][rest]).sum())
    assert checked > 0 and changed > 0


def naive_block_causal_logp(model, view, W):
    """Log-probs of the targets from a plain block-causal forward of the noisy half alone (no clean copy): every
    block then sees the *noisy* earlier blocks -- the input the block layout replaces."""
    noisy = view.input_ids[:, :W]
    valid = view.layout.valid[:, :W]
    lp, _ = score_targets(model, noisy, view.targets, view.labels, attention_mask=valid)
    return lp

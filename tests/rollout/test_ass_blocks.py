"""CJ-GRPO's multi-block ASS (``SamplerConfig.ass_blocks``, the reference's ``block_num``): the ASS steps of the
whole completion grouped into variable-size blocks, decoded semi-autoregressively.

Golden test: an independent re-implementation of the reference loop (``eoser_ass_generate`` /
``get_block_sizes`` / ``get_num_transfer_tokens_ass`` of ``cj_grpo_trainer_eoser_ass.py``: one full forward per
step, low-confidence top-k restricted to the current block, EOS confidence scaled by the ASS gamma) decodes the same
tokens as ``dare.rollout.generate`` at temperature 0.
"""
import dataclasses
import math

import pytest
import torch

from dare.models import tiny, tiny_tokenizer
from dare.rollout import SamplerConfig, generate
from dare.rollout.schedule import ass_block_steps, ass_split


def reference_block_sizes(gen_length: int, block_num: int):
    """The reference's block sizes and the global step indices of each block (peeled from the end)."""
    S = int(math.log2(gen_length))
    reminder = gen_length - 2 ** S
    sizes, steps, remaining, power = [], [], gen_length, S - 1
    for b in range(block_num - 1, -1, -1):
        if block_num == 1:
            size, st = remaining, list(range(S))
        elif b == block_num - 1:
            size, st = 2 ** power + 1 + reminder, [power]
            power -= 1
        elif b == 0:
            size, st = remaining, list(range(power + 1))
        else:
            size, st = 2 ** power, [power]
            power -= 1
        remaining -= size
        sizes.insert(0, size)
        steps.insert(0, st)
    assert remaining == 0
    counts = [2 ** i for i in range(S)]
    counts[-1] = sizes[-1] if block_num > 1 else sizes[-1] - (2 ** (S - 1) - 1)
    return sizes, steps, counts


@torch.no_grad()
def reference_decode(model, prompt, gen_length, block_num, eos_id, gamma_min=0.01, gamma_max=1.0):
    mask_id = model.adapter.mask_token_id
    S = int(math.log2(gen_length))
    sizes, block_steps, counts = reference_block_sizes(gen_length, block_num)
    P = len(prompt)
    x = torch.tensor([list(prompt) + [mask_id] * gen_length])
    start = P
    for size, steps in zip(sizes, block_steps):
        end = start + size
        for i in steps:
            logits = model(x).logits[0].float()
            logits[:, mask_id] = -float("inf")  # dare never commits the mask token (documented in docs/samplers.md)
            p = torch.softmax(logits, -1)
            x0 = p.argmax(-1)
            conf = p.gather(1, x0[:, None]).squeeze(1)
            fac = gamma_min + (gamma_max - gamma_min) * (2 ** (i + 1) - 1) / 2 ** S
            conf = torch.where(x0 == eos_id, conf * fac, conf)
            conf[end:] = -float("inf")
            conf = torch.where(x[0] == mask_id, conf, torch.full_like(conf, -float("inf")))
            idx = torch.topk(conf, counts[i]).indices
            x[0, idx] = x0[idx]
        start = end
    return x[0, P:].tolist()


@pytest.mark.parametrize("gen_length,blocks", [(16, 1), (16, 2), (16, 3), (16, 4), (20, 3), (32, 2)])
def test_block_structure_matches_the_reference(gen_length, blocks):
    sizes, block_steps, counts = reference_block_sizes(gen_length, blocks)
    assert ass_split(gen_length).tolist() == counts
    assert ass_block_steps(gen_length, blocks) == [len(s) for s in block_steps]
    per_step = ass_split(gen_length).tolist()
    grouped, k = [], 0
    for n in ass_block_steps(gen_length, blocks):
        grouped.append(sum(per_step[k:k + n]))
        k += n
    assert grouped == sizes


def test_decodes_like_the_reference_loop():
    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, seed=3, num_layers=1)
    eos = model.adapter.eos_token_id
    blocks_matter = False
    for gen_length, blocks in [(16, 2), (16, 3), (20, 3), (32, 4)]:
        cfg = SamplerConfig(gen_length=gen_length, block_length=gen_length, schedule="ass", ass_blocks=blocks,
                            eoser=True, eoser_gamma_min=0.01, temperature=0.0, block_stop=False, stop_token_ids=[eos])
        sizes, block_steps, _ = reference_block_sizes(gen_length, blocks)
        for text in ("abc", "hello there"):
            prompt = tok.encode(text)
            r = generate(model, [prompt], cfg)
            assert r.completion_ids[0].tolist() == reference_decode(model, prompt, gen_length, blocks, eos)
            assert r.nfe == int(math.log2(gen_length))  # one forward per ASS step
            # every token of block b is written at one of the block's global steps (semi-autoregressive blocks)
            start = 0
            for size, steps in zip(sizes, block_steps):
                assert set(r.step_map[0, start:start + size].tolist()) <= set(steps)
                start += size
            one_block = generate(model, [prompt], dataclasses.replace(cfg, ass_blocks=1))
            blocks_matter |= not torch.equal(one_block.completion_ids, r.completion_ids)
    assert blocks_matter  # the block restriction changes some decodes: the comparison can tell blocks apart


def test_bad_settings_name_the_parameter():
    with pytest.raises(ValueError, match="block_length = gen_length"):
        SamplerConfig(gen_length=16, block_length=8, schedule="ass", ass_blocks=2)
    with pytest.raises(ValueError, match="schedule='ass'"):
        SamplerConfig(gen_length=16, block_length=16, ass_blocks=2)
    with pytest.raises(ValueError, match="between 1 and floor"):
        SamplerConfig(gen_length=16, block_length=16, schedule="ass", ass_blocks=5)
    tok = tiny_tokenizer()
    sdar = tiny("sdar", tokenizer=tok, seed=0, num_layers=1)
    with pytest.raises(ValueError, match="ass_blocks is only implemented for masked-diffusion"):
        generate(sdar, [tok.encode("abc")], SamplerConfig(gen_length=16, block_length=16, schedule="ass", ass_blocks=2))

"""Pausing, resuming and branching a decode (``generate(until_step=...)``, ``resume``, ``generate_tree``)."""
import pytest
import torch

from dare.models import tiny, tiny_tokenizer
from dare.rollout import Record, SamplerConfig, generate, generate_tree, resume, steps_per_block

from tests.threads import TEST_THREADS

PROMPTS = ("abc", "hello there friend")
CONFIGS = {
    "llada": dict(gen_length=12, block_length=4, steps=12),
    "llada-threshold": dict(gen_length=12, block_length=4, steps=12, threshold=0.02),
    "dream": dict(gen_length=12, block_length=12, steps=6, remasking="maskgit_plus"),
    "sdar": dict(gen_length=12, block_length=4, steps_per_block=4),
    "sdar-block-cache": dict(gen_length=12, block_length=4, steps_per_block=4, cache="block"),
}


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)


def _model(name):
    model = tiny(name.split("-")[0], tokenizer=tiny_tokenizer(), seed=0, num_layers=2)
    if model.adapter.is_block_causal:
        model.adapter.block_size = 4
    return model


def _prompts():
    tok = tiny_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pause_then_resume_equals_one_decode(name):
    """Greedy decoding: a decode paused anywhere and resumed gives generate()'s tokens, step map and row steps."""
    model = _model(name)
    cfg = SamplerConfig(temperature=0.0, block_stop=False, **CONFIGS[name])
    full = generate(model, _prompts(), cfg, n=2)
    for until in (1, 3, 5, 7):
        part = generate(model, _prompts(), cfg, n=2, until_step=until)
        if part.paused_at is None:
            continue
        spb = steps_per_block(model, cfg)
        assert tuple(part.paused_at) >= (until // spb, until % spb)
        mask_id = model.adapter.mask_token_id
        assert torch.equal(part.completion_ids == mask_id, part.step_map < 0)  # uncommitted positions stay masked
        assert part.finished is not None and part.nfe < full.nfe
        done = resume(model, part, cfg)
        assert done.paused_at is None
        assert torch.equal(done.completion_ids, full.completion_ids)
        assert torch.equal(done.step_map, full.step_map)
        assert torch.equal(done.num_steps, full.num_steps)
        assert part.nfe + done.nfe >= full.nfe


def test_resume_branches_every_row_with_its_own_generators():
    model = _model("llada")
    cfg = SamplerConfig(temperature=1.0, gen_length=8, block_length=8, steps=8)
    part = generate(model, _prompts(), cfg, n=1, seeds=[1, 2], until_step=3)
    kids = resume(model, part, cfg, n=3, seeds=[7, 8])
    assert kids.completion_ids.shape[0] == 6 and kids.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    old = part.step_map.repeat_interleave(3, 0) >= 0
    assert torch.equal(kids.completion_ids[old], part.completion_ids.repeat_interleave(3, 0)[old])  # shared prefix
    assert len({tuple(r.tolist()) for r in kids.completion_ids[:3]}) > 1  # different continuations
    again = resume(model, part, cfg, n=3, seeds=[7, 8])
    assert torch.equal(again.completion_ids, kids.completion_ids)  # seeded


def test_pause_and_resume_errors_name_the_problem():
    model = _model("llada")
    cfg = SamplerConfig(gen_length=8, block_length=8, steps=8)
    full = generate(model, _prompts(), cfg)
    with pytest.raises(ValueError, match="paused rollout"):
        resume(model, full, cfg)
    part = generate(model, _prompts(), cfg, until_step=4)
    with pytest.raises(ValueError, match="not after"):
        resume(model, part, cfg, until_step=2)
    with pytest.raises(ValueError, match="recording a trajectory"):
        generate(model, _prompts(), SamplerConfig(gen_length=8, block_length=8, steps=8), until_step=2,
                 record=Record(trajectory=True))
    with pytest.raises(ValueError, match="cut steps"):
        generate_tree(model, _prompts(), cfg, [2, 2], [2, 4])


def test_tree_levels_parents_and_carried_finished_rows():
    model = _model("sdar")
    cfg = SamplerConfig(gen_length=8, block_length=4, steps_per_block=4, temperature=1.0)
    tree = generate_tree(model, _prompts(), cfg, [2, 3, 2], [2, 5], seeds=[3, 4])
    assert [lv.completion_ids.shape[0] for lv in tree.levels] == [4, 12, 24]
    assert tree.parents[1].tolist() == [r // 3 for r in range(12)] and tree.parents[0].tolist() == [0, 0, 1, 1]
    assert tree.leaves.paused_at is None and (tree.leaves.completion_ids != model.adapter.mask_token_id).all()
    assert tree.ancestors(2, 7) == [int(tree.parents[1][3]), 3, 7]
    # every token stops a row: all rows end with their first block, so the later levels are carried copies
    stops = [t for t in range(len(tiny_tokenizer())) if t != model.adapter.mask_token_id]
    stopped = generate_tree(model, _prompts(), SamplerConfig(gen_length=8, block_length=4, steps_per_block=4,
                                                             stop_token_ids=stops), [2, 2], [6])
    assert stopped.levels[0].paused_at is None and stopped.levels[1].nfe == 0
    assert torch.equal(stopped.levels[1].completion_ids, stopped.levels[0].completion_ids.repeat_interleave(2, 0))

import pytest
import torch
import torch.nn.functional as F

from dare.algorithms import StepContext, build_algorithm
from dare.algorithms.sft import SFTConfig
from dare.diffusion import block_diffusion_inputs, score_targets
from dare.models import load_model, tiny, tiny_tokenizer
from dare.trainer import stages
from dare.trainer.data import SFTDoc, pack_first_fit, sft_rows_batch
from tests.conftest import FIXTURES
from tests.threads import TEST_THREADS


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models: intra-op threads only spin on a shared 2-core machine.
    before = torch.get_num_threads()
    torch.set_num_threads(TEST_THREADS)
    yield
    torch.set_num_threads(before)


def _docs(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        p = int(torch.randint(2, 6, (1,), generator=g))
        a = int(torch.randint(2, 9, (1,), generator=g))
        docs.append(SFTDoc(i, torch.randint(10, 100, (p,), generator=g).tolist(), torch.randint(10, 100, (a,), generator=g).tolist() + [1]))
    return docs


def _loss(model, algo, batch, step=0):
    ctx = StepContext(step=step, seed=5, adapter=model.adapter)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    with torch.no_grad():
        return algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, batch.views[0]), 0)[0].item(), batch


def test_prompt_never_masked_and_only_masked_answers_are_targets():
    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, num_layers=1)
    algo = build_algorithm(SFTConfig())
    rows = pack_first_fit(_docs(6), 40)
    batch = sft_rows_batch(rows, list(range(len(rows))), 1, False)
    ctx = StepContext(step=1, seed=0, adapter=model.adapter)
    (view,) = algo.corrupt(ctx, batch, 0)
    noisy = view.input_ids == model.adapter.mask_token_id
    assert torch.equal(noisy, view.targets)
    assert not (noisy & ~batch["answer_mask"]).any()
    assert (view.weight[~view.targets] == 0).all()


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_packed_and_padded_rows_give_the_same_loss(family):
    tok = tiny_tokenizer()
    model = tiny(family, tokenizer=tok, num_layers=1, seed=2)
    algo = build_algorithm(SFTConfig())
    docs = _docs(5)
    packed = pack_first_fit(docs, 32)
    assert len(packed) < len(docs)
    lp, _ = _loss(model, algo, sft_rows_batch(packed, list(range(len(packed))), 1, False))
    ld, _ = _loss(model, algo, sft_rows_batch([[d] for d in docs], list(range(5)), 1, False))
    assert abs(lp - ld) < 1e-5, (lp, ld)


def test_t_one_loss_is_mean_answer_cross_entropy():
    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, num_layers=1, seed=4)
    algo = build_algorithm(SFTConfig(t_min=0.99999, weighting="uniform", normalize="answer_tokens"))
    docs = _docs(3, seed=3)
    batch = sft_rows_batch([[d] for d in docs], [0, 1, 2], 1, False)
    loss, batch = _loss(model, algo, batch)
    assert torch.equal(batch.views[0][0].targets, batch["answer_mask"])  # everything masked
    ids = batch["input_ids"].clone()
    ids[batch["answer_mask"]] = model.adapter.mask_token_id
    with torch.no_grad():
        logits = model(ids, layout=batch.views[0][0].layout).logits
    ce = F.cross_entropy(logits[batch["answer_mask"]], batch["input_ids"][batch["answer_mask"]])
    assert abs(loss - ce.item()) < 1e-5


def test_llada_recipe_normalises_per_answer_length_with_inverse_t():
    tok = tiny_tokenizer()
    model = tiny("llada", tokenizer=tok, num_layers=1, seed=4)
    algo = build_algorithm(SFTConfig())
    docs = _docs(3, seed=7)
    loss, batch = _loss(model, algo, sft_rows_batch([[d] for d in docs], [0, 1, 2], 1, False))
    view = batch.views[0][0]
    with torch.no_grad():
        logp = F.log_softmax(model(view.input_ids, layout=view.layout).logits.float(), -1)
    manual = 0.0
    for r, d in enumerate(docs):
        m = view.targets[r]
        t = view.info["t"][r, 0].item()
        ce = -logp[r][m].gather(1, batch["input_ids"][r][m][:, None]).sum().item()
        manual += ce / t / len(d.answer)
    assert abs(loss - manual / 3) < 1e-4


def test_llada2_time_range_and_uniform_weights():
    tok = tiny_tokenizer()
    model = tiny("llada2_moe", tokenizer=tok, num_layers=2)
    algo = build_algorithm(SFTConfig(t_min=0.3, t_max=0.8, weighting="uniform", normalize="masked_tokens"))
    batch = sft_rows_batch([[d] for d in _docs(8, seed=1)], list(range(8)), 1, False)
    (view,) = algo.corrupt(StepContext(step=0, seed=1, adapter=model.adapter), batch, 0)
    t = view.info["t"][:, 0]
    assert ((t >= 0.3) & (t <= 0.8)).all()
    assert torch.equal(view.weight, view.targets.float())
    L = batch["input_ids"].shape[1]
    assert view.input_ids.shape[1] == 2 * L  # [x_t ; x_0]
    assert torch.equal(view.input_ids[:, L:], batch["input_ids"])


def test_dream_cart_weights():
    from dare.diffusion import cart_weights
    tok = tiny_tokenizer()
    model = tiny("dream", tokenizer=tok, num_layers=1)
    algo = build_algorithm(SFTConfig(weighting="cart", normalize="answer_tokens"))
    docs = _docs(2, seed=9)
    batch = sft_rows_batch([[d] for d in docs], [0, 1], 1, False)
    (view,) = algo.corrupt(StepContext(step=0, seed=3, adapter=model.adapter), batch, 0)
    for r, d in enumerate(docs):
        m = view.targets[r, :len(d)]
        assert torch.allclose(view.weight[r, :len(d)], cart_weights(m, ~m, 0.3))


def test_block_nelbo_matches_sdar_reference_training_forward():
    t = torch.load(FIXTURES / "sdar-tiny" / "expected_logits.pt")["training"]
    model = load_model(FIXTURES / "sdar-tiny", mask_token_id=500)
    target = t["bd_target_mask"].bool()
    ids, layout = block_diffusion_inputs(t["bd_noisy_input_ids"], t["input_ids"], t["position_ids"])
    with torch.no_grad():
        logp, _ = score_targets(model, ids, target, t["input_ids"], layout=layout, chunk_size=5)
    token_loss = -logp[target] / t["bd_p_mask"][target]
    assert torch.allclose(token_loss, t["block_diffusion_token_loss"], atol=1e-4)
    answer_tokens = (t["labels"] != -100).sum()
    assert abs(token_loss.sum().item() / answer_tokens.item() - t["loss"].item()) < 1e-4


def _edit_views(edit_ratio, seed=2):
    tok = tiny_tokenizer()
    model = tiny("llada2_moe", tokenizer=tok, num_layers=1)
    algo = build_algorithm(SFTConfig(t_min=0.3, t_max=0.8, weighting="uniform", normalize="masked_tokens",
                                     edit_ratio=edit_ratio, edit_weight=0.5))
    batch = sft_rows_batch([[d] for d in _docs(8, seed=1)], list(range(8)), 1, False)
    (view,) = algo.corrupt(StepContext(step=0, seed=seed, adapter=model.adapter), batch, 0)
    return model, batch, view


def test_editing_stream_replaces_visible_answer_tokens_and_keeps_the_masks():
    model, batch, plain = _edit_views(0.0)
    _, _, view = _edit_views(0.4)
    L = batch["input_ids"].shape[1]
    mask_id = model.adapter.mask_token_id
    masked = plain.input_ids[:, :L] == mask_id
    assert torch.equal(view.input_ids[:, :L] == mask_id, masked)  # the drafting stream is mask-only SFT's
    clean = batch["input_ids"]
    edited = (view.input_ids[:, :L] != clean) & ~masked
    assert edited.any()
    assert not (edited & ~batch["answer_mask"]).any()  # prompts and padding are never edited
    assert not (view.input_ids[:, :L][edited] == mask_id).any()
    assert torch.equal(view.targets, masked | edited)
    assert torch.equal(view.weight, masked.float() + 0.5 * edited.float())
    assert torch.equal(view.input_ids[:, L:], clean)  # the clean half stays clean
    frac = edited.sum() / (batch["answer_mask"] & ~masked).sum()
    assert 0.2 < float(frac) < 0.6, frac


def test_editing_stream_off_is_mask_only_sft_bit_for_bit():
    _, _, a = _edit_views(0.0)
    tok = tiny_tokenizer()
    model = tiny("llada2_moe", tokenizer=tok, num_layers=1)
    algo = build_algorithm(SFTConfig(t_min=0.3, t_max=0.8, weighting="uniform", normalize="masked_tokens"))
    batch = sft_rows_batch([[d] for d in _docs(8, seed=1)], list(range(8)), 1, False)
    (b,) = algo.corrupt(StepContext(step=0, seed=2, adapter=model.adapter), batch, 0)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.weight, b.weight)


def _copy_docs(n, seed):
    g = torch.Generator().manual_seed(seed)
    docs = []
    for i in range(n):
        p = torch.randint(10, 40, (4,), generator=g).tolist()
        docs.append(SFTDoc(i, p, p + [1]))  # the answer repeats the prompt: a corrupted token is recoverable
    return docs


def _corrupted(docs, seed):
    """(clean answers [n, 5], the same with one answer token replaced by another token of the task's range)."""
    clean = torch.tensor([d.answer for d in docs])
    g = torch.Generator().manual_seed(seed)
    rows, cols = torch.arange(len(docs)), torch.randint(0, 4, (len(docs),), generator=g)
    noisy = clean.clone()
    noisy[rows, cols] = (clean[rows, cols] - 10 + torch.randint(1, 30, (len(docs),), generator=g)) % 30 + 10
    return clean, noisy


def _editing_decode_repairs(model, docs, seed, threshold=0.5):
    """The editing decode (LLaDA2.1's token-to-token rule, ``rollout.block._editing_block``) run on a block whose
    answer is already drafted with one wrong token: the fraction of answers it leaves exactly right."""
    from dare.rollout.block import BlockForward, _editing_block, build_block_state
    from dare.rollout.config import SamplerConfig
    from dare.rollout.selection import REMASKINGS
    from dare.rollout.state import make_prompt_batch
    clean, noisy = _corrupted(docs, seed)
    # one block of exactly prompt + answer (9 tokens): the attention the model was trained with (its block of 32
    # holds the whole 9-token sequence)
    cfg = SamplerConfig(gen_length=5, block_length=9, steps=5, temperature=0.0, threshold=0.9,
                        editing_threshold=threshold, max_post_steps=4, cache="none")
    pb = make_prompt_batch([d.prompt for d in docs], None, 1, torch.device("cpu"))
    st = build_block_state(pb, cfg, model.adapter.mask_token_id, 1, torch.tensor([1]), None, False)
    start = int(st.gen_start[0])
    assert (st.gen_start == start).all()
    st.x[:, start:start + 5] = noisy  # the draft: committed tokens, one of them wrong
    with torch.no_grad():
        _editing_block(BlockForward(model, st, cfg), st, cfg, REMASKINGS[cfg.remasking], st.active(), 0, 9)
    return float((st.x[:, start:start + 5] == clean).all(1).float().mean())


@pytest.mark.parametrize("edit_ratio,keep_weight,low,high", [
    (0.0, 0.0, None, 0.05),  # mask-only SFT never supervises a visible token: the wrong token stays (measured 0.00)
    pytest.param(0.3, 0.0, 0.3, None, marks=pytest.mark.integration),  # edits, but right tokens get rewritten too (0.44)
    (0.3, 1.0, 0.7, None),  # edits and keeps (measured 0.80)
])
def test_editing_stream_teaches_the_model_to_repair_wrong_tokens(edit_ratio, keep_weight, low, high):
    """A tiny LLaDA2 learns a copy task (the answer repeats the prompt) with SFT; then the editing decode is given
    answers drafted with one wrong token. Only a model trained with the editing stream repairs them."""
    tok = tiny_tokenizer()
    model = tiny("llada2_moe", tokenizer=tok, num_layers=2)
    algo = build_algorithm(SFTConfig(t_min=0.3, t_max=0.8, weighting="uniform", normalize="masked_tokens",
                                     edit_ratio=edit_ratio, keep_weight=keep_weight))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(200):  # ~8 s: a 2-layer model needs ~150 steps to learn to copy
        batch = sft_rows_batch([[d] for d in _copy_docs(16, seed=step)], list(range(16)), 1, False)
        ctx = StepContext(step=step, seed=0, adapter=model.adapter)
        stages.prepare(algo, ctx, batch, model)
        ctx.norms = algo.normalizers(batch)
        loss = algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, batch.views[0]), 0)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    rate = _editing_decode_repairs(model, _copy_docs(64, seed=10_000), seed=1)
    assert (low is None or rate > low) and (high is None or rate < high), rate


def test_keep_weight_scores_the_unchanged_visible_answer_tokens():
    tok = tiny_tokenizer()
    model = tiny("llada2_moe", tokenizer=tok, num_layers=1)
    batch = sft_rows_batch([[d] for d in _docs(8, seed=1)], list(range(8)), 1, False)
    views = []
    for keep in (0.0, 2.0):
        algo = build_algorithm(SFTConfig(t_min=0.3, t_max=0.8, weighting="uniform", normalize="masked_tokens",
                                         edit_ratio=0.4, edit_weight=0.5, keep_weight=keep))
        views.append(algo.corrupt(StepContext(step=0, seed=2, adapter=model.adapter), batch, 0)[0])
    L = batch["input_ids"].shape[1]
    assert torch.equal(views[0].input_ids, views[1].input_ids)  # keeping changes what is scored, not the input
    masked = views[0].input_ids[:, :L] == model.adapter.mask_token_id
    edited = (views[0].input_ids[:, :L] != batch["input_ids"]) & ~masked
    kept = batch["answer_mask"] & ~masked & ~edited
    assert torch.equal(views[1].targets, batch["answer_mask"])
    assert torch.equal(views[1].weight, masked.float() + 0.5 * edited.float() + 2.0 * kept.float())
    with pytest.raises(ValueError, match="needs edit_ratio > 0"):
        SFTConfig(keep_weight=1.0)


def test_complementary_pair_matches_fast_dllm_v2_reference_training_loss(monkeypatch):
    """Fast-dLLM v2's training objective (t_per_block + complementary, flat CE over the masked tokens of the pair):
    with the reference's own draws (one t per block of 32, then the token draws; tests/assets/fixtures/fastdllmv2-tiny,
    expected_loss.pt) SFT's corruption makes the reference's two masks and its loss equals the reference's."""
    import dare.algorithms.sft as sft
    r = torch.load(FIXTURES / "fastdllmv2-tiny" / "expected_loss.pt")
    model = load_model(FIXTURES / "fastdllmv2-tiny", mask_token_id=500)
    ids, labels, bs = r["input_ids"], r["labels"], r["block_size"]
    rows = []
    for i in range(ids.shape[0]):
        p = int((labels[i] == -100).sum())
        rows.append([SFTDoc(i, ids[i, :p].tolist(), ids[i, p:].tolist())])
    batch = sft_rows_batch(rows, [0, 1], 1, False)
    nb = ids.shape[1] // bs
    times = iter(r["t_draws"].tolist())  # row by row, block by block: the order corrupt() draws them in
    tokens = iter(r["token_draws"].view(ids.shape[0], -1))
    real_rand = torch.rand
    monkeypatch.setattr(sft, "sample_time", lambda g, lo, hi, eps: (1 - eps) * next(times) + eps)
    monkeypatch.setattr(torch, "rand", lambda n, generator=None: next(tokens) if n == ids.shape[1] else real_rand(n))
    algo = build_algorithm(SFTConfig(weighting="uniform", normalize="masked_tokens", t_per_block=True,
                                     complementary=True))
    ctx = StepContext(step=0, seed=0, adapter=model.adapter)
    stages.prepare(algo, ctx, batch, model)
    monkeypatch.undo()
    noisy, other = batch.views[0]
    t = (1 - r["eps"]) * r["t_draws"].view(-1, nb).repeat_interleave(bs, 1) + r["eps"]
    masked = (r["token_draws"].view(ids.shape[0], -1) < t) & (labels != -100)
    assert torch.equal(noisy.targets, masked) and torch.equal(other.targets, ~masked & (labels != -100))
    ctx.norms = algo.normalizers(batch)
    assert ctx.norms["masked_tokens"] == float((labels != -100).sum())  # the pair masks every answer token once
    with torch.no_grad():
        loss = algo.loss(ctx, batch, algo.log_likelihood(ctx, model, batch, batch.views[0]), 0)[0]
    assert abs(loss.item() - r["loss"].item()) < 1e-4, (loss.item(), r["loss"].item())


def test_per_block_times_and_complement_need_a_block_model():
    with pytest.raises(ValueError, match="complementary .* needs weighting uniform"):
        SFTConfig(complementary=True)
    algo = build_algorithm(SFTConfig(weighting="uniform", t_per_block=True))
    model = tiny("llada", tokenizer=tiny_tokenizer(), num_layers=1)
    batch = sft_rows_batch([[d] for d in _docs(2)], [0, 1], 1, False)
    with pytest.raises(ValueError, match="Fast-dLLM v2's training noise for block-diffusion models"):
        algo.corrupt(StepContext(step=0, seed=0, adapter=model.adapter), batch, 0)

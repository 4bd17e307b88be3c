import pytest
import torch
import torch.nn.functional as F

from dare.diffusion import linear_log_prob, score_targets
from dare.models import tiny, tiny_tokenizer


def test_chunked_log_prob_matches_dense_and_gradients():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    y = torch.randint(0, 50, (37,), generator=g)
    for temp in (1.0, 0.5):
        logp, ent = linear_log_prob(h, w, y, chunk_size=8, temperature=temp, with_entropy=True)
        ref = F.log_softmax((h @ w.T).float() / temp, -1)
        assert torch.allclose(logp, ref.gather(1, y[:, None]).squeeze(1), atol=1e-5)
        assert torch.allclose(ent, -(ref.exp() * ref).sum(-1), atol=1e-5)
    # Gradients of the hand-written chunked backward equal autograd through the dense computation.
    coef = torch.randn(37, generator=g)
    (linear_log_prob(h, w, y, chunk_size=8, temperature=0.7)[0] * coef).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    dense = F.log_softmax(h @ w.T / 0.7, -1).gather(1, y[:, None]).squeeze(1)
    (dense * coef).sum().backward()
    assert torch.allclose(gh, h.grad, atol=1e-5) and torch.allclose(gw, w.grad, atol=1e-5)


@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_score_targets_equals_full_logits(family):
    tok = tiny_tokenizer()
    model = tiny(family, tokenizer=tok, seed=3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 100, (2, 12), generator=g)
    targets = torch.zeros(2, 12, dtype=torch.bool)
    targets[:, 5:] = True
    labels = torch.randint(10, 100, (2, 12), generator=g)
    logp, _ = score_targets(model, ids, targets, labels, chunk_size=4)
    full = model.adapter.prediction_logits(model(ids).logits).float().log_softmax(-1)
    ref = full.gather(2, labels[..., None]).squeeze(-1) * targets
    assert torch.allclose(logp, ref, atol=1e-5)
    assert (logp[~targets] == 0).all()


def test_dream_target_k_reads_row_k_minus_one():
    tok = tiny_tokenizer()
    model = tiny("dream", tokenizer=tok, seed=1)
    ids = torch.randint(10, 100, (1, 10), generator=torch.Generator().manual_seed(2))
    targets = torch.zeros(1, 10, dtype=torch.bool)
    targets[0, 6] = True
    labels = ids.clone()
    logp, _ = score_targets(model, ids, targets, labels)
    raw = model(ids).logits.float().log_softmax(-1)
    assert torch.allclose(logp[0, 6], raw[0, 5, ids[0, 6]], atol=1e-6)
    assert not torch.allclose(logp[0, 6], raw[0, 6, ids[0, 6]], atol=1e-3)


def test_no_targets_still_backpropagates_to_the_hidden_states():
    # Under FSDP a rank whose micro-batch has no targets must still run backward through every layer.
    h = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(10, 4, requires_grad=True)
    rows = h[torch.zeros(0, dtype=torch.long)]
    logp, _ = linear_log_prob(rows, w, torch.zeros(0, dtype=torch.long))
    logp.sum().backward()
    assert h.grad is not None and w.grad is not None and h.grad.abs().sum() == 0

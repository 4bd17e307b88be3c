"""Hand-built RL batches for hook tests (the rollout engine has its own tests)."""
import torch

from dare.algorithms import RLBatch


def rl_batch(n_prompts=2, group=3, prompt_lens=(5, 8), gen_len=8, eos=1, seed=0, rewards=None):
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lens)
    B = n_prompts * group
    prompt = torch.full((B, P), eos, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.bool)
    comp = torch.randint(10, 100, (B, gen_len), generator=g)
    cmask = torch.ones(B, gen_len, dtype=torch.bool)
    for i in range(B):
        n = prompt_lens[(i // group) % len(prompt_lens)]
        prompt[i, P - n:] = torch.randint(10, 100, (n,), generator=torch.Generator().manual_seed(1000 + i // group))
        pmask[i, P - n:] = True
        stop = int(torch.randint(2, gen_len + 1, (1,), generator=g))
        if stop < gen_len:
            comp[i, stop:] = eos
            cmask[i, stop + 1:] = False
    if rewards is None:
        rewards = torch.randint(0, 2, (B,), generator=g).float()
    return RLBatch(uid=torch.arange(B), group=torch.arange(B) // group, prompt_ids=prompt, prompt_mask=pmask,
                 completion_ids=comp, completion_mask=cmask, rewards=rewards)


def corrupt(algo, ctx, batch, iteration=0):
    """The views of ``iteration`` as the prepare stage draws them: the method's ``prepare`` state first (a replay
    plan, MDPO's steps, JustGRPO's targets), then ``corrupt``."""
    state = algo.prepare(ctx, batch)
    if state is not None:
        batch.state = state
    return algo.corrupt(ctx, batch, iteration)


def is_block_family(family: str) -> bool:
    """Whether a registered family is a block-diffusion model (block-causal attention), from the family registry."""
    from dare.algorithms.matrix import family_attention
    return family_attention()[family] == "block_causal"


def supported_families(algorithm: str, fast: tuple[str, ...]) -> list:
    """pytest params: every registered family whose attention kind ``algorithm`` supports (registry order), those not
    in ``fast`` in the integration tier -- so a new family joins a method's end-to-end test without editing it."""
    import pytest

    from dare.algorithms import get_algorithm, load_builtin_algorithms
    from dare.algorithms.matrix import families_of
    load_builtin_algorithms()
    return [pytest.param(f, marks=() if f in fast else pytest.mark.integration)
            for f in families_of(get_algorithm(algorithm).supports)]


def learning_families(algorithm: str) -> list[str]:
    """A learning claim's families: the first registered family of each attention kind ``algorithm`` supports
    (CONTRIBUTING.md, "Test tiers": a method learns on one family per kind; every family trains its two steps in the
    matrix and the end-to-end tests)."""
    from dare.algorithms import get_algorithm, load_builtin_algorithms
    from dare.algorithms.matrix import families_of
    load_builtin_algorithms()
    return [families_of((kind,))[0] for kind in get_algorithm(algorithm).supports if families_of((kind,))]


def plain_services(**fields):
    """``ctx.services`` as a one-process trainer lends them for hooks that decode (``generate`` with no weights to
    gather), with ``fields`` (the sampler, the reward) set by the test."""
    import contextlib

    from dare.algorithms import Services
    from dare.rollout import generate

    def decode(model, prompt_tokens, sampler, n, seeds, attention_mask=None, record=None):
        return generate(model, prompt_tokens, sampler, n=n, seeds=seeds, attention_mask=attention_mask, record=record)
    return Services(generate=decode, gathered=lambda model: contextlib.nullcontext(), **fields)

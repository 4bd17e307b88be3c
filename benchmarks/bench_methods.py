"""Cost of two RL methods against their naive constructions, measured side by side in one run (Markdown table).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_methods.py            # full sizes (a few minutes, 2 cores)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_methods.py --quick    # smaller sizes (smoke run)
    ... --part justgrpo | --part tree    # one table;  --reps N: timed repetitions (default 3);  --json FILE: raw numbers

Results and what they mean: benchmarks/methods.md.

1. JustGRPO's exact AR log-likelihood of a micro-batch of completions. *Naive* is the reference's (and the original
   DARE port's) construction: one forward per completion position t over all rows, ``[prompt ; y_<t ; MASK...]``
   (block models: the sampler's own input ``[prompt ; y_<t ; MASK]`` under causal attention). *dare* stacks the
   states of all positions and rows, skipping the positions the sampler never wrote (bidirectional models), or
   reads every conditional from one ``[x_t ; x_0]`` pass with block size 1 (block models). Both score the same
   tokens; the table reports the largest difference between them. Timed: scoring (no grad) and the update's
   forward + backward.
2. d-TreeRPO's tree rollout (``generate_tree``) against the same number of independent rollouts (one batched
   ``generate`` call with n = leaves per prompt): batched model calls, sequence-forwards (rows x calls), tokens fed
   to the model and wall time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Counter:
    """Model calls, sequence-forwards (rows) and tokens (rows x length) through a forward pre-hook."""

    def __init__(self, model):
        self.calls = self.rows = self.tokens = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        self.calls += 1
        self.rows += ids.shape[0]
        self.tokens += ids.numel()

    def reset(self):
        self.calls = self.rows = self.tokens = 0

    def snapshot(self) -> dict:
        return {"calls": self.calls, "rows": self.rows, "tokens": self.tokens}


def _interleaved_times(fns: dict, reps: int) -> dict:
    """Seconds of each function per repetition, the variants run in turn (A, B, A, B, ...) so load spikes hit both."""
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def _model(family: str, quick: bool):
    from dare.models import tiny, tiny_tokenizer
    model = tiny(family, tokenizer=tiny_tokenizer(), seed=0, hidden_size=128, num_layers=2 if quick else 4, num_heads=4,
                 intermediate_size=256)
    if model.adapter.is_block_causal:
        model.adapter.block_size = 4
    return model


# ----------------------------------------------------------------------------------------------------------
# 1. JustGRPO
# ----------------------------------------------------------------------------------------------------------
def _rl_batch(model, B: int, prompt_lens, Lc: int, seed: int):
    """Completions of B rows; half of them stop early and (block_stop) are never decoded after their stop."""
    from dare.algorithms.batch import RLBatch
    g = torch.Generator().manual_seed(seed)
    eos = model.adapter.eos_token_id
    P = max(prompt_lens)
    prompt = torch.full((B, P), eos, dtype=torch.long)
    pmask = torch.zeros(B, P, dtype=torch.bool)
    comp = torch.randint(10, 100, (B, Lc), generator=g)
    step_map = torch.arange(Lc).expand(B, Lc).clone()
    for i in range(B):
        n = prompt_lens[i % len(prompt_lens)]
        prompt[i, P - n:] = torch.randint(10, 100, (n,), generator=g)
        pmask[i, P - n:] = True
        if i % 2:
            stop = int(torch.randint(Lc // 2, Lc, (1,), generator=g))
            comp[i, stop:] = eos
            step_map[i, stop + 1:] = -1
    cmask = torch.ones(B, Lc, dtype=torch.bool)
    for i in range(B):
        hit = (comp[i] == eos).nonzero()
        if hit.numel():
            cmask[i, int(hit[0]) + 1:] = False
    rewards = torch.rand(B, generator=g)
    return RLBatch(uid=torch.arange(B), group=torch.arange(B) // 4, prompt_ids=prompt, prompt_mask=pmask,
                 completion_ids=comp, completion_mask=cmask, step_map=step_map, rewards=rewards)


def naive_ar_logp(model, batch, temperature: float = 1.0, grad: bool = False):
    """The reference construction: for every position t one forward of all rows; returns (logp [B, Lc], loss-ready)."""
    from dare.diffusion.logprob import score_targets
    from dare.models import masks
    comp, prompt, pmask = batch.completion_ids, batch.prompt_ids, batch.prompt_mask
    B, Lc = comp.shape
    P = prompt.shape[1]
    mask_id = model.adapter.mask_token_id
    block = model.adapter.is_block_causal
    out = []
    for t in range(Lc):
        if block:  # the sampler's input at step t: [prompt ; y_<t ; MASK], causal (blocks of one token)
            ids = torch.cat([prompt, comp[:, :t], torch.full((B, 1), mask_id)], 1)
            valid = torch.cat([pmask, torch.ones(B, t + 1, dtype=torch.bool)], 1)
            pos = masks.positions_from_padding(valid)
            lay = masks.TokenLayout.plain(pos, valid)
            kw = dict(attention_mask=masks.dense_mask(lay, lay, 1), position_ids=pos)
        else:
            ids = torch.cat([prompt, comp[:, :t], torch.full((B, Lc - t), mask_id)], 1)
            kw = dict(attention_mask=torch.cat([pmask, torch.ones(B, Lc, dtype=torch.bool)], 1))
        tgt = torch.zeros(ids.shape, dtype=torch.bool)
        tgt[:, P + t] = True
        labels = ids.clone()
        labels[:, P + t] = comp[:, t]
        with torch.set_grad_enabled(grad):
            lp, _ = score_targets(model, ids, tgt, labels, temperature=temperature, **kw)
        if grad:  # the reference back-propagates every position's term as it goes
            (lp[:, P + t].sum() * 1e-3).backward()
            lp = lp.detach()
        out.append(lp[:, P + t])
    return torch.stack(out, 1)


def bench_justgrpo(family: str, quick: bool, reps: int) -> dict:
    from dare.algorithms import StepContext, build_algorithm
    from dare.algorithms.justgrpo import JustGRPOConfig
    from dare.trainer import stages
    model = _model(family, quick)
    B, Lc = (8, 32) if quick else (8, 64)
    batch = _rl_batch(model, B, (24, 40), Lc, seed=0)
    algo = build_algorithm(JustGRPOConfig(tokens_per_forward=8192))
    ctx = StepContext(step=0, seed=0, adapter=model.adapter)
    batch.advantages = algo.advantages(ctx, batch)
    stages.prepare(algo, ctx, batch, model)
    ctx.norms = algo.normalizers(batch)
    views = batch.views[0]
    counter = Counter(model)
    res = {"family": family, "rows": B, "gen_length": Lc, "scored": int(batch.state.targets.sum())}

    def ours_score():
        with torch.no_grad():
            return algo.log_likelihood(ctx, model, batch, views).value

    def naive_score():
        with torch.no_grad():
            return naive_ar_logp(model, batch)

    def ours_update():
        model.zero_grad()
        algo.backward(ctx, model, batch, 0)

    def naive_update():
        model.zero_grad()
        naive_ar_logp(model, batch, grad=True)

    for name, fn in (("naive", naive_score), ("dare", ours_score)):
        counter.reset()
        value = fn()
        res[name] = {**counter.snapshot(), "value": value}
    tgt = batch.state.targets
    res["max_abs_diff"] = float((res["naive"].pop("value") - res["dare"].pop("value"))[tgt].abs().max())
    for key, fns in (("score_s", {"naive": naive_score, "dare": ours_score}),
                     ("update_s", {"naive": naive_update, "dare": ours_update})):
        for name, t in _interleaved_times(fns, reps).items():
            res[name][key], res[name][key + "_all"] = statistics.median(t), t
    counter.handle.remove()
    res["score_speedup"] = res["naive"]["score_s"] / res["dare"]["score_s"]
    res["update_speedup"] = res["naive"]["update_s"] / res["dare"]["update_s"]
    return res


# ----------------------------------------------------------------------------------------------------------
# 2. d-TreeRPO
# ----------------------------------------------------------------------------------------------------------
def bench_tree(family: str, branching: list[int], quick: bool, cache: str, reps: int) -> dict:
    from dare.models import tiny_tokenizer
    from dare.rollout import SamplerConfig, generate, generate_tree
    model = _model(family, quick)
    tok = tiny_tokenizer()
    G = 16 if quick else 32
    kw = dict(steps_per_block=4, block_length=4) if model.adapter.is_block_causal else dict(steps=G, block_length=8)
    sampler = SamplerConfig(gen_length=G, temperature=0.9, cache=cache, block_stop=False, **kw)
    prompts = [tok.encode(p) for p in ("what is 12 + 30?", "solve the sudoku", "count down from 9", "hello")]
    seeds = list(range(len(prompts)))
    levels = len(branching)
    from dare.rollout import steps_per_block
    total = steps_per_block(model, sampler) * (G // sampler.block_length)
    cuts = [int(k * total / levels) for k in range(1, levels)]
    leaves = 1
    for b in branching:
        leaves *= b
    counter = Counter(model)
    res = {"family": family, "cache": cache, "branching": branching, "cuts": cuts, "gen_length": G,
           "prompts": len(prompts), "leaves": leaves}
    runs = (("independent", lambda: generate(model, prompts, sampler, n=leaves, seeds=seeds).nfe),
            ("tree", lambda: generate_tree(model, prompts, sampler, branching, cuts, seeds=seeds).nfe))
    for name, fn in runs:
        counter.reset()
        nfe = fn()
        res[name] = {**counter.snapshot(), "nfe": nfe}
    for name, t in _interleaved_times(dict(runs), reps).items():
        res[name]["time_s"], res[name]["time_s_all"] = statistics.median(t), t
    counter.handle.remove()
    res["row_ratio"] = res["independent"]["rows"] / res["tree"]["rows"]
    res["token_ratio"] = res["independent"]["tokens"] / res["tree"]["tokens"]
    res["speedup"] = res["independent"]["time_s"] / res["tree"]["time_s"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write the raw numbers here")
    ap.add_argument("--part", choices=("all", "justgrpo", "tree"), default="all")
    ap.add_argument("--reps", type=int, help="timed repetitions per variant, interleaved (default 3; --quick: 1)")
    args = ap.parse_args(argv)
    reps = args.reps or (1 if args.quick else 3)
    torch.set_num_threads(1)
    jg = [bench_justgrpo(f, args.quick, reps) for f in ("llada", "sdar")] if args.part in ("all", "justgrpo") else []
    trees = ([bench_tree(family, branching, args.quick, cache, reps)
              for family, branching, cache in (("llada", [4, 4], "none"), ("llada", [4, 4], "dual"),
                                               ("llada", [2, 2, 2], "none"), ("sdar", [4, 4], "block"),
                                               ("sdar", [2, 2, 2], "block"))]
             if args.part in ("all", "tree") else [])
    if jg:
        print_justgrpo(jg)
    if trees:
        print_trees(trees)
    if args.json:
        Path(args.json).write_text(json.dumps({"justgrpo": jg, "tree": trees}, indent=2))
    return 0


def print_justgrpo(jg: list) -> None:
    print("| JustGRPO AR log-likelihood | naive: forwards / tokens | dare: forwards / tokens | scoring time "
          "naive / dare | update (fwd+bwd) time naive / dare | max diff |")
    print("|---|---|---|---|---|---|")
    for r in jg:
        n, d = r["naive"], r["dare"]
        print(f"| {r['family']}, {r['rows']} rows x {r['gen_length']} tokens ({r['scored']} scored) | {n['calls']} / "
              f"{n['tokens']} | {d['calls']} / {d['tokens']} | {n['score_s']:.2f} s / {d['score_s']:.2f} s = "
              f"{r['score_speedup']:.1f}x | {n['update_s']:.2f} s / {d['update_s']:.2f} s = {r['update_speedup']:.1f}x "
              f"| {r['max_abs_diff']:.1e} |")
    print()


def print_trees(trees: list) -> None:
    print("| d-TreeRPO rollout | independent: calls / seq-forwards / tokens | tree: calls / seq-forwards / tokens | "
          "seq-forwards ratio | tokens ratio | time independent / tree |")
    print("|---|---|---|---|---|---|")
    for r in trees:
        i, t = r["independent"], r["tree"]
        print(f"| {r['family']} ({r['cache']} cache), branching {'x'.join(map(str, r['branching']))} = {r['leaves']} leaves "
              f"per prompt, cuts at {r['cuts']}, gen {r['gen_length']} | {i['calls']} / {i['rows']} / {i['tokens']} | "
              f"{t['calls']} / {t['rows']} / {t['tokens']} | {r['row_ratio']:.2f}x | {r['token_ratio']:.2f}x | "
              f"{i['time_s']:.2f} s / {t['time_s']:.2f} s = {r['speedup']:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())

"""Run by torchrun (2 ranks) from test_sequence_parallel.py: score_targets sequence-parallel (SP = 2) against the
same call on one rank (SP = 1), for each family named on the command line, on three or four input shapes. Each rank
writes ``rank<r>.jsonl`` into the folder given first: one line per (family, case, dtype) with the largest log-prob
and gradient differences."""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dare.diffusion.logprob import score_targets
from dare.models import tiny
from dare.models import sequence_parallel as S
from dare.trainer.distributed import close_process_group


def _cases(model, gen: torch.Generator):
    """(name, input_ids, targets, labels, keyword arguments): an odd length (padding path), left padding through a
    2-D mask, a packed row of two documents, and for block-diffusion families the [x_t ; x_0] layout."""
    V = model.arch.vocab_size
    ids = torch.randint(0, V, (2, 11), generator=gen)
    targets = torch.rand(2, 11, generator=gen) < 0.5
    targets[:, 0] = False  # Dream's shift: position 0 is predicted by no row
    labels = torch.randint(0, V, (2, 11), generator=gen)
    yield "odd_length", ids, targets, labels, {}
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    yield "left_padded", ids, targets & mask.bool(), labels, {"attention_mask": mask}
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(2, 12)
    packed_t = torch.rand(2, 12, generator=gen) < 0.5
    packed_t[:, [0, 5]] = False
    yield ("packed", torch.randint(0, V, (2, 12), generator=gen), packed_t, torch.randint(0, V, (2, 12), generator=gen),
           {"layout": model.adapter.packed_layout(pos)})
    if model.adapter.attn_block_size is not None:
        pos = torch.arange(10).expand(2, 10)
        both = torch.randint(0, V, (2, 20), generator=gen)
        t = torch.rand(2, 10, generator=gen) < 0.5
        yield "x_t_x_0", both, t, torch.randint(0, V, (2, 10), generator=gen), {"layout": model.adapter.block_diffusion_layout(pos)}


def _canvas_cases(model, gen: torch.Generator):
    """DiffusionGemma's inputs: an RL view ``[left-padded prompt ; clean blocks ; canvas]`` (7 prompt positions,
    a 10-token completion in canvases of 4: an encoder part of 15 and a canvas of 10) and packed SFT rows of two
    documents with self-conditioning on one row (encoder 13, canvas of the answers)."""
    from dare.algorithms.common.views import prompt_completion_view
    from dare.diffusion.uniform import packed_canvas_view
    V, C = model.arch.vocab_size, model.adapter.block_size
    prompt = torch.randint(0, V, (2, 7), generator=gen)
    pmask = torch.ones(2, 7, dtype=torch.long)
    pmask[1, :2] = 0
    completion = torch.randint(0, V, (2, 10), generator=gen)
    noisy = torch.where(torch.rand(2, 10, generator=gen) < 0.5, torch.randint(0, V, (2, 10), generator=gen), completion)
    view = prompt_completion_view(prompt, pmask, completion, noisy, torch.rand(2, 10, generator=gen) < 0.7,
                                  canvas_length=C)
    yield "rl_view", view.input_ids, view.targets, view.labels, {"layout": view.layout}
    ids = torch.randint(0, V, (2, 13), generator=gen)
    pos = torch.cat([torch.arange(6), torch.arange(7)]).expand(2, 13).contiguous()
    docs = torch.cat([torch.zeros(6, dtype=torch.long), torch.ones(7, dtype=torch.long)]).expand(2, 13).contiguous()
    answer = (pos >= 3)
    noisy_rows = torch.where(torch.rand(2, 13, generator=gen) < 0.5, torch.randint(0, V, (2, 13), generator=gen), ids)
    inputs, targets, labels, _, layout = packed_canvas_view(ids, pos, docs, answer, noisy_rows, answer.float(), C,
                                                            self_condition=torch.tensor([True, False]))
    yield "sft_packed_self_conditioned", inputs, targets, labels, {"layout": layout}


def _score(model, ids, targets, labels, kwargs, sp):
    model.zero_grad(set_to_none=True)
    with S.sharding_sequences(sp):
        logp, _ = score_targets(model, ids, targets, labels, **kwargs)
    (logp * torch.linspace(0.5, 1.5, logp.numel()).view_as(logp)).sum().backward()  # weights: no symmetric cancelling
    return logp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def main(out: Path, families: list[str]) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    lines = []
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "sp"))
    sp = S.SequenceGroup(mesh.get_group("sp"), 2, rank)
    for spec in families:
        family, _, kv = spec.partition(":")  # "sdar:1": one key/value head (repeated to the query heads)
        for dtype in (torch.float64, torch.float32):
            model = tiny(family, seed=0, dtype=dtype, **({"num_kv_heads": int(kv)} if kv else {}))
            cases = _canvas_cases if model.adapter.is_encoder_decoder else _cases
            for case, ids, targets, labels, kwargs in cases(model, torch.Generator().manual_seed(1)):
                one, grads_one = _score(model, ids, targets, labels, kwargs, None)
                two, grads_two = _score(model, ids, targets, labels, kwargs, sp)
                # Each rank holds the gradient of its share; their mean is what FSDP's reduce-scatter gives. A MoE
                # expert that got no token on a rank has no gradient there (zeros), so every rank reduces the same set.
                grad_diff, grad_scale = 0.0, 0.0
                for name, g in grads_one.items():
                    mine = grads_two.get(name, torch.zeros_like(g)).clone()
                    dist.all_reduce(mine)
                    grad_diff = max(grad_diff, (g - mine / 2).abs().max().item())
                    grad_scale = max(grad_scale, g.abs().max().item())
                lines.append(json.dumps({"rank": rank, "family": spec, "case": case, "dtype": str(dtype).split(".")[1],
                                  "targets": int(targets.sum()), "logp_diff": (one - two).abs().max().item(),
                                  "grad_diff": grad_diff, "grad_scale": grad_scale}))
    (out / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    close_process_group()  # every rank done talking before gloo's pairs go (dare.trainer.distributed)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])

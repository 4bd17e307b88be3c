"""Run by torchrun (2 ranks) from test_fsdp_rollout.py: threshold decoding under FSDP2, rank-dependent prompts."""
import sys

import torch
import torch.distributed as dist

from dare.models import tiny
from dare.rollout import SamplerConfig, generate
from dare.collectives import gathered_for_inference
from dare.trainer.distributed import close_process_group


def main(gathered: bool) -> None:  # gathered=False reproduces the failure (hang or crash)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny("llada", seed=0, std=0.15)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked predictions, so threshold decoding commits several tokens per step
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(100 + rank)
    prompts = [torch.randint(3, 100, (5 + rank,), generator=gen).tolist()]
    cfg = SamplerConfig(gen_length=32, block_length=8, steps=32, threshold=0.5)
    with torch.no_grad():
        if gathered:
            with gathered_for_inference(model):
                out = generate(model, prompts, cfg)
        else:
            out = generate(model, prompts, cfg)
    # Training still works after the phase (parameters resharded, collectives back in every forward).
    model(torch.tensor([prompts[0]])).logits.float().pow(2).mean().backward()
    print(f"rank {rank} nfe {out.nfe}", flush=True)
    # Meet before tearing gloo down, as DistEnv.close(sync=True) does after a finished run: a rank destroying its
    # pairs while the peer still talks aborts the peer ("terminate called without an active exception", seen in CI).
    close_process_group()


if __name__ == "__main__":
    main(gathered=sys.argv[1] == "gathered")

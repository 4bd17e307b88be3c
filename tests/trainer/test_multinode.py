"""Slow: a run over two "machines" — two torchrun agents on 127.0.0.1 that meet by c10d rendezvous, as two nodes of
a cluster would (docs/training.md, "Several machines") — trains exactly as one process does, with FSDP2 over all
processes and with hybrid sharding (shard within a node, replicate across nodes)."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.trainer.helpers import ROOT, TOY_SFT
from tests.trainer.test_multiprocess import COMMON, _env, _metrics, _train


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(out, recipe, *overrides, nproc=1, sharding="full", timeout=600):
    """Start `dare train` twice, as the same command on two nodes would be started, and wait for both."""
    data = [f"data.pairs={TOY_SFT}"] if "sft" in recipe else []
    cmd = [sys.executable, "-m", "dare.cli", "train", recipe, *COMMON, *data, f"train.output_dir={out}", *overrides,
           "distributed.nnodes=2", f"distributed.nproc={nproc}", f"distributed.rdzv_endpoint=127.0.0.1:{_free_port()}",
           f"distributed.rdzv_id=test-{out.name}"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for _ in range(2)]
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=timeout)[1])
    finally:
        for p in procs:  # each agent leads a session of its own: take its torchrun workers with it
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p, err in zip(procs, errs):
        assert p.returncode == 0, err[-3000:]
    # rank 0 (on one of the two agents) says what it joined
    assert sum(f"{2 * nproc} processes on 2 node(s), {sharding} sharding" in err for err in errs) == 1, errs
    return _metrics(out)


def _same(one, many, keys):
    assert len(one) == len(many) > 0
    for a, b in zip(one, many):
        for key in keys:
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (key, a, b)


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("sharding,nproc", [("full", 1), ("hybrid", 2)])
def test_sft_on_two_nodes_equals_one_process(tmp_path, sharding, nproc):
    args = ["model.path=tiny:llada", "train.steps=3", "train.batch_size=8", "train.micro_batch_size=1",
            f"distributed.sharding={sharding}"]
    one = _train(tmp_path / "one", *args)
    nodes = _two_nodes(tmp_path / "nodes", "recipes/sft_tiny.yaml", *args, nproc=nproc, sharding=sharding)
    _same(one, nodes, ("loss", "grad_norm", "masked_frac"))


@pytest.mark.integration
@pytest.mark.multiprocess
def test_rl_on_two_nodes_with_hybrid_sharding_equals_one_process(tmp_path):
    args = ["train.steps=2", "algorithm.inner_iterations=2", "reward.workers=0", "model.dtype=float64",
            "rollout.sampler={gen_length: 8, block_length: 8, steps: 8, temperature: 1.0}", "distributed.sharding=hybrid"]
    one = _train(tmp_path / "one", *args, recipe="recipes/d1_tiny.yaml")
    nodes = _two_nodes(tmp_path / "nodes", "recipes/d1_tiny.yaml", *args, sharding="hybrid")
    assert [a["completion_len"] for a in one] == [b["completion_len"] for b in nodes]
    _same(one, nodes, ("loss", "kl", "entropy", "grad_norm", "ratio_mean"))


def test_launch_command_for_one_and_several_nodes():
    from dare.trainer.distributed import torchrun_command
    one = torchrun_command(4, ["train", "r.yaml"])
    assert "--standalone" in one and "--nproc_per_node=4" in one and one[-2:] == ["train", "r.yaml"]
    many = torchrun_command(8, ["train", "r.yaml"], nnodes=2, rdzv_endpoint="node-0:29500", rdzv_id="job7")
    assert "--standalone" not in many
    assert {"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node-0:29500", "--rdzv_id=job7",
            "--nproc_per_node=8"} <= set(many)


def test_several_nodes_need_a_rendezvous_point():
    from dare.trainer.recipe import load_recipe
    with pytest.raises(ValueError, match="rdzv_endpoint"):
        load_recipe(ROOT / "recipes/sft_tiny.yaml", ["distributed.nnodes=2"])
    with pytest.raises(ValueError, match="sharding"):
        load_recipe(ROOT / "recipes/sft_tiny.yaml", ["distributed.sharding=hsdp"])


def test_hybrid_mesh_replicates_across_nodes_and_shards_within_one():
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dare.trainer.distributed import DistEnv, device_mesh
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    try:
        mesh = device_mesh(DistEnv(0, 16, 0, torch.device("cpu"), "fake", local_world_size=8), "hybrid")
        assert mesh.shape == (2, 8) and mesh.mesh_dim_names == ("replicate", "shard")
        assert device_mesh(DistEnv(0, 16, 0, torch.device("cpu"), "fake", local_world_size=8), "full").shape == (16,)
        with pytest.raises(ValueError, match="do not split"):
            DistEnv(0, 16, 0, torch.device("cpu"), "fake", local_world_size=6).nodes
    finally:
        dist.destroy_process_group()

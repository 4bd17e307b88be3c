"""Slow: a run over two "machines" — two torchrun agents on 127.0.0.1 that meet by c10d rendezvous, as two nodes of
a cluster would (docs/training.md, "Several machines") — trains exactly as one process does, with FSDP2 over all
processes and with hybrid sharding (shard within a node, replicate across nodes)."""
import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.trainer.helpers import ROOT
from tests.trainer.test_multiprocess import COMMON, _env, _metrics
from tests.trainer.two_processes import CASES as TWO_CASES, same_history


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(out, recipe, *overrides, nproc=1, sharding="full", timeout=600):
    """Start `dare train` twice, as the same command on two nodes would be started, and wait for both."""
    cmd = [sys.executable, "-m", "dare.cli", "train", recipe, *COMMON, f"train.output_dir={out}", *overrides,
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


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case,sharding,nproc", [("sft_llada", "full", 1), ("sft_llada", "hybrid", 2)])
def test_sft_on_two_nodes_equals_one_process(tmp_path, two_process_runs, case, sharding, nproc):
    """The one-process side of a shared two-process case (tests/trainer/two_processes.py) is the reference."""
    one, _ = two_process_runs(case)
    c = TWO_CASES[case]
    nodes = _two_nodes(tmp_path / "nodes", c.recipe, *c.overrides, f"distributed.sharding={sharding}", nproc=nproc,
                       sharding=sharding)
    assert len(nodes) == 3
    same_history(one.metrics, nodes, ("loss", "grad_norm", "masked_frac"))


@pytest.mark.integration
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["d1_llada"])
def test_rl_on_two_nodes_with_hybrid_sharding_equals_one_process(tmp_path, two_process_runs, case):
    one, _ = two_process_runs(case)
    c = TWO_CASES[case]
    nodes = _two_nodes(tmp_path / "nodes", c.recipe, *c.overrides, "distributed.sharding=hybrid", sharding="hybrid")
    assert [a["completion_len"] for a in one.metrics] == [b["completion_len"] for b in nodes]
    same_history(one.metrics, nodes, ("loss", "kl", "entropy", "grad_norm", "ratio_mean"))


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

"""Leaving the process group: the race behind a `torchrun` training that wrote its model and
never exited. Two ranks take a gloo group up and down round after round, each round a DDP
backward and an all-reduce, then the teardown under test. Run as a script, this file is one
rank: `python -m tests.integration.test_ddp_teardown ORDER RANK ROUNDS STORE_DIR`."""

from __future__ import annotations

import faulthandler
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.conftest import REPO, env

pytestmark = pytest.mark.slow

ROUND_TIMEOUT_S = 10  # a round takes about 0.1 s; a rank stuck this long has hung


def _rounds_before_a_hang(order: str, rounds: int, store_dir: Path) -> int:
    """Rounds both ranks finished before the first hang (`rounds`: none hung)."""
    store_dir.mkdir()
    cmd = [sys.executable, "-m", "tests.integration.test_ddp_teardown", order]
    procs = [
        subprocess.Popen(
            [*cmd, str(rank), str(rounds), str(store_dir)],
            cwd=REPO,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    finished = []
    for proc in procs:
        out, err = proc.communicate(timeout=rounds + 3 * ROUND_TIMEOUT_S)
        finished.append(len(out.split()))
        assert proc.returncode == 0 or "Timeout" in err, err[-2000:]  # a hang, not a crash
    return min(finished)


def test_ranks_leave_the_process_group_without_hanging(tmp_path):
    # The fixture can fail: barrier, destroy, then free DDP (the order training used) leaves
    # the barrier's work to a gloo worker thread, which then needs the GIL that this thread
    # holds while joining it. It hangs within a few dozen rounds (3 runs of 3 on 2 cores).
    assert _rounds_before_a_hang("plain", 1000, tmp_path / "plain") < 1000
    assert _rounds_before_a_hang("lmops", 200, tmp_path / "lmops") == 200


def _rank(order: str, rank: int, rounds: int, store_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from lmops.pipeline.train import leave_distributed

    torch.manual_seed(rank)
    for i in range(rounds):
        faulthandler.dump_traceback_later(ROUND_TIMEOUT_S, exit=True)  # a hang: stacks, then exit 1
        store = dist.FileStore(f"{store_dir}/{i}", 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        model = torch.nn.Linear(64, 64)
        run = types.SimpleNamespace(model=model, forward=DistributedDataParallel(model))
        run.forward(torch.randn(8, 64)).sum().backward()
        dist.all_reduce(torch.ones(1))
        if order == "lmops":
            leave_distributed(run)
        else:
            dist.barrier()
            dist.destroy_process_group()
        del run  # the plain order: DDP, and with it the group, freed here
        print(i, flush=True)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    _rank(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

"""LLTMCell under DistributedDataParallel (gloo, two CPU processes on loopback): the gradients
equal those of one process on the same global batch."""
from __future__ import annotations

import datetime
import os

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install .[torch])")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import lltm_cupy.torch as lt  # noqa: E402

WORLD = 2
FEATURES, STATE, BATCH, STEPS = 5, 7, 8, 3


def make_model_and_data():
    torch.manual_seed(0)
    model = lt.LLTMCell(FEATURES, STATE, dtype=torch.float64)
    xs = torch.randn(STEPS, BATCH, FEATURES, dtype=torch.float64)
    target = torch.randn(BATCH, STATE, dtype=torch.float64)
    return model, xs, target


def loss_fn(model, xs, target):
    state = None
    for x in xs:
        state = model(x, state)
    h, c = state
    return ((h - target) ** 2).mean() + c.pow(2).mean()


def worker(rank, port, out_dir):
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    try:
        model, xs, target = make_model_and_data()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        loss_fn(ddp, xs[:, shard], target[shard]).backward()  # DDP averages over ranks
        torch.save({n: p.grad for n, p in model.named_parameters()}, f"{out_dir}/grads{rank}.pt")
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's finalization: gloo's worker threads can still be torn down
    # there, which aborts the process now and then (SIGABRT, "terminate called without an active
    # exception") after the work is done and saved. A failure of the work itself still shows: an
    # exception above, or a missing gradient file.
    os._exit(0)


def test_ddp_gradients_equal_single_process(tmp_path):
    # The rendezvous store is served from this process on a port the system picks when it
    # binds it (port 0) and holds from then on: no other process (another pytest-xdist worker,
    # another run on the machine) can take it between its choice and its use, as it could
    # when a port found free was closed and bound again by rank 0.
    store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    mp.start_processes(worker, args=(store.port, str(tmp_path)), nprocs=WORLD, join=True,
                       start_method="spawn")
    del store
    model, xs, target = make_model_and_data()
    loss_fn(model, xs, target).backward()
    for rank in range(WORLD):
        grads = torch.load(tmp_path / f"grads{rank}.pt")
        assert set(grads) == {"weights", "bias"}
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"rank {rank} {name}: {m}")

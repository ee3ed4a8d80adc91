"""Data-parallel training: the same trainer on one CPU, one GPU, or N processes under torchrun.

`torchrun --nproc-per-node N -m dflash2.cli.train ...` sets RANK / WORLD_SIZE / LOCAL_RANK; we join
the process group (NCCL on GPUs, gloo on CPUs) and wrap the per-step loss in torch's DDP, which
averages gradients across ranks during backward. The global batch is defined once
(`seqs_per_step` sequences per optimizer step, whatever the world size and gradient accumulation):
every rank draws the same sequences and anchors from the same seeded generator and trains on its
own share, so N processes compute the same update as one (up to fp32 summation order).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"

    @property
    def main(self) -> bool:  # rank 0 alone writes checkpoints and logs
        return self.rank == 0


def join(device: str = "cpu") -> World:
    """The process group of a torchrun launch (or a world of one)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    if size > 1 and not dist.is_initialized():
        _rendezvous("nccl" if device.startswith("cuda") else "gloo", size)
    return World(int(os.environ.get("RANK", "0")), size, device)


def rendezvous_timeout() -> float:
    """Seconds a rank waits for the others (DFLASH2_RENDEZVOUS_TIMEOUT, default 300): torch's own 30 min
    wait in silence reads as a hang when one rank was never started."""
    raw = os.environ.get("DFLASH2_RENDEZVOUS_TIMEOUT", "300")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e7:
        from dflash2.errors import Dflash2Error

        raise Dflash2Error(f"environment DFLASH2_RENDEZVOUS_TIMEOUT: expected seconds in (0, 1e7), found {raw!r}")
    return value


def _rendezvous(backend: str, size: int) -> None:
    """Ranks started by hand (RANK / WORLD_SIZE / MASTER_ADDR set, no torchrun agent) meet in a TCPStore we
    build with DFLASH2_RENDEZVOUS_TIMEOUT; only that meeting is bounded so: the process group keeps torch's
    default timeout for its collectives (rank 0 alone evaluates and saves while the others wait). Under
    torchrun its agent has met the ranks already and hands over its store."""
    from dflash2.errors import Dflash2Error

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend)
        return
    wait = rendezvous_timeout()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank = int(os.environ.get("RANK", "0"))
    print(f"rank {rank}: waiting up to {wait:g} s for {size} ranks at {host}:{port}", file=sys.stderr, flush=True)
    try:
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timedelta(seconds=wait),
                              wait_for_workers=True)
    except (dist.DistStoreError, dist.DistNetworkError, TimeoutError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise Dflash2Error(f"rank {rank}: the {size} ranks did not meet at {host}:{port} within {wait:g} s ({first}); "
                           "start every rank (torchrun --nproc-per-node N -m dflash2.cli.train ...) or set "
                           "DFLASH2_RENDEZVOUS_TIMEOUT") from None
    store.set_timeout(timedelta(minutes=30))  # later store waits: torch's default, not the meeting's bound
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)


def leave(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


def share(items: list, world: World) -> list:
    """This rank's part of a globally drawn list (round robin: balanced when lengths are sorted)."""
    return items[world.rank::world.size]


def sum_across(values: list[float], world: World) -> list[float]:
    """Sums small statistics (losses, token counts) over ranks, for logging."""
    if world.size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=world.device)
    dist.all_reduce(t)
    return t.tolist()


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()

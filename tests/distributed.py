"""Running a function on N CPU ranks (gloo) from a test: spawned processes, results back by pickle."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple,
               timeout: timedelta | None = None) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        result = fn(rank, *args)
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: timedelta | None = None) -> list[Any]:
    """``fn(rank, *args)`` on ``world`` spawned processes in one gloo group; their results, by rank.
    ``fn`` must be importable (module level) and its result picklable. ``timeout``: how long a
    collective waits before it fails (a hang becomes an error)."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(world, _free_port(), out_dir, fn, args, timeout), nprocs=world, join=True)
        return [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(world)]

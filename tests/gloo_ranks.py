"""Start the ranks of a multi-process gloo run: one subprocess per rank, each logging to its own file."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def run_ranks(world: int, argv: list[str], env: dict[str, str], folder: str, timeout: float) -> list[str]:
    """Run ``argv`` as ``world`` ranks (``env`` plus torchrun's ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE``),
    logging to ``folder/log{rank}.txt``; kill what still runs ``timeout`` seconds after the start.

    Returns:
        The problems, [] when every rank exited with 0: a rank killed at the timeout or exiting
        with another status, with the tail of its log.
    """
    procs = []
    for rank in range(world):
        log = open(f"{folder}/log{rank}.txt", "w")
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
        procs.append((subprocess.Popen(argv, env=rank_env, stdout=log, stderr=log), log))
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    problems = [f"rank {rank} exited with {proc.returncode}:\n{Path(folder, f'log{rank}.txt').read_text()[-3000:]}"
                for rank, (proc, _) in enumerate(procs) if proc.returncode != 0]
    return ([f"timed out after {timeout:g} s"] if timed_out else []) + problems

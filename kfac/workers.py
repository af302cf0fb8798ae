"""Run independent CPU factorisations side by side, one intra-op thread each.

LAPACK's symmetric eigensolver scales poorly with threads: several 577x577 decompositions, each
in its own single-threaded worker, finish sooner than the same ones one after the other with all
threads each. LAPACK releases the GIL, so Python threads are enough.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def _single_threaded() -> None:
    torch.set_num_threads(1)  # per worker thread: the caller keeps its own setting


def _get_pool(size: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size != size:
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool = ThreadPoolExecutor(size, thread_name_prefix="kfac-worker", initializer=_single_threaded)
            _pool_size = size
        return _pool


def submit_largest_first(fn: Callable[[T], R], items: Sequence[T], costs: Sequence[float]) -> list[Future[R]]:
    """Start fn(item) for every item on the single-threaded workers, largest first; futures in item order.

    The caller may do other work (decompositions on the GPU) while these run.
    """
    pool = _get_pool(max(1, torch.get_num_threads()))
    order = sorted(range(len(items)), key=lambda i: -costs[i])
    futures = {i: pool.submit(fn, items[i]) for i in order}
    return [futures[i] for i in range(len(items))]


def map_largest_first(fn: Callable[[T], R], items: Sequence[T], costs: Sequence[float], on_cpu: bool) -> list[R]:
    """[fn(item) for item in items], spread over torch.get_num_threads() single-threaded workers on the CPU.

    Items start in order of decreasing cost so that the workers finish together. On a GPU, or with
    one thread or one item, this is the plain loop.
    """
    threads = torch.get_num_threads()
    if not on_cpu or threads <= 1 or len(items) <= 1:
        return [fn(item) for item in items]
    return [future.result() for future in submit_largest_first(fn, items, costs)]

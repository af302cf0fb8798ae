"""Run a batch producer one or two batches ahead, on a thread and (on CUDA) its own stream.

The device-decode path does real work in the main process for every batch (nvJPEG calls, one
crop/resize per image): done inline, it would sit between the training step's kernel launches.
On a thread it overlaps them (torch releases the GIL inside its operators), and on a side stream
its kernels overlap the step's. The consumer's stream waits on an event recorded after each
batch: a device-side dependency, no host synchronisation. Order is preserved (one producer).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch

Batch = tuple[torch.Tensor, torch.Tensor]
_DONE = object()


def in_background(produce: Callable[[], Iterator[Batch]], device: torch.device, depth: int = 2) -> Iterator[Batch]:
    """The batches of ``produce()``, made ``depth`` ahead on a daemon thread; its exceptions re-raise here."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def offer(item: object) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for batch in produce():
                    event = None
                    if stream is not None:
                        event = torch.cuda.Event()
                        event.record(stream)
                    if not offer((batch, event)):
                        return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
            offer(exc)
            return
        offer(_DONE)

    thread = threading.Thread(target=work, name="hpcdl-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = ready.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            (images, labels), event = item
            if event is not None:
                current = torch.cuda.current_stream(device)
                current.wait_event(event)
                images.record_stream(current)  # made on the side stream, used on this one
                labels.record_stream(current)
            yield images, labels
    finally:
        stop.set()
        thread.join(timeout=5)

"""The input pipeline the training loop calls: this rank's batches, on the device, ready for the model.

Two kinds, chosen by :func:`hpcdl.data.from_spec.build_pipeline`:

* :class:`ResidentPipeline` -- datasets that fit in memory (digits, MNIST, CIFAR-10, synthetic).
  The uint8 images move to the device once; a batch is an index_select, the CIFAR crop/flip a
  batched gather with a generator on the device, normalisation one multiply-add. No host work
  and no host-to-device copy per step.
* :class:`FilePipeline` -- encoded images (ImageNet folders or shards). DataLoader workers read
  the bytes; with ``decode="cpu"`` they also decode (libjpeg-turbo), crop and flip and hand over
  uint8 batches, copied pinned and non-blocking one batch ahead on a side stream; with
  ``decode="gpu"`` a thread of the main process decodes each batch with nvJPEG and crops on the
  device, two batches ahead on its own stream (:mod:`hpcdl.data.prefetch`).

Either way the order comes from :mod:`hpcdl.data.order` and every random draw from a seed built
from ``(seed, epoch, ...)``, so ``train_epoch(e, start_step=k)`` yields exactly batches k.. of the
uninterrupted epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from hpcdl.data.augment import Normalizer, eval_view, pad_crop_flip, train_params, train_view
from hpcdl.data.images import ByteSource, decode_cpu, decode_on_device, is_whole_jpeg
from hpcdl.data.order import check_enough, mix_seed, rank_order, steps_per_epoch, test_order
from hpcdl.data.prefetch import in_background
from hpcdl.data.spec import DataSpec, Normalization

Batch = tuple[torch.Tensor, torch.Tensor]

PREFETCH_FACTOR = 4  # batches each loader worker reads ahead


class InputPipeline:
    """What every pipeline offers the training loop."""

    num_classes: int
    input_shape: tuple[int, int, int]
    steps_per_epoch: int
    train_samples: int
    test_samples: int

    def train_epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        raise NotImplementedError

    def test_batches(self) -> Iterator[Batch]:
        raise NotImplementedError

    def close(self) -> None:
        """Stop loader workers and release files."""


class ResidentPipeline(InputPipeline):
    """Whole dataset on the device; batches gathered and augmented there."""

    def __init__(self, spec: DataSpec, rank: int, size: int, device: torch.device, *,
                 train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor],
                 norm: Normalization, num_classes: int, crop_padding: int = 0) -> None:
        self.spec, self.rank, self.size, self.device = spec, rank, size, device
        self.train_images, self.train_labels = (t.to(device) for t in train)
        self.test_images, self.test_labels = (t.to(device) for t in test)
        self.num_classes, self.crop_padding = num_classes, crop_padding
        self.input_shape = tuple(self.train_images.shape[1:])  # type: ignore[assignment]
        self.train_samples, self.test_samples = len(self.train_labels), len(self.test_labels)
        check_enough(self.train_samples, size, spec.batch_size)
        self.steps_per_epoch = steps_per_epoch(self.train_samples, size, spec.batch_size)
        self.normalize = Normalizer(norm, device, spec.channels_last)
        self.generator = torch.Generator(device=device)

    def images_at(self, images: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if len(images) < self.train_samples:  # a synthetic pool: samples cycle through it
            indices = torch.remainder(indices, len(images))
        return images.index_select(0, indices)

    def train_epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        batch = self.spec.batch_size
        order = rank_order(self.train_samples, self.spec.seed, epoch, self.rank, self.size, batch).to(self.device)
        for step in range(start_step, self.steps_per_epoch):
            indices = order[step * batch:(step + 1) * batch]
            images = self.images_at(self.train_images, indices)
            if self.crop_padding:
                self.generator.manual_seed(mix_seed(self.spec.seed, epoch, self.rank, self.size, step))
                images = pad_crop_flip(images, self.crop_padding, self.generator)
            yield self.normalize(images), self.train_labels.index_select(0, indices)

    def test_batches(self) -> Iterator[Batch]:
        order = torch.as_tensor(test_order(self.test_samples, self.rank, self.size), device=self.device)
        for start in range(0, len(order), self.spec.test_batch_size):
            indices = order[start:start + self.spec.test_batch_size]
            images = self.test_images.index_select(0, torch.remainder(indices, len(self.test_images)))
            yield self.normalize(images), self.test_labels.index_select(0, indices)


class KeySampler(Sampler[Any]):
    """Hands the DataLoader the keys of the current pass; set anew before each pass (workers persist)."""

    def __init__(self) -> None:
        self.keys: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


class DecodedViews(Dataset):
    """CPU decode in a worker: key (index, seed) -> (uint8 (3, S, S) view, label). seed < 0: evaluation view."""

    def __init__(self, source: ByteSource, image_size: int) -> None:
        self.source, self.image_size = source, image_size

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        index, seed = key
        image = decode_cpu(self.source.read(index), self.source.name(index))
        if seed < 0:
            return eval_view(image, self.image_size), int(self.source.labels[index])
        (top, left, h, w, flip), = train_params(np.array([image.shape[-2]]), np.array([image.shape[-1]]),
                                                np.array([seed])).tolist()
        return train_view(image, (top, left, h, w), bool(flip), self.image_size), int(self.source.labels[index])


class EncodedSamples(Dataset):
    """For device decode: key (index, seed) -> (JPEG bytes, or CPU-decoded pixels for other formats and
    for JPEGs without their end marker, key, label)."""

    def __init__(self, source: ByteSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, bool, tuple[int, int], int]:
        index = key[0]
        data = self.source.read(index)
        if is_whole_jpeg(data):
            return data, True, key, int(self.source.labels[index])
        return decode_cpu(data, self.source.name(index)), False, key, int(self.source.labels[index])


Encoded = tuple[torch.Tensor, bool, tuple[int, int], int]


def collate_encoded(items: list[Encoded]) -> tuple[list, list, list, torch.Tensor]:
    payloads, jpeg, keys, labels = zip(*items, strict=True)
    return list(payloads), list(jpeg), list(keys), torch.tensor(labels, dtype=torch.int64)


def copied_ahead(batches: Iterator[Batch], device: torch.device) -> Iterator[Batch]:
    """Host batches (pinned) -> device, each copy issued one batch before it is handed out, on a side
    stream that the consumer's stream waits on by event (no host synchronisation)."""
    if device.type != "cuda":
        yield from batches
        return
    stream = torch.cuda.Stream(device)
    pending: tuple[tuple[torch.Tensor, ...], torch.cuda.Event] | None = None
    for host in batches:
        with torch.cuda.stream(stream):
            copied = tuple(t.to(device, non_blocking=True) for t in host)
            ready = torch.cuda.Event()
            ready.record(stream)
        if pending is not None:
            yield finish(*pending)
        pending = (copied, ready)
    if pending is not None:
        yield finish(*pending)


def finish(tensors: tuple[torch.Tensor, ...], ready: torch.cuda.Event) -> Batch:
    current = torch.cuda.current_stream(tensors[0].device)
    current.wait_event(ready)
    for tensor in tensors:
        tensor.record_stream(current)  # the copy stream's allocation is now used on the current stream
    return tensors[0], tensors[1]


class LoaderPipeline(InputPipeline):
    """Items that DataLoader workers read in hpcdl's order: the shard's counts, and one loader per split whose
    sampler is given each epoch's keys (:class:`KeySampler`). A subclass says how a split is loaded."""

    def shard(self, spec: DataSpec, rank: int, size: int, device: torch.device, train_samples: int,
              test_samples: int) -> None:
        """The counts, the steps per epoch and the key samplers; called first by a subclass's ``__init__``."""
        self.spec, self.rank, self.size, self.device = spec, rank, size, device
        self.train_samples, self.test_samples = train_samples, test_samples
        check_enough(train_samples, size, spec.batch_size)
        self.steps_per_epoch = steps_per_epoch(train_samples, size, spec.batch_size)
        self.train_keys, self.test_keys = KeySampler(), KeySampler()

    def open_loaders(self, train: Any, test: Any) -> None:
        """The two splits' loaders; called last by a subclass's ``__init__`` (its ``loader`` reads its settings)."""
        self.train_loader = self.loader(train, self.train_keys, self.spec.batch_size)
        self.test_loader = self.loader(test, self.test_keys, self.spec.test_batch_size)

    def loader(self, data: Any, keys: KeySampler, batch_size: int) -> DataLoader:
        raise NotImplementedError

    def loader_options(self, keys: KeySampler, batch_size: int, pin: bool) -> dict[str, Any]:
        """DataLoader's options: --workers persistent workers, four batches read ahead each, keys as the sampler."""
        workers = self.spec.workers
        options: dict[str, Any] = dict(num_workers=workers, persistent_workers=workers > 0, batch_size=batch_size,
                                       sampler=keys, pin_memory=pin)
        if workers > 0:
            options["prefetch_factor"] = PREFETCH_FACTOR
        return options

    def close(self) -> None:
        shut_down(self.train_loader, self.test_loader)


class FilePipeline(LoaderPipeline):
    """Encoded images read by DataLoader workers; decoded there (cpu) or on the device in batches (gpu)."""

    def __init__(self, spec: DataSpec, rank: int, size: int, device: torch.device, *,
                 train: ByteSource, test: ByteSource, norm: Normalization, num_classes: int,
                 decode_on_gpu: bool) -> None:
        self.shard(spec, rank, size, device, len(train), len(test))
        self.train_source, self.test_source = train, test
        self.num_classes, self.decode_on_gpu = num_classes, decode_on_gpu
        self.input_shape = (3, spec.image_size, spec.image_size)
        self.normalize = Normalizer(norm, device, spec.channels_last)
        self.decode_stream = torch.cuda.Stream(device) if decode_on_gpu and device.type == "cuda" else None
        # torchvision (the decoders and views) imported once, here: forked loader workers inherit it rather
        # than each importing it at its first sample.
        import torchvision.transforms.v2  # noqa: F401
        self.open_loaders(train, test)

    def loader(self, source: ByteSource, keys: KeySampler, batch_size: int) -> DataLoader:
        # pinned only where a copy reads it asynchronously: the uint8 batches of the CPU path; nvJPEG
        # reads the bytes of the device path from pageable memory
        options = self.loader_options(keys, batch_size, pin=self.device.type == "cuda" and not self.decode_on_gpu)
        if self.decode_on_gpu:
            return DataLoader(EncodedSamples(source), collate_fn=collate_encoded, **options)
        return DataLoader(DecodedViews(source, self.spec.image_size), **options)

    def train_keys_for(self, epoch: int, start_step: int) -> list[tuple[int, int]]:
        """(sample, augmentation seed) of this rank's batches start_step.. of the epoch. The seed belongs
        to the sample and epoch, not to the worker or rank that happens to handle it."""
        batch = self.spec.batch_size
        order = rank_order(self.train_samples, self.spec.seed, epoch, self.rank, self.size, batch)
        return [(int(i), mix_seed(self.spec.seed, epoch, int(i))) for i in order[start_step * batch:]]

    def train_epoch(self, epoch: int, start_step: int = 0) -> Iterator[Batch]:
        self.train_keys.keys = self.train_keys_for(epoch, start_step)
        return self.batches(self.train_loader, train=True)

    def test_batches(self) -> Iterator[Batch]:
        self.test_keys.keys = [(i, -1) for i in test_order(self.test_samples, self.rank, self.size)]
        return self.batches(self.test_loader, train=False)

    def batches(self, loader: DataLoader, train: bool) -> Iterator[Batch]:
        if self.decode_on_gpu:
            def produce() -> Iterator[Batch]:
                for payloads, jpeg, keys, labels in loader:
                    images = self.decode_views(payloads, jpeg, keys, train)
                    yield self.normalize(images), labels.to(self.device, non_blocking=True)

            yield from in_background(produce, self.device)
        else:
            for images, labels in copied_ahead(iter(loader), self.device):
                yield self.normalize(images), labels

    def decode_views(self, payloads: list[torch.Tensor], jpeg: list[bool], keys: list[tuple[int, int]],
                     train: bool) -> torch.Tensor:
        """nvJPEG for the JPEGs of the batch (one call), then each image's crop/flip (or evaluation
        view) on the device. The crop/flip parameters of the whole batch are drawn in one go from the
        samples' seeds (the same parameters the CPU path draws one by one); the host does no other
        per-image work than launching each image's resize."""
        source = self.train_source if train else self.test_source
        images = list(payloads)  # non-JPEGs came decoded by the CPU
        encoded = [i for i, is_jpg in enumerate(jpeg) if is_jpg]
        if encoded:  # a batch of PNGs only has nothing for nvJPEG (which refuses an empty list)
            decoded = self.decode_jpegs([payloads[i] for i in encoded], [source.name(keys[i][0]) for i in encoded])
            for i, image in zip(encoded, decoded, strict=True):
                images[i] = image
        images = [image.to(self.device, non_blocking=True) for image in images]
        size = self.spec.image_size
        if not train:
            return torch.stack([eval_view(image, size) for image in images])
        heights = np.array([image.shape[-2] for image in images])
        widths = np.array([image.shape[-1] for image in images])
        params = train_params(heights, widths, np.array([seed for _, seed in keys])).tolist()
        return torch.stack([train_view(image, (top, left, h, w), bool(flip), size)
                            for image, (top, left, h, w, flip) in zip(images, params, strict=True)])

    def decode_jpegs(self, datas: list[torch.Tensor], names: list[str]) -> list[torch.Tensor]:
        """nvJPEG decode whose outputs are safe to use on the calling stream and to free afterwards.

        torchvision 0.28's batched ``decode_jpeg(..., device="cuda")`` allocates its outputs on the
        caller's current stream but writes them from its own internal stream, which waits for nothing
        the caller queued (it only makes the caller wait for the decode). Called on this thread's
        side stream, a block freed there while the previous batch's resizes still read it could be
        handed straight to the next decode and overwritten under them. So the decode runs with a
        stream of its own current, used for nothing else: its outputs come from that stream's pool,
        the using stream waits for it, and ``record_stream`` keeps each output's memory from being
        reused until the work queued on the using stream at its release has finished."""
        if self.decode_stream is None:
            return decode_on_device(datas, names, self.device)
        use = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.decode_stream):
            decoded = decode_on_device(datas, names, self.device)
        use.wait_stream(self.decode_stream)
        for image in decoded:
            image.record_stream(use)
        return decoded

    def close(self) -> None:
        super().close()
        for source in (self.train_source, self.test_source):
            closer = getattr(source, "close", None)
            if closer is not None:
                closer()


def shut_down(*loaders: DataLoader) -> None:
    """Stop each loader's persistent workers now, not at garbage collection (a closed pipeline must not
    leave processes behind while the job goes on)."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
        loader._iterator = None

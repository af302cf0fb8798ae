"""The input pipeline: augmentation semantics against torchvision's own transforms, exactly-once
order over ranks, exact mid-epoch resume, and the CPU and device decode paths agreeing."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import transforms as T
from torchvision.transforms import functional as TF
from torchvision.transforms import v2

from hpcdl.data import DataSpec, build_pipeline
from hpcdl.data.augment import (
    Normalizer,
    apply_crop_flip,
    draw_crop_flip,
    eval_view,
    train_params,
    train_view,
)
from hpcdl.data.imagenet import list_imagenet
from hpcdl.data.pipeline import FilePipeline, InputPipeline, ResidentPipeline
from hpcdl.data.registry import REGISTRY
from hpcdl.data.spec import Normalization
from hpcdl.runtime.errors import UsageError
from tests.support.data_files import write_cifar10, write_imagenet

CIFAR_NORM, IMAGENET_NORM = REGISTRY["cifar10"].norm, REGISTRY["imagenet"].norm

CPU = torch.device("cpu")


def spec(dataset: str = "synthetic", data_dir: Path | None = None, **changes: object) -> DataSpec:
    base: dict = dict(dataset=dataset, data_dir=str(data_dir) if data_dir else None, batch_size=4, test_batch_size=5,
                      workers=0, seed=7)
    return DataSpec(**{**base, **changes})


# ---- augmentation semantics: torchvision's transforms (global RNG) are the reference

def draws(height: int, width: int, seeds: range) -> np.ndarray:
    return train_params(np.full(len(seeds), height), np.full(len(seeds), width), np.array(list(seeds)))


@pytest.mark.parametrize("height,width", [(375, 500), (500, 375), (40, 47), (30, 400), (224, 224)])
def test_crop_and_flip_draws_follow_torchvisions_distribution(height: int, width: int) -> None:
    from scipy.stats import ks_2samp

    ours = draws(height, width, range(4000))
    image = torch.zeros(1, height, width)
    torch.manual_seed(0)
    theirs = np.array([T.RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(4000)])
    for column, name in ((2, "crop height"), (3, "crop width"), (0, "top"), (1, "left")):
        assert ks_2samp(ours[:, column], theirs[:, column]).pvalue > 1e-3, name
    assert ((ours[:, 0] + ours[:, 2] <= height) & (ours[:, 1] + ours[:, 3] <= width)).all()
    assert 0.46 < ours[:, 4].mean() < 0.54  # RandomHorizontalFlip(p=0.5)


@pytest.mark.parametrize("height,width", [(1, 1000), (1000, 1), (3, 900), (900, 3)])
def test_crop_fallback_is_torchvisions_centre_crop(height: int, width: int) -> None:
    # no try can fit these, so torchvision's answer is deterministic: compare with it directly
    expected = T.RandomResizedCrop.get_params(torch.zeros(1, height, width), [0.08, 1.0], [3 / 4, 4 / 3])
    assert {tuple(row[:4]) for row in draws(height, width, range(50)).tolist()} == {expected}


def test_a_samples_draw_depends_on_its_seed_alone() -> None:
    heights, widths, seeds = np.array([375, 40, 500]), np.array([500, 47, 375]), np.array([11, 2**62 + 5, 7])
    batch = train_params(heights, widths, seeds)
    for i in range(3):
        assert (train_params(heights[i:i + 1], widths[i:i + 1], seeds[i:i + 1])[0] == batch[i]).all()
    assert len({tuple(row) for row in draws(375, 500, range(100)).tolist()}) == 100


def test_train_view_is_random_resized_crop_and_flip() -> None:
    image = torch.randint(0, 256, (3, 61, 83), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    flips = set()
    for top, left, h, w, flip in draws(61, 83, range(30)).tolist():
        flips.add(bool(flip))
        view = train_view(image, (top, left, h, w), bool(flip), 32)
        # the classic transforms on the same crop: the same view up to uint8 rounding
        expected = TF.resized_crop(image, top, left, h, w, [32, 32], antialias=True)
        expected = TF.hflip(expected) if flip else expected
        assert (view.int() - expected.int()).abs().max() <= 1
    assert flips == {True, False}


def test_eval_view_is_resize_and_centre_crop() -> None:
    image = torch.randint(0, 256, (3, 300, 451), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    reference = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])
    assert torch.equal(eval_view(image, 224), reference(image))
    classic = T.Compose([T.Resize(256, antialias=True), T.CenterCrop(224)])
    assert (eval_view(image, 224).int() - classic(image).int()).abs().max() <= 1


def test_batched_crop_flip_matches_per_image_pad_crop_flip() -> None:
    images = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    top, left, flip = draw_crop_flip(64, 4, torch.Generator().manual_seed(3), CPU)
    out = apply_crop_flip(images, 4, top, left, flip)
    for i in range(64):
        padded = TF.pad(images[i], [4])
        expected = TF.crop(padded, int(top[i]), int(left[i]), 32, 32)
        expected = TF.hflip(expected) if bool(flip[i]) else expected
        assert torch.equal(out[i], expected), i


def test_crop_flip_draws_cover_randomcrops_range() -> None:
    top, left, flip = draw_crop_flip(20000, 4, torch.Generator().manual_seed(4), CPU)
    assert set(top.flatten().tolist()) == set(range(9)) == set(left.flatten().tolist())
    assert 0.47 < flip.float().mean().item() < 0.53


def test_normalizer_matches_torchvision_normalize() -> None:
    images = torch.randint(0, 256, (2, 3, 9, 9), dtype=torch.uint8)
    expected = T.Normalize(CIFAR_NORM.mean, CIFAR_NORM.std)(images.float() / 255)
    out = Normalizer(CIFAR_NORM, CPU, channels_last=True)(images)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(out, expected, atol=1e-5)


# ---- order over ranks and resume, on a resident dataset whose label is the sample's index

def indexed_pipeline(rank: int, size: int, samples: int = 50, **changes: object) -> ResidentPipeline:
    images = (torch.arange(samples) % 256).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 4, 4).contiguous()
    labels = torch.arange(samples)
    return ResidentPipeline(spec(**changes), rank, size, CPU, train=(images, labels), test=(images[:11], labels[:11]),
                            norm=Normalization((0.0,), (1.0,)), num_classes=samples, crop_padding=1)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_sample_once_per_epoch_across_ranks(size: int) -> None:
    for epoch in (0, 1):
        seen = [int(label) for rank in range(size)
                for _, labels in indexed_pipeline(rank, size).train_epoch(epoch) for label in labels]
        steps = (50 // size) // 4
        assert len(seen) == len(set(seen)) == steps * 4 * size  # no duplicate; drop only the remainder
        assert len(seen) > 50 - 4 * size
        tests = [int(label) for rank in range(size) for _, labels in indexed_pipeline(rank, size).test_batches()
                 for label in labels]
        assert sorted(tests) == list(range(11))


def test_epochs_differ_and_resume_mid_epoch_is_exact() -> None:
    pipeline = indexed_pipeline(1, 2)
    full = list(pipeline.train_epoch(3))
    torch.manual_seed(123)  # global RNG state must not matter
    resumed = list(indexed_pipeline(1, 2).train_epoch(3, start_step=2))
    assert len(resumed) == len(full) - 2
    for (x, y), (rx, ry) in zip(full[2:], resumed, strict=True):
        assert torch.equal(x, rx) and torch.equal(y, ry)
    other = [int(v) for _, y in pipeline.train_epoch(4) for v in y]
    assert other != [int(v) for _, y in full for v in y]


def test_cifar_pipeline_augments_on_the_device_and_resumes(tmp_path: Path) -> None:
    write_cifar10(tmp_path, per_batch=8)
    pipeline = build_pipeline(spec("cifar10", tmp_path), 0, 1, CPU)
    assert (pipeline.num_classes, pipeline.input_shape, pipeline.train_samples, pipeline.test_samples) == (
        10, (3, 32, 32), 40, 8)
    full = list(pipeline.train_epoch(0))
    again = list(build_pipeline(spec("cifar10", tmp_path), 0, 1, CPU).train_epoch(0, start_step=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[3:], again, strict=True))
    written = [pickle.loads((tmp_path / "cifar-10-batches-py" / f"data_batch_{i}").read_bytes())["data"]
               for i in range(1, 6)]
    raw = torch.from_numpy(np.concatenate(written)).view(40, 3, 32, 32)  # the release's layout, read by hand
    x, y = full[0]
    # each augmented image is its source image under some 4-pixel padded crop and flip
    normalize = Normalizer(CIFAR_NORM, CPU, channels_last=False)
    candidates = normalize(torch.stack([TF.crop(TF.pad(raw[j], [4]), t, s, 32, 32)
                                        for j in range(40) for t in range(9) for s in range(9)]))
    for image in x:
        direct = (candidates - image).abs().flatten(1).max(1).values.min()
        flipped = (candidates.flip(-1) - image).abs().flatten(1).max(1).values.min()
        assert min(direct, flipped) < 1e-5


def test_digits_values_are_scikit_learns_normalised_by_hand() -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    pipeline = build_pipeline(spec("digits", test_batch_size=1000), 0, 1, CPU)
    (x, y), = list(pipeline.test_batches())
    digits = load_digits()
    _, x_test, _, y_test = train_test_split(digits.images, digits.target, test_size=0.2, random_state=0,
                                            stratify=digits.target)
    expected = (torch.from_numpy(x_test).float().unsqueeze(1) / 16 - 0.5) / 0.5
    assert torch.allclose(x, expected, atol=1e-6) and y.tolist() == y_test.tolist()


def test_synthetic_is_generated_on_the_device_with_the_asked_shape() -> None:
    pipeline = build_pipeline(spec(synthetic_shape=(3, 16, 16), synthetic_classes=5, synthetic_size=300,
                                   channels_last=True), 0, 2, CPU)
    x, y = next(pipeline.train_epoch(0))
    assert x.shape == (4, 3, 16, 16) and x.is_contiguous(memory_format=torch.channels_last)
    assert y.dtype == torch.int64 and int(y.max()) < 5 and pipeline.steps_per_epoch == 37


# ---- JPEG files: CPU decode in workers vs the device decode path (run on the CPU here)

def file_pipelines(root: Path, on_device_path: bool, **changes: object) -> FilePipeline:
    classes, train, test = list_imagenet(root)
    return FilePipeline(spec("imagenet", root, image_size=32, **changes), 0, 1, CPU, train=train, test=test,
                        norm=IMAGENET_NORM, num_classes=len(classes), decode_on_gpu=on_device_path)


def test_cpu_and_device_decode_paths_give_identical_batches(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=3, per_class=4, size=48)
    png = tmp_path / "train" / "n00000001" / "extra.png"  # a PNG among the JPEGs: CPU fallback on the device path
    from PIL import Image
    Image.new("RGB", (50, 41), (200, 10, 30)).save(png)
    cpu, device_path = file_pipelines(tmp_path, False), file_pipelines(tmp_path, True)
    for epoch in (0, 1):
        pairs = zip(cpu.train_epoch(epoch, start_step=1), device_path.train_epoch(epoch, start_step=1), strict=True)
        for (x, y), (dx, dy) in pairs:
            assert torch.equal(x, dx) and torch.equal(y, dy)
    for (x, y), (dx, dy) in zip(cpu.test_batches(), device_path.test_batches(), strict=True):
        assert torch.equal(x, dx) and torch.equal(y, dy)
    assert cpu.train_samples == 13 and cpu.steps_per_epoch == 3


@pytest.mark.processes  # a DataLoader worker process
def test_file_pipeline_with_a_worker_process_resumes_exactly(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=6, size=40)
    pipeline = build_pipeline(spec("imagenet", tmp_path, image_size=24, workers=1), 0, 1, CPU)
    full = list(pipeline.train_epoch(2))
    resumed = list(pipeline.train_epoch(2, start_step=1))
    pipeline.close()
    assert len(full) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(full[1:], resumed, strict=True))
    assert full[0][0].shape == (4, 3, 24, 24) and full[0][0].dtype == torch.float32


@pytest.mark.parametrize("on_device_path", [False, True])
def test_corrupt_jpeg_names_its_file(tmp_path: Path, on_device_path: bool) -> None:
    write_imagenet(tmp_path, classes=2, per_class=2)
    bad = tmp_path / "train" / "n00000001" / "img_1.JPEG"
    bad.write_bytes(b"\xff\xd8\xff\xe0 truncated jpeg")
    with pytest.raises(OSError, match=f"cannot decode image {bad}"):
        list(file_pipelines(tmp_path, on_device_path).train_epoch(0))


def test_bad_flags_are_one_line_errors(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=2)
    with pytest.raises(UsageError, match="--decode gpu needs a CUDA device"):
        build_pipeline(spec("imagenet", tmp_path, decode="gpu"), 0, 1, CPU)
    with pytest.raises(UsageError, match="--decode fast"):
        build_pipeline(spec("imagenet", tmp_path, decode="fast"), 0, 1, CPU)
    with pytest.raises(UsageError, match="cannot give 3 ranks a batch of 4"):
        build_pipeline(spec("imagenet", tmp_path), 0, 3, CPU)
    with pytest.raises(UsageError, match="needs --data-dir"):
        build_pipeline(spec("cifar10"), 0, 1, CPU)


def assert_close_to_libjpeg(gpu_batch: tuple[torch.Tensor, torch.Tensor],
                            cpu_batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """nvJPEG and libjpeg-turbo decode one JPEG differently: IDCT rounding (a few thousandths of a
    normalised unit on average, as on grayscale images) and 4:2:0 chroma upsampling, which on these
    uniform-noise colour images averages 0.10-0.20 (H100, torchvision 0.26). A batch overwritten by other
    images' pixels averages about 1.1: each GPU image must be within 0.3 of its own CPU decode, and nearer
    to it than to any other image of the batch."""
    (x, y), (cx, cy) = gpu_batch, cpu_batch
    assert x.device.type == "cuda" and torch.equal(y, cy)
    distances = (x.flatten(1)[:, None, :] - cx.flatten(1)[None, :, :]).abs().mean(2)  # [gpu image, cpu image]
    own = distances.diagonal()
    assert own.max().item() < 0.3, own.tolist()
    assert torch.equal(distances.argmin(1).cpu(), torch.arange(len(x))), distances.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nvJPEG decode)")
def test_gpu_decode_matches_cpu_decode_closely(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=3, per_class=4, size=64)
    cuda = torch.device("cuda")
    gpu = build_pipeline(spec("imagenet", tmp_path, image_size=32, decode="gpu"), 0, 1, cuda)
    cpu = build_pipeline(spec("imagenet", tmp_path, image_size=32, decode="cpu"), 0, 1, cuda)
    for gpu_batch, cpu_batch in zip(gpu.train_epoch(0), cpu.train_epoch(0), strict=True):
        assert_close_to_libjpeg(gpu_batch, cpu_batch)  # same crops: nearly the same pixels
    gpu.close()
    cpu.close()


def test_background_prefetch_keeps_order_raises_errors_and_stops_when_abandoned() -> None:
    import threading

    from hpcdl.data.prefetch import in_background

    def numbers(count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(count):
            yield torch.tensor([i]), torch.tensor([i])

    assert [int(x) for x, _ in in_background(lambda: numbers(20), CPU)] == list(range(20))

    def failing() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from numbers(3)
        raise OSError("cannot decode image broken.jpg")

    with pytest.raises(OSError, match="broken.jpg"):
        list(in_background(failing, CPU))
    endless = in_background(lambda: numbers(10**9), CPU)
    next(endless)
    endless.close()
    assert not [t for t in threading.enumerate() if t.name == "hpcdl-prefetch"]


@pytest.mark.processes  # a DataLoader worker process
def test_abandoned_epoch_on_the_device_path_leaves_the_next_epoch_exact(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=8, size=40)
    pipeline = file_pipelines(tmp_path, True, workers=1)
    next(iter(pipeline.train_epoch(0)))  # a run stopped after one step of epoch 0
    resumed = list(pipeline.train_epoch(1))
    fresh = list(file_pipelines(tmp_path, True).train_epoch(1))
    pipeline.close()
    assert len(resumed) == len(fresh) == 4
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(resumed, fresh, strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resident_pipelines_on_cuda_augment_there_and_resume_exactly(tmp_path: Path) -> None:
    write_cifar10(tmp_path, per_batch=8)
    cuda = torch.device("cuda")
    pipeline = build_pipeline(spec("cifar10", tmp_path, channels_last=True), 0, 2, cuda)
    full = list(pipeline.train_epoch(1))
    resumed = list(build_pipeline(spec("cifar10", tmp_path, channels_last=True), 0, 2, cuda).train_epoch(1, 2))
    assert full[0][0].device.type == "cuda" and full[0][0].is_contiguous(memory_format=torch.channels_last)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full[2:], resumed, strict=True))
    x, y = next(build_pipeline(spec(synthetic_shape=(3, 64, 64)), 0, 1, cuda).train_epoch(0))
    assert x.device.type == y.device.type == "cuda" and x.shape == (4, 3, 64, 64)


# ---- the device-decode path: batches without JPEGs, unusual JPEGs, and (on CUDA) nvJPEG against libjpeg-turbo

def write_odd_images(root: Path, size: int = 48) -> dict[str, Path]:
    """One grayscale JPEG, one CMYK JPEG and one PNG in the first training class; the rest as written."""
    from PIL import Image

    rng = np.random.default_rng(5)
    folder = root / "train" / "n00000000"
    paths = {"gray": folder / "gray.JPEG", "cmyk": folder / "cmyk.JPEG", "png": folder / "extra.png"}
    Image.fromarray(rng.integers(0, 256, (size, size + 3), dtype=np.uint8), "L").save(paths["gray"], quality=90)
    Image.fromarray(rng.integers(0, 256, (size + 5, size, 4), dtype=np.uint8), "CMYK").save(paths["cmyk"],
                                                                                             quality=90)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(paths["png"])
    return paths


def test_a_batch_without_jpegs_on_the_device_path(tmp_path: Path) -> None:
    # a PNG-only split: nvJPEG gets nothing to decode (torchvision's decode_jpeg refuses an empty list)
    from PIL import Image

    for split in ("train", "val"):
        for c in range(2):
            folder = tmp_path / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40 + i, 37), (60 * i, 20 * c, 90)).save(folder / f"img_{i}.png")
    cpu, device_path = file_pipelines(tmp_path, False), file_pipelines(tmp_path, True)
    for (x, y), (dx, dy) in zip(cpu.train_epoch(0), device_path.train_epoch(0), strict=True):
        assert torch.equal(x, dx) and torch.equal(y, dy)
    assert len(list(device_path.test_batches())) == 2


def test_grayscale_and_cmyk_jpegs_give_the_cpu_paths_pixels(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=3, size=48)
    write_odd_images(tmp_path)
    cpu, device_path = file_pipelines(tmp_path, False), file_pipelines(tmp_path, True)
    batches = list(zip(cpu.train_epoch(0), device_path.train_epoch(0), strict=True))
    assert len(batches) == 2
    for (x, y), (dx, dy) in batches:
        assert x.shape == (4, 3, 32, 32) and torch.equal(x, dx) and torch.equal(y, dy)


def paired_cuda_pipelines(root: Path, **changes: object) -> tuple[InputPipeline, InputPipeline]:
    cuda = torch.device("cuda")
    options: dict = {"image_size": 64, "batch_size": 8, "test_batch_size": 8, **changes}
    return (build_pipeline(spec("imagenet", root, decode="gpu", **options), 0, 1, cuda),
            build_pipeline(spec("imagenet", root, decode="cpu", **options), 0, 1, cuda))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nvJPEG decode)")
def test_gpu_decode_equals_cpu_decode_over_many_batches_with_prefetch_running(tmp_path: Path) -> None:
    # many batches, the model's stream kept busy, so a decode that overwrote a batch still being
    # resized (the allocator race of torchvision's batched decode) would show as a wrong image
    write_imagenet(tmp_path, classes=4, per_class=40, size=96)
    gpu, cpu = paired_cuda_pipelines(tmp_path, workers=2)
    busy = torch.randn(2048, 2048, device="cuda")
    for epoch in range(3):
        for gpu_batch, cpu_batch in zip(gpu.train_epoch(epoch), cpu.train_epoch(epoch), strict=True):
            for _ in range(4):
                busy = (busy @ busy).tanh_()  # keeps the consumer stream behind the producer
            assert_close_to_libjpeg(gpu_batch, cpu_batch)
    for gpu_batch, cpu_batch in zip(gpu.test_batches(), cpu.test_batches(), strict=True):
        assert_close_to_libjpeg(gpu_batch, cpu_batch)
    gpu.close()
    cpu.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nvJPEG decode)")
def test_gpu_decode_of_grayscale_cmyk_and_png_equals_cpu_decode(tmp_path: Path) -> None:
    write_imagenet(tmp_path, classes=2, per_class=5, size=64)
    write_odd_images(tmp_path, size=64)
    gpu, cpu = paired_cuda_pipelines(tmp_path, workers=0, batch_size=13)
    for epoch in range(2):  # 13 training images: every one in the single batch of each epoch
        for gpu_batch, cpu_batch in zip(gpu.train_epoch(epoch), cpu.train_epoch(epoch), strict=True):
            assert_close_to_libjpeg(gpu_batch, cpu_batch)
    gpu.close()
    cpu.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (nvJPEG decode)")
def test_truncated_jpeg_on_the_gpu_does_what_the_cpu_decoder_does(tmp_path: Path) -> None:
    # libjpeg-turbo is the reference: if it refuses the file, the GPU path names the file too; if it
    # decodes what is there, the GPU path gives the same pixels
    write_imagenet(tmp_path, classes=2, per_class=4, size=64)
    cut = tmp_path / "train" / "n00000001" / "img_2.JPEG"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    gpu, cpu = paired_cuda_pipelines(tmp_path, workers=0)
    try:
        cpu_batches = list(cpu.train_epoch(0))
    except OSError as exc:
        assert str(cut) in str(exc)
        with pytest.raises(OSError, match=f"cannot decode image {cut}"):
            list(gpu.train_epoch(0))
    else:
        for gpu_batch, cpu_batch in zip(gpu.train_epoch(0), cpu_batches, strict=True):
            assert_close_to_libjpeg(gpu_batch, cpu_batch)
    gpu.close()
    cpu.close()


def test_a_truncated_jpeg_is_left_to_libjpeg_turbo_which_names_it(tmp_path: Path) -> None:
    from hpcdl.data.images import is_whole_jpeg

    write_imagenet(tmp_path, classes=2, per_class=4, size=48)
    cut = tmp_path / "train" / "n00000001" / "img_2.JPEG"
    whole = cut.read_bytes()
    assert is_whole_jpeg(torch.frombuffer(bytearray(whole), dtype=torch.uint8))
    cut.write_bytes(whole[: len(whole) // 2])
    assert not is_whole_jpeg(torch.frombuffer(bytearray(cut.read_bytes()), dtype=torch.uint8))
    for on_device_path in (False, True):  # nvJPEG never sees it: the worker decodes it on the CPU, which refuses
        with pytest.raises(OSError, match=f"cannot decode image {cut}"):
            list(file_pipelines(tmp_path, on_device_path).train_epoch(0))

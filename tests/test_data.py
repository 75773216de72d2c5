"""Dataset loaders: real zips, and pickles/folders written here in the exact standard formats."""

import io
import pickle
import zipfile

import numpy as np
import pytest
import torch
from PIL import Image

from learner.data import DatasetError, load_dataset, task_batches, task_test_set
from learner.formats.snapshot import read_image

from .conftest import CIFAR10_ZIP, EUROSAT_ZIP, MINI_ZIP


def test_cifar10_zip_slice_has_the_standard_class_order(cifar10_slice):
    d = cifar10_slice
    assert d.class_names == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    assert d.train_x.shape == (2500, 3, 32, 32) and d.train_x.dtype == torch.uint8
    assert torch.bincount(d.train_y).tolist() == [250] * 10 and torch.bincount(d.test_y).tolist() == [100] * 10
    assert d.tasks() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    # first image of the slice is the first airplane file by name, decoded as RGB
    with zipfile.ZipFile(CIFAR10_ZIP) as z:
        first = sorted(n for n in z.namelist() if n.startswith("cifar10/train/airplane/"))[0]
        arr = np.asarray(Image.open(io.BytesIO(z.read(first))).convert("RGB"))
    assert torch.equal(d.train_x[0], torch.from_numpy(arr).permute(2, 0, 1))


def test_mini_imagenet_slice_follows_classes_txt_and_holds_out_a_sixth(cache_dir):
    d = load_dataset("mini-imagenet", MINI_ZIP, cache_dir=cache_dir)
    with zipfile.ZipFile(MINI_ZIP) as z:
        order = z.read("mini-imagenet/classes.txt").decode().split()
    assert d.class_names == order and d.image_shape == (3, 84, 84)
    assert torch.bincount(d.test_y).tolist() == [10] * 100 and torch.bincount(d.train_y).tolist() == [50] * 100
    assert len(d.tasks()) == 10 and d.tasks()[1] == list(range(10, 20))


def test_eurosat_has_the_shared_split_and_class_order(cache_dir):
    # ../shared/datasets/README.md: n a multiple of 5 is a test image; classes alphabetical; files in the order of n
    data = load_dataset("eurosat", EUROSAT_ZIP, train_per_class=5, test_per_class=2, cache_dir=cache_dir)
    assert data.class_names[:3] == ["AnnualCrop", "Forest", "HerbaceousVegetation"] and data.num_classes == 10
    assert data.image_shape == (3, 64, 64) and data.tasks() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert data.train_y.bincount().tolist() == [5] * 10 and data.test_y.bincount().tolist() == [2] * 10
    with zipfile.ZipFile(EUROSAT_ZIP) as z:
        def image(name):
            pixels = np.asarray(Image.open(io.BytesIO(z.read(name))).convert("RGB"))
            return torch.from_numpy(pixels.transpose(2, 0, 1).copy())
        # training: AnnualCrop_1, _2, _3, _4, _6 (not _10, which name order would put second); test: _5, _10
        assert torch.equal(data.train_x[1], image("AnnualCrop/AnnualCrop_2.jpg"))
        assert torch.equal(data.train_x[4], image("AnnualCrop/AnnualCrop_6.jpg"))
        assert torch.equal(data.test_x[0], image("AnnualCrop/AnnualCrop_5.jpg"))
        assert torch.equal(data.test_x[1], image("AnnualCrop/AnnualCrop_10.jpg"))
        assert torch.equal(data.test_x[-1], image("SeaLake/SeaLake_10.jpg"))


def test_decoded_folders_are_cached(tmp_path, cache_dir):
    a = load_dataset("cifar10", CIFAR10_ZIP, train_per_class=3, test_per_class=2, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("cifar10-*.pt"))) == 1
    b = load_dataset("cifar10", CIFAR10_ZIP, train_per_class=3, test_per_class=2, cache_dir=tmp_path)
    assert torch.equal(a.train_x, b.train_x) and a.class_names == b.class_names


def _rows(n, seed):
    return np.random.RandomState(seed).randint(0, 256, (n, 3072), dtype=np.uint8)


def test_cifar10_pickle_folder(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    for i in range(1, 6):
        with open(root / f"data_batch_{i}", "wb") as f:
            pickle.dump({b"data": _rows(20, i), b"labels": [j % 10 for j in range(20)]}, f)
    with open(root / "test_batch", "wb") as f:
        pickle.dump({b"data": _rows(10, 9), b"labels": list(range(10))}, f)
    with open(root / "batches.meta", "wb") as f:
        pickle.dump({b"label_names": [f"c{i}" for i in range(10)]}, f)
    # python-3 pickles of the real files have str keys; the loader reads both
    d = load_dataset("cifar10", root)
    assert d.train_x.shape == (100, 3, 32, 32) and d.test_x.shape == (10, 3, 32, 32)
    # rows are planar RGB: the first 1024 bytes are the red channel
    assert torch.equal(d.train_x[0, 0].flatten(), torch.from_numpy(_rows(20, 1)[0, :1024]))


def test_cifar100_pickle_folder_uses_fine_labels(tmp_path):
    root = tmp_path / "cifar-100-python"
    root.mkdir()
    for part, n in (("train", 200), ("test", 100)):
        with open(root / part, "wb") as f:
            pickle.dump({"data": _rows(n, n), "fine_labels": [i % 100 for i in range(n)],
                         "coarse_labels": [i % 20 for i in range(n)]}, f)
    with open(root / "meta", "wb") as f:
        pickle.dump({"fine_label_names": [f"f{i}" for i in range(100)]}, f)
    d = load_dataset("cifar100", root, train_per_class=1)
    assert d.num_classes == 100 and d.train_y.tolist() == list(range(100))
    assert len(d.tasks()) == 10 and d.tasks()[0] == list(range(10))


def test_mini_imagenet_pickles(tmp_path):
    rng = np.random.RandomState(0)
    wnid = 0
    for part, n_classes in (("train", 64), ("val", 16), ("test", 20)):
        data = rng.randint(0, 256, (n_classes * 6, 84, 84, 3), dtype=np.uint8)
        class_dict = {}
        for c in range(n_classes):
            class_dict[f"n{wnid:08d}"] = list(range(c * 6, c * 6 + 6))
            wnid += 1
        with open(tmp_path / f"mini-imagenet-cache-{part}.pkl", "wb") as f:
            pickle.dump({"image_data": data, "class_dict": class_dict}, f)
    d = load_dataset("mini-imagenet", tmp_path)
    assert d.class_names[0] == "n00000000" and d.class_names[64] == "n00000064"
    assert torch.bincount(d.test_y).tolist() == [1] * 100 and torch.bincount(d.train_y).tolist() == [5] * 100
    assert d.image_shape == (3, 84, 84)


def _png(color, size=(32, 32)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def test_image_folder_directory_with_train_and_test(tmp_path):
    for split in ("train", "test"):
        for c in range(10):
            (tmp_path / "data" / split / f"class{c}").mkdir(parents=True)
            for i in range(3):
                (tmp_path / "data" / split / f"class{c}" / f"{i}.png").write_bytes(_png((c * 20, i, 0)))
    d = load_dataset("cifar10", tmp_path / "data", cache_dir=tmp_path / "cache")
    assert d.train_x.shape == (30, 3, 32, 32) and int(d.train_x[3, 0, 0, 0]) == 20  # class1, first file


@pytest.mark.parametrize("problem", ["missing", "empty", "corrupt", "sizes", "classes", "name"])
def test_bad_paths_give_clear_errors(tmp_path, problem):
    root = tmp_path / "ds"
    if problem != "missing":
        root.mkdir()
    if problem in ("corrupt", "sizes", "classes"):
        for split in ("train", "test"):
            for c in range(10 if problem != "classes" else 3):
                (root / split / f"c{c}").mkdir(parents=True)
                (root / split / f"c{c}" / "a.png").write_bytes(_png((1, 2, 3)))
    if problem == "corrupt":
        (root / "train" / "c0" / "b.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    if problem == "sizes":
        (root / "train" / "c0" / "b.png").write_bytes(_png((1, 2, 3), (40, 40)))
    with pytest.raises(DatasetError) as err:
        load_dataset("cifar11" if problem == "name" else "cifar10", root, cache_dir=tmp_path / "cache")
    message = str(err.value)
    expected = {"missing": "does not exist", "empty": "no images", "corrupt": "cannot decode", "sizes": "expected 32x32",
                "classes": "needs 10 classes", "name": "unknown dataset"}[problem]
    assert expected in message


def test_task_stream_covers_each_task_once_in_batches(cifar10_slice):
    g = torch.Generator().manual_seed(0)
    seen = torch.cat([y for _, y in task_batches(cifar10_slice, [2, 3], 10, g)])
    assert seen.numel() == 500 and set(seen.tolist()) == {2, 3}
    x, y = task_test_set(cifar10_slice, [2, 3])
    assert x.shape == (200, 3, 32, 32) and set(y.tolist()) == {2, 3}


def test_one_class_batches_hold_one_class_each_in_turn(cifar10_slice):
    """A device that sees one class at a time: every batch is of one class, the classes alternate,
    and the task's samples all come, once."""
    batches = [y for _, y in task_batches(cifar10_slice, [2, 3], 10, torch.Generator().manual_seed(0), one_class=True)]
    assert all(y.unique().numel() == 1 for y in batches)
    assert [int(y[0]) for y in batches[:4]] == [2, 3, 2, 3]
    seen = torch.cat(batches)
    assert seen.numel() == 500 and (seen == 2).sum() == (cifar10_slice.train_y == 2).sum()


def test_mini_imagenet_travels_in_chunks_and_comes_back_whole(tmp_path, cache_dir):
    """scripts/mini-imagenet-chunks.sh on real Mini-ImageNet JPEGs (the slice), with 1 MiB parts:
    a missing part is named, and the parts unpacked give the folder back byte for byte, loadable."""
    import subprocess

    from .conftest import ROOT

    with zipfile.ZipFile(MINI_ZIP) as z:
        z.extractall(tmp_path)
    script, src, chunks = ROOT / "scripts" / "mini-imagenet-chunks.sh", tmp_path / "mini-imagenet", tmp_path / "chunks"
    env = {"CHUNK_MIB": "1", "PATH": "/usr/bin:/bin"}
    run = lambda *a: subprocess.run(["bash", str(script), *map(str, a)], env=env, capture_output=True, text=True)  # noqa: E731
    assert run("pack", src, chunks).returncode == 0
    parts = sorted(chunks.glob("part-*"))
    assert len(parts) > 3 and all(p.stat().st_size <= 1 << 20 for p in parts)
    parts[1].rename(tmp_path / "held-back")
    missing = run("status", chunks)
    assert missing.returncode == 3 and f"missing: {parts[1].name}" in missing.stdout
    assert run("unpack", chunks, tmp_path / "back").returncode == 3
    (tmp_path / "held-back").rename(parts[1])
    assert run("unpack", chunks, tmp_path / "back").returncode == 0
    originals = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    assert originals == sorted(p.relative_to(tmp_path / "back") for p in (tmp_path / "back").rglob("*") if p.is_file())
    assert all((src / p).read_bytes() == (tmp_path / "back" / p).read_bytes() for p in originals)
    assert load_dataset("mini-imagenet", tmp_path / "back", cache_dir=tmp_path / "decoded").num_classes > 0


def test_a_photo_set_is_read_as_the_service_reads_each_photo(camera_photos, tmp_path):
    """`photos`: real CIFAR-10 images brought to camera-like sizes and shapes, each read by the service's input rule."""
    zipped, sent = camera_photos
    data = load_dataset("photos", zipped, input_size=64, cache_dir=tmp_path / "cache")
    assert data.class_names == ["airplane", "cat", "frog"]
    assert data.train_x.shape == (15, 3, 64, 64) and data.test_x.shape == (3, 3, 64, 64)
    assert sorted(data.test_y.tolist()) == [0, 1, 2]
    first_train = min(n for n in sent if "/train/" in n)  # in the zip's order: airplane's first photo
    assert np.array_equal(data.train_x[0].numpy(), read_image(sent[first_train], 64)) and data.train_y[0] == 0
    assert data.tasks() == [[0, 1], [2]]  # two classes a task, as the client stream sends them
    again = load_dataset("photos", zipped, input_size=64, cache_dir=tmp_path / "cache")  # from the cache
    assert torch.equal(again.train_x, data.train_x)
    assert load_dataset("photos", zipped, input_size=32, cache_dir=tmp_path / "cache").train_x.shape[2:] == (32, 32)
    with pytest.raises(DatasetError, match="input_size"):
        load_dataset("photos", zipped)

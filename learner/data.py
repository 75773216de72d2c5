"""Datasets for the benchmarks and class-incremental streams over them.

Supported inputs (the format is recognised from the path):
- `cifar-10-batches-py/` (data_batch_1..5, test_batch) and `cifar-100-python/` (train, test,
  meta; fine labels), the standard python pickles;
- a Mini-ImageNet folder with `mini-imagenet-cache-{train,val,test}.pkl`
  (`image_data` [N, 84, 84, 3], `class_dict` {wnid: [indices]});
- an image folder, as a directory or a .zip: either `train/<class>/*` and `test/<class>/*`, or
  `<class>/*` alone (then 1/6 of each class is held out for testing, as the paper does for
  Mini-ImageNet). A `classes.txt` beside the class folders fixes the class order; otherwise
  it is the sorted folder names (which is CIFAR's standard order). EuroSAT's `<Class>/<Class>_<n>.jpg`
  ships no split: the shared one holds out every image whose n is a multiple of 5 (`EUROSAT_TEST_EVERY`).
- `photos`: an image folder of any number of classes, its photos of any size, each brought to `input_size` a side
  by the service's own input rule (`learner.formats.snapshot.read_image`); two classes a task, the last may hold one.

Images come out as uint8 [N, 3, H, W], labels as int64 class ids in the fixed class order, so
that task t holds classes [t * c, (t + 1) * c) as in the paper.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import pickle
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
TASKS = {"cifar10": 5, "cifar100": 10, "mini-imagenet": 10, "eurosat": 5}
CLASSES = {"cifar10": 10, "cifar100": 100, "mini-imagenet": 100, "eurosat": 10}
PHOTOS = "photos"  # a camera's photo set: any class count, any size (`load_dataset(..., input_size=)`)
# EuroSAT (Helber et al. 2019) ships no split: ../shared/datasets/README.md fixes one, the images numbered by a
# multiple of 5 held out (21,600 / 5,400), training images in the order of their number
EUROSAT_TEST_EVERY = 5
HOLDOUT_FRACTION = 1 / 6
SPLIT_SEED = 0  # the train/test division of folders without one is fixed, not per run


class DatasetError(ValueError):
    """A dataset path is missing or not in any layout this module reads."""


@dataclass
class ImageDataset:
    name: str
    train_x: torch.Tensor  # uint8 [N, 3, H, W]
    train_y: torch.Tensor  # int64 [N]
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])

    def tasks(self, n_tasks: int | None = None) -> list[list[int]]:
        """The paper's fixed split: consecutive class ids, equally many per task (a photo set: two a task)."""
        if self.name == PHOTOS and n_tasks is None:
            return [list(range(c, min(c + 2, self.num_classes))) for c in range(0, self.num_classes, 2)]
        n_tasks = n_tasks or TASKS.get(self.name, 1)
        if self.num_classes % n_tasks:
            raise DatasetError(f"{self.num_classes} classes cannot be split into {n_tasks} equal tasks")
        per = self.num_classes // n_tasks
        return [list(range(t * per, (t + 1) * per)) for t in range(n_tasks)]


def load_dataset(name: str, path: str | os.PathLike, train_per_class: int | None = None,
                 test_per_class: int | None = None, cache_dir: str | os.PathLike | None = None,
                 input_size: int | None = None) -> ImageDataset:
    """Load `name` (cifar10, cifar100, mini-imagenet, eurosat, or photos at `input_size`) from `path`,
    optionally a per-class slice."""
    if name not in CLASSES and name != PHOTOS:
        raise DatasetError(f"unknown dataset {name!r}; expected one of {', '.join([*CLASSES, PHOTOS])}")
    if (name == PHOTOS) != (input_size is not None):
        raise DatasetError(f"input_size brings a photo set's photos to one size: it goes with {PHOTOS!r} alone")
    path = Path(path)
    if not path.exists():
        raise DatasetError(f"dataset path {path} does not exist; expected {_expected(name)}")
    if name == PHOTOS:
        if not (path.is_dir() or zipfile.is_zipfile(path)):
            raise DatasetError(f"{path} is not a dataset this loader reads; expected {_expected(name)}")
        return _cached(path, name, train_per_class, test_per_class, cache_dir, input_size)
    if path.is_dir() and (path / "data_batch_1").exists():
        data = _cifar10_pickles(path, name)
    elif path.is_dir() and (path / "train").is_file() and (path / "meta").is_file():
        data = _cifar100_pickles(path, name)
    elif path.is_dir() and (path / "mini-imagenet-cache-train.pkl").exists():
        data = _mini_imagenet_pickles(path, name)
    elif path.is_dir() or (path.is_file() and zipfile.is_zipfile(path)):
        return _cached(path, name, train_per_class, test_per_class, cache_dir)
    else:
        raise DatasetError(f"{path} is not a dataset this loader reads; expected {_expected(name)}")
    return _check(_slice(data, train_per_class, test_per_class), name)


def _expected(name: str) -> str:
    folder = "an image folder or .zip with train/<class>/ and test/<class>/ (or <class>/ alone)"
    if name == PHOTOS:
        return folder
    pickles = {"cifar10": "a cifar-10-batches-py/ folder", "cifar100": "a cifar-100-python/ folder",
               "mini-imagenet": "a folder with mini-imagenet-cache-{train,val,test}.pkl",
               "eurosat": "EuroSAT RGB's <Class>/<Class>_<n>.jpg"}[name]
    return f"{pickles}, or {folder}"


def _check(data: ImageDataset, name: str) -> ImageDataset:
    if name != PHOTOS and data.num_classes != CLASSES[name]:
        raise DatasetError(f"{name} needs {CLASSES[name]} classes, found {data.num_classes}: "
                           f"{', '.join(data.class_names[:12])}{' ...' if data.num_classes > 12 else ''}")
    return data


# --- pickles -------------------------------------------------------------------------------
def _unpickle(path: Path) -> dict:
    if not path.exists():
        raise DatasetError(f"missing file {path}")
    with open(path, "rb") as f:
        try:
            d = pickle.load(f, encoding="latin1")
        except Exception as exc:  # corrupt or foreign file
            raise DatasetError(f"{path} is not a readable pickle: {exc}") from exc
    if not isinstance(d, dict):
        raise DatasetError(f"{path}: expected a pickled dict, got {type(d).__name__}")
    # the original files are Python 2 pickles (str keys); re-pickled copies may have bytes keys
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in d.items()}


def _rows_to_images(rows, where: Path) -> torch.Tensor:
    arr = np.asarray(rows, dtype=np.uint8)
    if arr.ndim != 2 or arr.shape[1] != 3072:
        raise DatasetError(f"{where}: expected 'data' rows of 3072 uint8 (3x32x32 planar RGB), got {arr.shape}")
    return torch.from_numpy(arr.reshape(-1, 3, 32, 32).copy())


def _cifar10_pickles(root: Path, name: str) -> ImageDataset:
    xs, ys = [], []
    for i in range(1, 6):
        d = _unpickle(root / f"data_batch_{i}")
        xs.append(_rows_to_images(d["data"], root / f"data_batch_{i}"))
        ys += list(d["labels"])
    t = _unpickle(root / "test_batch")
    meta = root / "batches.meta"
    names = _unpickle(meta)["label_names"] if meta.exists() else [str(i) for i in range(10)]
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    return ImageDataset(name, torch.cat(xs), torch.tensor(ys), _rows_to_images(t["data"], root / "test_batch"),
                        torch.tensor(list(t["labels"])), list(names))


def _cifar100_pickles(root: Path, name: str) -> ImageDataset:
    tr, te, meta = _unpickle(root / "train"), _unpickle(root / "test"), _unpickle(root / "meta")
    for part, d in (("train", tr), ("test", te)):
        if "fine_labels" not in d or "data" not in d:
            raise DatasetError(f"{root / part}: expected keys 'data' and 'fine_labels'")
    return ImageDataset(name, _rows_to_images(tr["data"], root / "train"), torch.tensor(tr["fine_labels"]),
                        _rows_to_images(te["data"], root / "test"), torch.tensor(te["fine_labels"]),
                        list(meta.get("fine_label_names", [str(i) for i in range(100)])))


def _mini_imagenet_pickles(root: Path, name: str) -> ImageDataset:
    images, labels, names = [], [], []
    for part in ("train", "val", "test"):
        d = _unpickle(root / f"mini-imagenet-cache-{part}.pkl")
        if "image_data" not in d or "class_dict" not in d:
            raise DatasetError(f"{root}/mini-imagenet-cache-{part}.pkl: expected keys 'image_data' and 'class_dict'")
        data = np.asarray(d["image_data"], dtype=np.uint8)
        if data.ndim != 4 or data.shape[3] != 3:
            raise DatasetError(f"mini-imagenet-cache-{part}.pkl: image_data must be [N, H, W, 3], got {data.shape}")
        for wnid, idx in d["class_dict"].items():
            images.append(torch.from_numpy(data[np.asarray(idx)]).permute(0, 3, 1, 2).contiguous())
            labels.append(torch.full((len(idx),), len(names), dtype=torch.long))
            names.append(wnid)
    return _holdout(name, torch.cat(images), torch.cat(labels), names)


def _holdout(name: str, x: torch.Tensor, y: torch.Tensor, names: list[str]) -> ImageDataset:
    """Hold out 1/6 of every class for testing, chosen by a fixed permutation."""
    rng = np.random.RandomState(SPLIT_SEED)
    train_idx, test_idx = [], []
    for c in range(len(names)):
        idx = torch.nonzero(y == c).flatten().numpy()
        idx = idx[rng.permutation(len(idx))]
        n_test = int(len(idx) * HOLDOUT_FRACTION)
        test_idx.append(np.sort(idx[:n_test]))
        train_idx.append(np.sort(idx[n_test:]))
    tr, te = torch.from_numpy(np.concatenate(train_idx)), torch.from_numpy(np.concatenate(test_idx))
    return ImageDataset(name, x[tr], y[tr], x[te], y[te], names)


def _slice(data: ImageDataset, train_per_class: int | None, test_per_class: int | None) -> ImageDataset:
    def take(x, y, n):
        if n is None:
            return x, y
        keep = torch.cat([torch.nonzero(y == c).flatten()[:n] for c in range(data.num_classes)]).sort().values
        return x[keep], y[keep]

    data.train_x, data.train_y = take(data.train_x, data.train_y, train_per_class)
    data.test_x, data.test_y = take(data.test_x, data.test_y, test_per_class)
    return data


# --- image folders and zips ------------------------------------------------------------------
class _Tree:
    """Read-only view of a directory or a zip archive as relative POSIX paths."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path) if path.is_file() else None
        if self.zip is not None:
            self.files = [n for n in self.zip.namelist() if not n.endswith("/")]
        else:
            self.files = [str(PurePosixPath(p.relative_to(path))) for p in path.rglob("*") if p.is_file()]

    def read(self, rel: str) -> bytes:
        if self.zip is not None:
            return self.zip.read(rel)
        return (self.path / rel).read_bytes()


def _layout(tree: _Tree) -> tuple[str, bool]:
    """Find the folder that holds the classes: returns (prefix, has_train_test)."""
    dirs = {str(PurePosixPath(f).parent) for f in tree.files if f.lower().endswith(IMAGE_SUFFIXES)}
    for d in sorted(dirs, key=len):
        parts = PurePosixPath(d).parts
        if len(parts) >= 2 and parts[-2] == "train":
            prefix = "/".join(parts[:-2])
            if any(x.startswith(_join(prefix, "test/")) for x in dirs):
                return prefix, True
    parents = {str(PurePosixPath(d).parent) for d in dirs}
    if not parents:
        raise DatasetError(f"{tree.path}: no images ({', '.join(IMAGE_SUFFIXES)}) found")
    prefix = min(parents, key=len)
    return ("" if prefix == "." else prefix), False


def _join(prefix: str, rest: str) -> str:
    return f"{prefix}/{rest}" if prefix else rest


def _class_files(tree: _Tree, prefix: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    base = _join(prefix, "")
    for f in tree.files:
        if f.startswith(base) and f.lower().endswith(IMAGE_SUFFIXES):
            parts = f[len(base):].split("/")
            if len(parts) == 2:
                out.setdefault(parts[0], []).append(f)
    return {c: sorted(v) for c, v in out.items()}


def _class_order(tree: _Tree, prefix: str, found: list[str]) -> list[str]:
    listing = _join(prefix, "classes.txt")
    if listing in tree.files:
        order = [line.strip() for line in tree.read(listing).decode().splitlines() if line.strip()]
        missing = [c for c in order if c not in found]
        if missing:
            raise DatasetError(f"{tree.path}: classes.txt names classes with no images: {', '.join(missing[:5])}")
        return order
    return sorted(found)


def _decode(tree: _Tree, files: list[str], size: int | None = None) -> torch.Tensor:
    """The files' images as uint8 [N, 3, H, W], all of one size, or each brought to `size` a side by the
    service's input rule."""
    from PIL import Image

    from .formats.snapshot import read_image

    arrays, shape = [], None
    for f in files:
        try:
            if size is not None:
                arr = read_image(tree.read(f), size).transpose(1, 2, 0)
            else:
                with Image.open(io.BytesIO(tree.read(f))) as im:
                    arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
        except Exception as exc:
            raise DatasetError(f"{tree.path}: cannot decode {f}: {exc}") from exc
        if shape is None:
            shape = arr.shape
        elif arr.shape != shape:
            raise DatasetError(f"{tree.path}: {f} is {arr.shape[1]}x{arr.shape[0]}, expected {shape[1]}x{shape[0]} "
                               "like the other images")
        arrays.append(arr)
    if not arrays:
        return torch.zeros((0, 3, 1, 1), dtype=torch.uint8)
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def _image_folder(path: Path, name: str, train_per_class: int | None, test_per_class: int | None,
                  size: int | None = None) -> ImageDataset:
    tree = _Tree(path)
    prefix, has_split = _layout(tree)
    if has_split:
        train = _class_files(tree, _join(prefix, "train"))
        test = _class_files(tree, _join(prefix, "test"))
        names = _class_order(tree, prefix, sorted(train))
        if set(test) != set(train):
            raise DatasetError(f"{path}: train/ and test/ hold different classes")
        parts = []
        for files, limit in ((train, train_per_class), (test, test_per_class)):
            chosen = [files[c][:limit] for c in names]
            parts.append((_decode(tree, sum(chosen, []), size),
                          torch.cat([torch.full((len(f),), i, dtype=torch.long) for i, f in enumerate(chosen)])))
        (trx, try_), (tex, tey) = parts
        return ImageDataset(name, trx, try_, tex, tey, names)
    classes = _class_files(tree, prefix)
    names = _class_order(tree, prefix, sorted(classes))
    files = [classes[c] for c in names]
    if name == "eurosat":
        return _slice(_numbered_split(tree, name, files, names), train_per_class, test_per_class)
    x = _decode(tree, sum(files, []), size)
    y = torch.cat([torch.full((len(f),), i, dtype=torch.long) for i, f in enumerate(files)])
    return _slice(_holdout(name, x, y, names), train_per_class, test_per_class)


def _file_number(tree: _Tree, file: str) -> int:
    match = re.search(r"_(\d+)\.[^./]+$", file)
    if match is None:
        raise DatasetError(f"{tree.path}: {file} is not named <Class>_<n>.<ext> as EuroSAT's files are")
    return int(match.group(1))


def held_out_by_number(number: int) -> bool:
    """EuroSAT's shared split: a file numbered by a multiple of EUROSAT_TEST_EVERY is a test image."""
    return number % EUROSAT_TEST_EVERY == 0


def _numbered_split(tree: _Tree, name: str, files: list[list[str]], names: list[str]) -> ImageDataset:
    """Every class's files in the order of their number; those numbered by a multiple of
    EUROSAT_TEST_EVERY are the test set."""
    parts = {True: ([], []), False: ([], [])}
    for c, class_files in enumerate(files):
        for f in sorted(class_files, key=lambda f: _file_number(tree, f)):
            held_out = held_out_by_number(_file_number(tree, f))
            parts[held_out][0].append(f)
            parts[held_out][1].append(c)
    (train, train_y), (test, test_y) = parts[False], parts[True]
    return ImageDataset(name, _decode(tree, train), torch.tensor(train_y), _decode(tree, test), torch.tensor(test_y),
                        names)


def default_cache_dir() -> Path:
    return Path(os.environ.get("ASER_CACHE_DIR", Path.home() / ".cache" / "aser"))


def _cached(path: Path, name: str, train_per_class, test_per_class, cache_dir, size: int | None = None) -> ImageDataset:
    """Decoding tens of thousands of JPEGs takes a while: keep the uint8 arrays in a cache
    (outside the repository), keyed by the file's identity, the slice and the size photos are brought to."""
    stat = path.stat()
    identity = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, name, train_per_class, test_per_class, 2)
    key = hashlib.sha256(repr(identity + ((size,) if size is not None else ())).encode()).hexdigest()[:20]
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    file = cache / f"{name}-{key}.pt"
    if file.exists():
        try:
            d = torch.load(file, weights_only=True)
            return _check(ImageDataset(name, d["train_x"], d["train_y"], d["test_x"], d["test_y"],
                                       list(d["class_names"])), name)
        except Exception:
            file.unlink(missing_ok=True)  # a torn or stale cache file is simply rebuilt
    data = _check(_image_folder(path, name, train_per_class, test_per_class, size), name)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{os.getpid()}")
        torch.save({"train_x": data.train_x, "train_y": data.train_y, "test_x": data.test_x,
                    "test_y": data.test_y, "class_names": data.class_names}, tmp)
        os.replace(tmp, file)
    except OSError:
        pass  # a read-only cache location only costs decode time
    return data


# --- streams -----------------------------------------------------------------------------------
def task_batches(data: ImageDataset, classes: list[int], batch_size: int, generator: torch.Generator,
                 one_class: bool = False):
    """One task's training samples, shuffled, in mini-batches (the last one may be smaller).

    `one_class`: every batch holds a single class (a device that sees one class at a time); the
    task's classes take turns, batch by batch, until each has run out.
    """
    if not one_class:
        idx = torch.nonzero(torch.isin(data.train_y, torch.tensor(classes))).flatten()
        blocks = _blocks(idx[torch.randperm(idx.numel(), generator=generator)], batch_size)
    else:
        per_class = [torch.nonzero(data.train_y == c).flatten() for c in classes]
        per_class = [_blocks(i[torch.randperm(i.numel(), generator=generator)], batch_size) for i in per_class]
        blocks = [b for turn in itertools.zip_longest(*per_class) for b in turn if b is not None]
    for b in blocks:
        yield data.train_x[b], data.train_y[b]


def _blocks(idx: torch.Tensor, size: int) -> list[torch.Tensor]:
    return [idx[i:i + size] for i in range(0, idx.numel(), size)]


def task_test_set(data: ImageDataset, classes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.nonzero(torch.isin(data.test_y, torch.tensor(classes))).flatten()
    return data.test_x[idx], data.test_y[idx]

"""Shared fixtures: small slices of the real CIFAR-10 and Mini-ImageNet data in ../shared."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# ../shared/datasets beside the checkout, or a copy elsewhere (the GPU machine gets a carried one)
DATASETS = Path(os.environ.get("ASER_TEST_DATASETS", ROOT.parent / "shared" / "datasets"))
CIFAR10_ZIP = DATASETS / "cifar10-jpeg.zip"
MINI_ZIP = DATASETS / "mini-imagenet-slice.zip"
EUROSAT_ZIP = DATASETS / "eurosat-rgb.zip"


def pytest_configure(config):
    """Under pytest-xdist (`scripts/test.sh` runs two workers) the workers share the cores: one thread each, and the
    services and programs they start likewise (torch reads OMP_NUM_THREADS as it starts). Two threads each would
    oversubscribe the cores, where OpenMP's threads spin at every barrier."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch

        torch.set_num_threads(1)


@pytest.fixture(scope="module")
def jpegs():
    """Real CIFAR-10 JPEG files: 20 airplanes, 20 frogs."""
    with zipfile.ZipFile(CIFAR10_ZIP) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".jpg") and n.startswith("cifar10/train/"))
        pick = [n for n in names if "/airplane/" in n][:20] + [n for n in names if "/frog/" in n][:20]
        return [(n.split("/")[2], z.read(n)) for n in pick]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("decoded")


@pytest.fixture(scope="session")
def cifar10_slice(cache_dir):
    """250 training and 100 test images of each CIFAR-10 class (real JPEG data)."""
    from learner.data import load_dataset

    if not CIFAR10_ZIP.exists():
        pytest.fail(f"missing {CIFAR10_ZIP}: the tests need ../shared/datasets beside the checkout")
    return load_dataset("cifar10", CIFAR10_ZIP, train_per_class=250, test_per_class=100, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def cifar10_more(cache_dir):
    """500 training and 100 test images of each CIFAR-10 class, for learning checks."""
    from learner.data import load_dataset

    return load_dataset("cifar10", CIFAR10_ZIP, train_per_class=500, test_per_class=100, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def eurosat_latents(cache_dir):
    """Split EuroSAT, 120 training and 40 test tiles a class, as cut-11 latents at 64 px, and the backbone."""
    from clients.bench.stream.latents import encoded_dataset
    from learner.data import load_dataset
    from learner.networks.backbone import make_backbone

    data = load_dataset("eurosat", EUROSAT_ZIP, train_per_class=120, test_per_class=40, cache_dir=cache_dir)
    backbone = make_backbone("lite0", data.image_shape, 64, 11, 16)
    return encoded_dataset(data, backbone, cache_dir), backbone


# The longest a request to a test server may take on a busy machine: DELETE /classes and POST
# /snapshots wait up to ASER_SNAPSHOT_TIMEOUT_S (120 s) for the worker; httpx's default is 5 s.
HTTP_TIMEOUT_S = 180.0


@pytest.fixture(scope="session", autouse=True)
def patient_http_calls():
    """Every module-level httpx call of the tests waits as long as the server may take, unless
    the call says otherwise (shared machines are never quiet)."""
    import functools

    import httpx

    patched = {}
    for name in ("request", "get", "post", "put", "patch", "delete", "head", "options", "stream"):
        original = patched[name] = getattr(httpx, name)

        @functools.wraps(original)
        def patient(*args, _original=original, **kwargs):
            kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
            return _original(*args, **kwargs)

        setattr(httpx, name, patient)
    yield
    for name, original in patched.items():
        setattr(httpx, name, original)


@pytest.fixture(scope="session")
def camera_photos(tmp_path_factory):
    """A photo set as a camera gives one: 18 real CIFAR-10 images of 3 classes brought to 320x240, 240x320 and
    500x333 JPEGs, zipped as set/{train,test}/<class>/ (3 test photos); the zip, and each photo's bytes by name."""
    import io
    import zipfile

    from PIL import Image

    from clients.bench.live.local_service import real_jpegs

    zipped, sent = tmp_path_factory.mktemp("photos") / "photos.zip", {}
    with zipfile.ZipFile(zipped, "w") as z:
        for i, (label, jpeg) in enumerate(real_jpegs(CIFAR10_ZIP, 18, classes=["airplane", "cat", "frog"])):
            out = io.BytesIO()
            Image.open(io.BytesIO(jpeg)).resize([(320, 240), (240, 320), (500, 333)][i % 3]).save(out, "JPEG", quality=90)
            name = f"set/{'test' if i in (3, 4, 5) else 'train'}/{label}/{i:03d}.jpg"
            z.writestr(name, out.getvalue())
            sent[name] = out.getvalue()
    return zipped, sent

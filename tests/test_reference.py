"""Reference (a)'s photo sets (`clients.bench.reference --dataset photos`): photos of any size and shape, read by
the service's own input rule, on real CIFAR-10 images brought to camera-like sizes."""

import io
import zipfile

import numpy as np
from PIL import Image

from clients.bench.local_service import real_jpegs
from clients.bench.reference import photo_dataset, tasks_of
from learner.formats.snapshot import read_image

from .conftest import CIFAR10_ZIP

SIZES = [(320, 240), (240, 320), (500, 333)]


def test_a_photo_set_is_read_as_the_service_reads_each_photo(tmp_path):
    photos = real_jpegs(CIFAR10_ZIP, 18, classes=["airplane", "cat", "frog"])
    zipped = tmp_path / "photos.zip"
    sent = {}
    with zipfile.ZipFile(zipped, "w") as z:
        for i, (label, jpeg) in enumerate(photos):
            out = io.BytesIO()
            Image.open(io.BytesIO(jpeg)).resize(SIZES[i % 3]).save(out, "JPEG", quality=90)
            name = f"set/{'test' if i in (3, 4, 5) else 'train'}/{label}/{i:03d}.jpg"
            z.writestr(name, out.getvalue())
            sent[name] = out.getvalue()
    data = photo_dataset(str(zipped), 64)
    assert data.class_names == ["airplane", "cat", "frog"]
    assert data.train_x.shape == (15, 3, 64, 64) and data.test_x.shape == (3, 3, 64, 64)
    assert sorted(data.test_y.tolist()) == [0, 1, 2]
    first_train = min(n for n in sent if "/train/" in n)  # in the zip's order: airplane's first photo
    assert np.array_equal(data.train_x[0].numpy(), read_image(sent[first_train], 64)) and data.train_y[0] == 0
    assert tasks_of(data) == [[0, 1], [2]]  # two classes a task, as the client stream sends them

"""ONNX export: onnxruntime on a snapshot gives the PyTorch model's logits on real images."""

from __future__ import annotations

import numpy as np
import torch

from clients.onnx_client import OnnxClassifier
from learner import make_learner
from learner.data import task_batches
from service.storage.snapshots import PixelsToLogits, export_onnx


def test_onnx_logits_match_pytorch_on_real_images(cifar10_slice, tmp_path):
    data = cifar10_slice
    learner = make_learner("er", num_classes=10, mem_size=200, seed=0)
    for i, (x, y) in enumerate(task_batches(data, list(range(10)), 10, torch.Generator().manual_seed(0))):
        learner.observe(x, y)
        if i == 30:
            break
    classes = data.class_names
    export_onnx(PixelsToLogits(learner.model, list(range(len(classes)))), classes, tmp_path / "m.onnx",
                {"model_version": learner.version})
    clf = OnnxClassifier(tmp_path / "m.onnx")
    assert clf.labels == classes and clf.input_shape == (3, 32, 32) and clf.model_version == learner.version

    images = data.test_x[:200]
    theirs = clf.logits(images.numpy())
    ours = learner.logits(images).numpy()
    diff = float(np.abs(theirs - ours).max())
    print(f"max |onnxruntime - pytorch| logit difference on 200 CIFAR-10 test images: {diff:.2e}")
    assert diff < 1e-3 and (theirs.argmax(1) == ours.argmax(1)).mean() > 0.99
    # training went on after the export: the file is unaffected by later steps
    learner.observe(*next(iter(task_batches(data, [0, 1], 10, torch.Generator().manual_seed(1)))))
    assert np.array_equal(OnnxClassifier(tmp_path / "m.onnx").logits(images.numpy()), theirs)


def test_the_onnx_client_downloads_and_predicts_without_torch_or_httpx(cifar10_slice, tmp_path):
    """`python -m clients.onnx_client --url` with torch and httpx unimportable: onnxruntime, numpy,
    Pillow and the standard library are all it needs. The snapshot is served by a plain HTTP server
    on loopback, as the service serves `/snapshots/latest`."""
    import functools
    import http.server
    import json
    import subprocess
    import sys
    import threading

    from .conftest import ROOT

    learner = make_learner("er", num_classes=10, mem_size=50, seed=0)
    learner.observe(*next(iter(task_batches(cifar10_slice, [0, 1], 10, torch.Generator().manual_seed(0)))))
    (tmp_path / "snapshots").mkdir()
    export_onnx(PixelsToLogits(learner.model, list(range(10))), cifar10_slice.class_names,
                tmp_path / "snapshots" / "latest", {"model_version": learner.version})
    from PIL import Image

    Image.fromarray(cifar10_slice.test_x[0].permute(1, 2, 0).numpy()).save(tmp_path / "a.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        code = ("import sys; sys.modules['torch'] = None; sys.modules['httpx'] = None\n"
                "from clients.onnx_client import main\n"
                f"sys.exit(main(['--url', 'http://127.0.0.1:{httpd.server_port}', {str(tmp_path / 'a.png')!r}]))")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        httpd.shutdown()
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.splitlines()[0])
    assert answer["model_version"] == learner.version and len(answer["top"]) == 3
    assert answer["top"][0]["label"] in cifar10_slice.class_names

"""Micro-batched predictions on a real server: concurrent requests share forward passes and get
the same answers as one at a time."""

import re
from concurrent.futures import ThreadPoolExecutor

from clients.api import ServiceClient
from clients.bench.live.local_service import real_jpegs

from .conftest import CIFAR10_ZIP
from .test_forget import wait_idle
from .test_service import Server


def batches_and_images(metrics: str) -> tuple[float, float]:
    count = float(re.search(r"^aser_predict_batch_images_count (\S+)", metrics, re.M).group(1))
    total = float(re.search(r"^aser_predict_batch_images_sum (\S+)", metrics, re.M).group(1))
    return count, total


def test_concurrent_predictions_share_passes_and_equal_single_ones(tmp_path):
    server = Server(tmp_path / "svc", method="er", mem_size=50, predict_batch_wait_ms=20).start()
    try:
        with ServiceClient(server.url) as client:
            client.stream_samples(real_jpegs(CIFAR10_ZIP, 200, classes=["airplane", "frog", "cat", "ship"]))
            wait_idle(client)
            images = [data for _, data in real_jpegs(CIFAR10_ZIP, 48, split="test")]
            alone = [client.predict_one(image, k=4) for image in images]  # one at a time
            before = batches_and_images(client.metrics())

            with ThreadPoolExecutor(16) as pool:
                together = list(pool.map(lambda image: ServiceClient(server.url).predict_one(image, k=4), images))
            after = batches_and_images(client.metrics())
    finally:
        server.stop()
    passes, predicted = after[0] - before[0], after[1] - before[1]
    assert predicted == len(images) and passes < len(images)  # some requests shared a pass
    for one, shared in zip(alone, together):
        assert one["model_version"] == shared["model_version"]
        assert [r["label"] for r in one["top"]] == [r["label"] for r in shared["top"]]
        for a, b in zip(one["top"], shared["top"]):
            assert abs(a["probability"] - b["probability"]) < 1e-4

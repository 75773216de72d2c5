"""A fresh service on its defaults serves a useful model from its first tasks (issue 39, item 1):
three tasks of two CIFAR-10 classes, 150 real images a class, through a real server. The moving
average's warm-up (`learner/heads/ema.py`) forgets the near-random early weights fast (the plain mean it
replaced answered one class for every image after each task); the logit bias fitted on the memory
(`ASER_SERVING_BIAS`, on by default) gives back the newest classes, which the average alone never
answered after the third task (`benchmark young`: 0 of 5 seeds)."""

import zipfile
from collections import Counter

import httpx

from .conftest import CIFAR10_ZIP
from .test_service import Server, wait_trained

CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog"]
# an old class of the third task answers 1-2% of its own images here (bird 2 and cat 3 of 40 in one run, cat 0 of
# 40 in another): 200 images a class make "some of its own" a property of the model, not of the draw
TEST_PER_CLASS = 200


def images(split: str, per_class: int) -> dict[str, list[bytes]]:
    with zipfile.ZipFile(CIFAR10_ZIP) as z:
        names = sorted(n for n in z.namelist() if n.startswith(f"cifar10/{split}/") and n.endswith(".jpg"))
        return {c: [z.read(n) for n in names if f"/{c}/" in n][:per_class] for c in CLASSES}


def test_a_young_service_answers_the_classes_it_has_seen(tmp_path):
    train, test = images("train", 150), images("test", TEST_PER_CLASS)
    server = Server(tmp_path / "svc", mem_size=1000).start()  # the defaults: cb-sv-duel and its options
    try:
        sent = 0
        for task in range(3):
            seen = CLASSES[: 2 * task + 2]
            new = CLASSES[2 * task: 2 * task + 2]
            samples = [(c, img) for i in range(150) for c in new for img in [train[c][i]]]  # classes interleaved
            for j in range(0, len(samples), 50):
                files = [("image", (f"{k}.jpg", img, "image/jpeg")) for k, (_, img) in enumerate(samples[j:j + 50])]
                labels = [c for c, _ in samples[j:j + 50]]
                assert httpx.post(f"{server.url}/samples", files=files, data={"label": labels}).status_code == 201
            sent += len(samples)
            wait_trained(server, sent, timeout=600)
            answers, right, own = Counter(), 0, Counter()
            for c in seen:
                files = [("image", (f"{k}.jpg", img, "image/jpeg")) for k, img in enumerate(test[c])]
                results = httpx.post(f"{server.url}/predict", files=files, data={"k": "1"}).json()["results"]
                top = [r[0]["label"] for r in results]
                answers.update(top)
                right += sum(t == c for t in top)
                own[c] = sum(t == c for t in top)
            accuracy, chance = right / (TEST_PER_CLASS * len(seen)), 1 / len(seen)
            answered = [c for c in seen if answers[c] > 0]
            # one standard deviation of the accuracy over these images is 2-3 points
            assert accuracy > chance + 0.05 if task == 0 else accuracy > 1.3 * chance, (task, accuracy, answers)
            assert answered == seen, (task, answers)  # every class it has seen, the newest too
            assert all(own[c] > 0 for c in seen), (task, own)  # each for some of its own images
    finally:
        server.stop()

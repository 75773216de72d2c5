"""Sleep (learner.methods.sleep): the top trained over the latents of every sample while the device is idle. In
process on a slice of Split EuroSAT, then through a real service: a sleep raises the held-back accuracy, ingest
preempts it, a SIGKILL mid-sleep loses nothing."""

from __future__ import annotations

import base64
import subprocess
import sys
import time

import httpx
import pytest
import torch

from clients.bench.live.local_service import real_jpegs
from clients.cli import status_lines

from .conftest import EUROSAT_ZIP
from .test_service import Server, status

CLASSES = ["AnnualCrop", "Forest", "Highway", "SeaLake"]


def sleeping_learner(backbone, train_every: int = 0, **sleep):
    from learner import make_learner
    from learner.methods.sleep import SleepConfig

    return make_learner("cb-sv-duel", 4, mem_size=100, loss="ace", lr=0.01, ema_decay=0.99, backbone=backbone,
                        serving_head="slda", choose_head="held-back", head_prior="pool", train_every=train_every,
                        sleep=SleepConfig(**sleep), seed=0)


def stream(learner, data, classes=(0, 1, 2, 3)):
    from learner.data import task_batches

    for x, y in task_batches(data, list(classes), 10, torch.Generator().manual_seed(0)):
        learner.observe(x, y)


@pytest.fixture(scope="module")
def streamed(eurosat_latents) -> dict:
    """A sleeping learner's state after the 4 classes' stream, awake all along."""
    learner = sleeping_learner(eurosat_latents[1])
    stream(learner, eurosat_latents[0])
    return learner.state_dict()


def after_the_stream(backbone, streamed: dict, **sleep):
    learner = sleeping_learner(backbone, **sleep)
    learner.load_state_dict(streamed)
    return learner


def top_accuracy(learner, data) -> float:
    keep = data.test_y < 4
    probabilities = learner.candidate_probabilities(data.test_x[keep])
    return float((probabilities["top"].argmax(1) == data.test_y[keep]).float().mean())


def test_a_sleep_teaches_the_top_what_the_store_holds_and_keeps_what_the_held_back_samples_allow(eurosat_latents,
                                                                                                  streamed):
    data, backbone = eurosat_latents
    assert streamed["steps"] == 48 and streamed["version"] == 0  # awake, the top never stepped
    learner = after_the_stream(backbone, streamed, epochs=3)
    held = len(learner.head_choice.held)
    assert len(learner.sleeper.store) == 480 - held and learner.sleeper.new_samples == 480 - held
    assert learner.head_choice.top_classes == set()  # so no class is the top's yet
    before = top_accuracy(learner, data)
    report = learner.sleep()
    assert report.budget == 3 * (480 - held) and report.updates == report.budget and report.kept
    assert report.held_after >= report.held_before - 0.05 and report.classes == [0, 1, 2, 3]
    after = top_accuracy(learner, data)
    assert before < 0.5 < 0.8 < after, (before, after)  # a random head, then a top trained on every class
    assert learner.head_choice.top_classes == {0, 1, 2, 3} and learner.sleeper.new_samples == 0
    assert learner.sleep().updates == 0  # nothing new: nothing to do


def test_a_sleep_in_micro_batches_steps_the_top_as_the_whole_batch_does(eurosat_latents, streamed):
    """A batch forwarded and backpropagated a micro-batch at a time (the saved activations a micro-batch's) takes the
    step the whole batch takes at once: the same weights, to float rounding."""
    data = eurosat_latents[0]
    x, y = data.train_x[::15][:32], data.train_y[::15][:32]  # stored latents of the 4 classes
    tops = []
    for micro_batch in (32, 7):
        learner = after_the_stream(eurosat_latents[1], streamed, micro_batch=micro_batch)
        before = torch.cat([p.detach().flatten() for p in learner.model.parameters()])
        learner.model.train()
        learner.sleeper.step(learner, list(learner.model.parameters()), x, y, learner.sleeper.config.lr)
        tops.append(torch.cat([p.detach().flatten() for p in learner.model.parameters()]))
    moved = (tops[0] - before).abs().max()
    assert len(set(y.tolist())) == 4 and moved > 1e-4
    assert (tops[0] - tops[1]).abs().max() < 1e-3 * moved, (moved, (tops[0] - tops[1]).abs().max())


def test_a_cosine_sleep_anneals_its_rate_to_zero_over_its_budget_and_the_service_can_ask_for_it(eurosat_latents,
                                                                                              streamed):
    from service.learning.lineage import describe_learner
    from service.settings import Settings

    learner = after_the_stream(eurosat_latents[1], streamed, epochs=1, schedule="cosine")
    rates, step = [], learner.sleeper.step
    learner.sleeper.step = lambda learner, params, x, y, lr: rates.append(lr) or step(learner, params, x, y, lr)
    report = learner.sleep()
    assert report.updates == report.budget and len(rates) == report.steps > 10
    assert rates[0] == 0.01 and rates[-1] < 0.001 and all(a > b for a, b in zip(rates, rates[1:]))
    spec = describe_learner(Settings(sleep=True, sleep_schedule="cosine", device="cpu"), None)
    assert spec.sleep_config().schedule == "cosine" and spec.config()["sleep_schedule"] == "cosine"


def test_a_shuffled_sleep_takes_passes_over_everything_held_from_where_the_top_is(eurosat_latents, streamed):
    """The "shuffled" draw: a warm sleep's batches are shuffled passes without replacement, as (b) takes them (every
    stored sample once a pass), in the warm sleep's batches of 32, a warm sleep all the same."""
    from service.learning.lineage import describe_learner
    from service.settings import Settings

    learner = after_the_stream(eurosat_latents[1], streamed, epochs=1, draw="shuffled")
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    read, drawn = learner.sleeper._read, []
    learner.sleeper._read = lambda learner, slots: drawn.append(slots) or read(learner, slots)
    held = len(learner.sleeper.store)
    report = learner.sleep(budget=held + 5)  # a pass and 5 slots of the next
    slots = torch.cat(drawn).tolist()
    assert not report.fresh and report.updates == held + 5 and report.steps == -(-(held + 5) // 32)
    assert sorted(slots[:held]) == list(range(held)) and len(set(slots[held:])) == 5
    head = next(k for k in weights if k.startswith("head") and k.endswith("weight"))
    assert not torch.equal(learner.model.state_dict()[head], weights[head]) and report.kept
    with pytest.raises(ValueError, match="source 'store'"):
        sleeping_learner(eurosat_latents[1], draw="shuffled", source="memory")
    spec = describe_learner(Settings(sleep=True, sleep_draw="shuffled", sleep_fresh_epochs=6, device="cpu"), None)
    assert spec.sleep_config().draw == "shuffled" and spec.config()["sleep_draw"] == "shuffled"
    assert spec.sleep_config().fresh_epochs == 6 and spec.config()["sleep_fresh_epochs"] == 6


def test_awake_asers_values_read_the_frozen_features_the_batch_already_has(eurosat_latents, streamed):
    """With the top trained only in sleeps, the memory's KNN-SVs are taken on the frozen network's pooled features
    (those streaming LDA reads): the memory's cached features are exactly them, under the frozen space's version,
    and a slot the step filled has them from the batch already (no second pass over the upper blocks)."""
    from learner.methods.base import FROZEN_SPACE_VERSION

    data, backbone = eurosat_latents
    learner = after_the_stream(backbone, streamed)
    offered = learner.buffer.n_seen
    learner.observe(data.train_x[data.train_y == 0][-10:], torch.zeros(10, dtype=torch.long))  # a full class: values
    buffer, n = learner.buffer, len(learner.buffer)
    assert learner.values_frozen and n == 100
    cached = buffer.feature_version[:n] == FROZEN_SPACE_VERSION
    assert bool(cached.any()) and bool((cached | (buffer.feature_version[:n] < 0)).all())  # no top's features
    admitted = buffer.entered[:n] >= offered
    assert bool(admitted.any()) and bool(cached[admitted].all())
    expected = learner.frozen_features(buffer.images[:n][cached]).float()
    assert torch.allclose(buffer.features[:n][cached].float(), expected, atol=1e-3)


def test_awake_the_pool_is_fitted_again_as_streaming_lda_learns_young_classes(eurosat_latents):
    """Between sleeps the top does not move, but streaming LDA learns new classes and the held-back samples grow: the
    pool's weight and temperature are fitted on them as they are now, not left as the last sleep fitted them (which
    served young classes' photos far less sure than right), and each held sample passes through the top once."""
    from learner.heads.head_choice import fit_pool

    learner = sleeping_learner(eurosat_latents[1], epochs=1)
    stream(learner, eurosat_latents[0], (0, 1))
    assert learner.sleep().kept
    version, held = learner.version, len(learner.held_back)
    stream(learner, eurosat_latents[0], (2, 3))
    assert learner.version == version and len(learner.held_back) > held  # awake: the top never stepped
    learner.measure_held()
    assert not learner.held_measure_due
    stored, frozen, labels = learner.held_back.stacked()
    top = learner.held_top_probabilities()
    assert torch.allclose(top, learner.top_probabilities(stored), atol=1e-6)
    assert learner._held_tops[0] == (version, learner.num_classes) and len(learner._held_tops[1]) == len(labels)
    probabilities = learner.head_probabilities(stored, frozen, top=top)
    weighed = learner.head_choice.weighed(learner.num_classes)
    assert learner.head_choice.pool == fit_pool(probabilities["slda"], probabilities["top"], labels, weighed)


def test_a_measure_reads_streaming_lda_as_it_answers_now_with_a_young_class_among_its_classes(eurosat_latents):
    """A young class's mean moves with every sample and streaming LDA owes a solve; no held-back sample has changed and
    the top has not moved. A measure then (an evaluation's, or the step's) solves first and fits the pool on the
    answers served now; counting only solves already made, it found nothing new and left the choice of a stream
    without that class: what an in-process evaluation served, where a service (which solves before it publishes)
    measured again."""
    from learner.heads.head_choice import fit_pool

    data, backbone = eurosat_latents
    learner = sleeping_learner(backbone, epochs=1)
    stream(learner, data, (0, 1))
    assert learner.sleep().kept and not learner.held_measure_due
    held, version = len(learner.held_back), learner.version
    young = torch.nonzero(data.train_y == 2).flatten()[:10]
    learner.observe(data.train_x[young], data.train_y[young])  # the first ten of class 2: none held back yet
    assert len(learner.held_back) == held and learner.version == version
    assert learner.measure_held()  # measured: streaming LDA now has class 2
    stored, frozen, labels = learner.held_back.stacked()
    probabilities = learner.head_probabilities(stored, frozen, top=learner.held_top_probabilities())
    assert float(probabilities["slda"][:, 2].max()) > 0  # the young class is among what the held samples were told
    weighed = learner.head_choice.weighed(learner.num_classes)
    assert learner.head_choice.pool == fit_pool(probabilities["slda"], probabilities["top"], labels, weighed)
    assert not learner.held_measure_due


LEAN_PROCESS = """
import sys, torch
from learner import make_learner
from learner.data import load_dataset, task_batches
from learner.methods.sleep import SleepConfig
from learner.networks.backbone import make_backbone
data = load_dataset("eurosat", sys.argv[1], train_per_class=30, test_per_class=1)
backbone = make_backbone("lite0", data.image_shape, 64, 11, 16)
learners = [make_learner("cb-sv-duel", 4, mem_size=50, loss="ace", lr=0.01, ema_decay=0.99, seed=0, backbone=backbone,
                         serving_head="slda", choose_head="held-back", head_prior="pool", train_every=0,
                         sleep=SleepConfig(epochs=1)) for _ in range(2)]
for x, y in task_batches(data, [0, 1, 2, 3], 10, torch.Generator().manual_seed(0)):
    learners[0].observe(x, y)
assert learners[0].sleep().updates > 0
learners[0].predict(x)  # the top served: its graph exported
learners[1].load_state_dict(learners[0].state_dict())  # a checkpoint's round trip
print(sorted(m for m in ("torch._dynamo", "sympy", "onnx") if m in sys.modules))
"""


def test_a_learner_whose_top_trains_only_in_sleeps_never_imports_torchs_compiler_or_exporter():
    """torch.optim imports torch._dynamo (71 MB kept) at its first call: awake such a learner builds no optimizer, and
    a sleep steps by hand (the same weights to the bit: checked against torch.optim.SGD when it changed). Its graphs
    (the frozen part's, the served top's) are exported in a child process: torch.onnx and onnx stay out of it."""
    run = subprocess.run([sys.executable, "-c", LEAN_PROCESS, str(EUROSAT_ZIP)], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-2] == "[]", run.stdout


def test_a_sleep_that_wrecks_the_top_never_serves_worse_on_the_held_back_samples(eurosat_latents, streamed):
    from learner.methods.sleep import _served_right_on_held, shown_worse

    learner = after_the_stream(eurosat_latents[1], streamed, epochs=2)
    assert learner.sleep().kept
    top_before = learner.head_choice.held_accuracy["top"]
    right_before = _served_right_on_held(learner)
    weights = {k: v.clone() for k, v in learner.ema.model.state_dict().items()}
    learner.sleeper.config.lr = 50.0  # a rate that wrecks the top
    report = learner.sleep(budget=320)
    right_after = _served_right_on_held(learner)
    assert not shown_worse(right_before, right_after)  # the promise, whichever way it was kept
    if report.kept:  # the choice moved the classes off the wrecked top
        assert learner.head_choice.held_accuracy["top"] < top_before - 0.2
    else:  # or the weights it replaced came back
        assert all(torch.equal(v, learner.ema.model.state_dict()[k]) for k, v in weights.items())


def test_a_yielded_sleep_owes_the_rest_and_a_state_round_trip_goes_on_alike(eurosat_latents, streamed):
    backbone = eurosat_latents[1]
    learner = after_the_stream(backbone, streamed, epochs=1)
    asked = iter([False, False, False, True])  # asked before the sleep, then before each step
    report = learner.sleep(should_yield=lambda: next(asked, True))
    assert report.yielded and report.steps == 2 and learner.sleeper.owed == report.budget - report.updates
    twin = sleeping_learner(backbone, epochs=1)
    twin.load_state_dict(learner.state_dict())
    assert len(twin.sleeper.store) == len(learner.sleeper.store) and twin.sleeper.owed == learner.sleeper.owed
    a, b = learner.sleep(), twin.sleep()
    assert a.updates == b.updates == learner.sleeper.reports[0]["budget"] - 2 * 32
    assert all(torch.equal(v, twin.model.state_dict()[k]) for k, v in learner.model.state_dict().items())


def test_a_fresh_sleep_trains_the_top_again_from_imagenets_weights_over_everything_held(eurosat_latents, streamed):
    backbone = eurosat_latents[1]
    learner = after_the_stream(backbone, streamed, epochs=1)
    learner.forget_class(3)
    learner.sleep(budget=64)
    initial = backbone.make_model(learner.model.num_classes, 0).state_dict()
    block = next(k for k in initial if k.startswith("blocks.") and k.endswith("weight"))
    assert not torch.equal(learner.model.state_dict()[block], initial[block])  # the warm sleep moved the top
    learner.restart_top(seed=5)
    assert torch.equal(learner.model.state_dict()[block], initial[block])  # ImageNet's blocks again
    assert torch.equal(learner.ema.model.state_dict()[block], initial[block])
    assert bool((learner.model.head.bias[3] < -1e3).all())  # the forgotten class stays silent

    learner = after_the_stream(backbone, streamed, epochs=1)
    learner.sleep(budget=64)
    assert learner.sleeper.budget() == 0 and learner.sleeper.budget(fresh=True) == len(learner.sleeper.store)
    night = after_the_stream(backbone, streamed, epochs=1, fresh_epochs=2.5)  # a fresh sleep's own count of passes
    assert night.sleeper.budget(fresh=True) == round(2.5 * len(night.sleeper.store)) and night.sleeper.budget() > 0
    asked = iter([False, False, True])  # a fresh sleep that yields after a step is undone whole, and asked again
    weights = {k: v.clone() for k, v in learner.model.state_dict().items()}
    undone = learner.sleep(fresh=True, should_yield=lambda: next(asked, True))
    assert undone.fresh and undone.yielded and not undone.kept and undone.steps == 1
    assert all(torch.equal(v, learner.model.state_dict()[k]) for k, v in weights.items())
    assert learner.sleeper.fresh_asked and learner.head_choice.top_classes == {0, 1, 2, 3}
    twin = sleeping_learner(backbone, epochs=1)
    twin.load_state_dict(learner.state_dict())
    assert twin.sleeper.fresh_asked  # a restart keeps the request
    read, drawn = learner.sleeper._read, []
    learner.sleeper._read = lambda learner, slots: drawn.append(slots) or read(learner, slots)
    fresh = learner.sleep()  # the next sleep is the fresh one asked for: one shuffled pass in (b)'s batches of 10
    held = len(learner.sleeper.store)
    assert fresh.fresh and fresh.updates == fresh.budget == held and not learner.sleeper.fresh_asked
    assert fresh.steps == -(-held // 10) and sorted(torch.cat(drawn).tolist()) == list(range(held))
    assert fresh.kept and fresh.held_after >= fresh.held_before - 0.05
    assert top_accuracy(learner, eurosat_latents[0]) > 0.8 and learner.head_choice.top_classes == {0, 1, 2, 3}


def test_a_reader_that_sees_the_sleep_end_sees_its_report(eurosat_latents, streamed):
    """/status reads `current` (sleeping or awake) and `last` from another thread: awake with no report of the sleep
    that just ended would read as a sleep that never happened."""
    learner = after_the_stream(eurosat_latents[1], streamed, epochs=1)
    seen_at_waking = []

    class Watched(type(learner.sleeper)):
        def __setattr__(self, name, value):
            if name == "current" and value is None and getattr(self, "current", None) is not None:
                seen_at_waking.append((self.sleeps, self.last))
            super().__setattr__(name, value)

    learner.sleeper.__class__ = Watched
    report = learner.sleep(budget=64)
    assert seen_at_waking == [(1, report.as_dict())]


def test_forgetting_a_class_empties_its_latents(eurosat_latents, streamed):
    learner = after_the_stream(eurosat_latents[1], streamed, epochs=1)
    learner.forget_class(2)
    assert 2 not in learner.sleeper.store.class_counts() and len(learner.sleeper.store.class_counts()) == 3
    assert 2 not in learner.sleep(budget=64).classes


# --- through the service -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiles():
    return real_jpegs(EUROSAT_ZIP, 560, classes=CLASSES)


def send(server, pairs) -> None:
    for i in range(0, len(pairs), 60):
        body = {"samples": [{"label": label, "image": base64.b64encode(jpeg).decode()}
                            for label, jpeg in pairs[i:i + 60]]}
        r = httpx.post(f"{server.url}/samples", json=body)
        assert r.status_code == 201, r.text


def wait_for(server, check, what: str, timeout: float = 600):
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = status(server)
        if check(st):
            return st
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout} s; last status {status(server)['sleep']}")


def dashboard_sleep_card(server) -> str:
    """The text of the dashboard's sleep card, awake, in a real browser."""
    from selenium.webdriver.common.by import By

    from .test_dashboard import chromium, wait

    browser = chromium()
    try:
        browser.get(server.url + "/")
        return wait(browser, lambda d: d.find_element(By.CSS_SELECTOR, "#sleep table[data-state='awake']")).text
    finally:
        browser.quit()


def test_the_service_sleeps_on_request_yields_to_ingest_and_survives_a_kill(tmp_path, tiles):
    server = Server(tmp_path / "svc", backbone="lite0", image_size=64, sleep_idle_s=3600,  # sleep on by default
                    mem_size=100, max_batch_wait_s=0.2).start()
    try:
        r = httpx.post(f"{server.url}/sleep")
        assert r.status_code == 202 and r.json()["new_samples"] == 0
        send(server, tiles[:480])
        st = wait_for(server, lambda s: s["samples_trained"] == 480, "train the first 480")
        assert st["sleep"]["state"] == "awake" and st["sleep"]["sleeps"] == 0 and st["steps"] == 48
        assert st["sleep"]["store"]["samples"] == 480 - st["head_choice"]["held_back"]["samples"]
        assert st["config"]["sleep"] and st["config"]["cut"] == 11 and st["config"]["head"] == "chosen"
        assert st["sleep"]["schedule"] == {"idle_s": 3600.0, "min_new": 100, "night_idle_s": 3600.0,
                                           "night_min_new": 100}
        top_before = st["head_choice"]["held_back"]["accuracy"].get("top", 0.0)

        r = httpx.post(f"{server.url}/sleep")
        assert r.status_code == 202 and r.json()["budget"] == 4 * st["sleep"]["new_samples"]
        # the sleep counted (/status reads it off the learner) and its model published (the worker publishes a moment
        # later; each of the sleep's steps is a weights version, so the published model is that many versions on): the
        # served choice's held-back accuracy is then the one the sleep measured
        version = st["model_version"]
        st = wait_for(server, lambda s: s["sleep"]["sleeps"] == 1 and s["sleep"]["last"] is not None
                      and s["model_version"] >= version + s["sleep"]["last"]["steps"], "one sleep, published")
        last, held = st["sleep"]["last"], st["head_choice"]["held_back"]["accuracy"]
        assert last["updates"] == last["budget"] and last["kept"] and not last["yielded"]
        assert last["held_after"] >= last["held_before"] and held["served"] == last["held_after"]
        assert held["top"] > max(top_before, 0.8), (top_before, held)  # the sleep taught the top every class
        assert sorted(st["sleep"]["top_classes"]) == sorted(CLASSES)
        deadline = time.time() + 300  # the export runs beside the worker
        while not (after := [x for x in httpx.get(f"{server.url}/snapshots").json()["snapshots"]
                             if x["reason"] == "sleep"]) and time.time() < deadline:
            time.sleep(0.5)
        assert after and after[-1]["model_version"] == st["model_version"]
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'aser_sleeps_total{kind="warm",outcome="kept"} 1.0' in metrics and "aser_sleeping 0.0" in metrics
        card = dashboard_sleep_card(server)
        assert "kept" in card and f"{100 * held['served']:.1f} %" in card and "sleeps 1:" in card, card
        assert all(label in card for label in CLASSES)  # the top has been taught every class
        assert "after 3600 s idle once 100 have arrived since the last" in card and "fresh, " not in card, card

        # ingest preempts a sleep: what arrives is acknowledged and trained, the sleep owes the rest
        send(server, tiles[480:520])  # new samples, so that the next sleep has a budget
        online = wait_for(server, lambda s: s["samples_trained"] == 520, "train 40 more")["online"]
        # the top answers now: the online score scores one batch in four (the first of them), counts the rest apart
        scored = online["samples_scored"] - st["online"]["samples_scored"]
        assert 10 <= scored < 40 and scored + online["samples_unscored"] == 40, online
        httpx.post(f"{server.url}/sleep")
        st = wait_for(server, lambda s: s["sleep"]["state"] == "sleeping", "a second sleep starts")
        assert st["sleep"]["progress"]["fresh"] is False
        send(server, tiles[520:540])
        st = wait_for(server, lambda s: s["samples_trained"] == 540, "ingest during a sleep trained")
        assert st["sleep"]["last"]["yielded"] and st["sleep"]["owed"] > 0

        # a SIGKILL mid-sleep: nothing acknowledged is lost, the store is whole, the sleep starts again
        httpx.post(f"{server.url}/sleep")
        wait_for(server, lambda s: s["sleep"]["state"] == "sleeping", "a third sleep starts")
        stored = status(server)["sleep"]["store"]["samples"]
        server.kill()
        server.start()
        assert status(server)["samples_received"] == 540
        st = wait_for(server, lambda s: s["samples_trained"] == 540, "retrain after the kill")
        assert st["sleep"]["store"]["samples"] == stored  # rows past the checkpoint dropped, then stored again
        httpx.post(f"{server.url}/sleep")
        st = wait_for(server, lambda s: s["sleep"]["owed"] == 0 and s["sleep"]["state"] == "awake"
                      and s["sleep"]["new_samples"] == 0, "the sleep done after the restart")
        assert st["samples_trained"] == 540 and st["backlog"] == 0

        # a fresh sleep on request: the top trained again from ImageNet's weights over everything the store holds
        r = httpx.post(f"{server.url}/sleep", params={"fresh": "true"})
        held = st["sleep"]["store"]["samples"]
        assert r.status_code == 202 and r.json()["fresh"] and r.json()["budget"] == 4 * held
        sleeps = st["sleep"]["sleeps"]
        st = wait_for(server, lambda s: s["sleep"]["sleeps"] == sleeps + 1 and s["sleep"]["state"] == "awake",
                      "the fresh sleep")
        last = st["sleep"]["last"]
        assert last["fresh"] and last["updates"] == 4 * held and not st["sleep"]["fresh_asked"]
        assert last["kept"] or last["held_after"] < last["held_before"]  # undone only where shown worse
        assert st["sleep"]["new_since_fresh"] == 0

        # a night's sleep: after ASER_SLEEP_FRESH_IDLE_S without a sample, once enough has arrived since the last
        # fresh one (ASER_SLEEP_MIN_NEW, and ASER_SLEEP_FRESH_GROWTH times what had arrived before it), the next sleep
        # is fresh unasked (the warm idle sleep still an hour away)
        server.stop()
        server.env.update(ASER_SLEEP_FRESH_IDLE_S="5", ASER_SLEEP_MIN_NEW="10")
        server.start()
        send(server, tiles[540:560])
        st = wait_for(server, lambda s: s["samples_trained"] == 560, "train 20 more")
        arrived = st["sleep"]["new_since_fresh"]
        assert 10 <= arrived <= 20 and st["sleep"]["sleeps"] == sleeps + 1
        assert st["sleep"]["schedule"]["night_min_new"] > 400  # growth 1: as many as had arrived before the last
        time.sleep(7)  # idle past the night, too little new for one
        assert status(server)["sleep"]["sleeps"] == sleeps + 1
        server.stop()
        server.env.update(ASER_SLEEP_FRESH_GROWTH="0.01")
        server.start()
        assert status(server)["sleep"]["schedule"]["night_min_new"] == 10  # 1% of 400-odd is under the floor
        st = wait_for(server, lambda s: s["sleep"]["sleeps"] == sleeps + 2 and s["sleep"]["state"] == "awake",
                      "a fresh sleep once idle")
        last = st["sleep"]["last"]
        assert last["fresh"] and last["updates"] == 4 * (held + arrived) and st["sleep"]["new_since_fresh"] == 0
        time.sleep(7)  # idle past the night again, nothing new since: no other night's sleep
        assert status(server)["sleep"]["sleeps"] == sleeps + 2
        st = status(server)
        assert st["sleep"]["schedule"]["night_idle_s"] == 5.0
        assert (f"{sleeps + 2} sleeps, 0 new samples (0 since the last fresh, a night's needs 10)"
                in status_lines(st))  # `aser status`
        metrics = httpx.get(f"{server.url}/metrics").text  # this process: the night's sleep, fresh
        fresh = [line for line in metrics.splitlines() if line.startswith('aser_sleeps_total{kind="fresh"')]
        assert sum(float(line.split()[-1]) for line in fresh) == 1.0, fresh
        assert "aser_sleep_new_since_fresh 0.0" in metrics
        card = dashboard_sleep_card(server)
        assert "fresh, held-back" in card, card
        assert "after 5 s idle once 10 have arrived since the last: 0 so far" in card, card
    finally:
        server.stop()


def test_the_served_answer_on_held_samples_skips_the_tops_pass_only_where_no_class_reads_the_top(eurosat_latents,
                                                                                               streamed):
    """Before a sleep no class reads the top (young classes answer by streaming LDA, the pool weighs the top nowhere):
    the held-back fits compose without its pass, to the same answers; after a sleep they pass through it."""
    learner = after_the_stream(eurosat_latents[1], streamed, epochs=1)
    stored, frozen, _ = learner.held_back.stacked()

    def full():
        return learner.head_choice.compose(learner.head_probabilities(stored, frozen)).clamp_min(1e-30).log()

    assert not learner.head_choice.reads_top(learner.num_classes)
    assert torch.equal(learner.served_logits(stored, frozen), full())
    assert learner.sleep().kept
    assert learner.head_choice.reads_top(learner.num_classes)  # the sleep taught the top: the pool weighs it
    assert torch.allclose(learner.served_logits(stored, frozen), full())


def test_between_sleeps_the_served_top_runs_in_onnxruntime_to_pytorchs_answers(eurosat_latents, streamed):
    """A top trained only in sleeps holds its weights between two: the served copy runs in onnxruntime, built once a
    version; its probabilities are PyTorch's eager ones. A top that steps awake keeps PyTorch's copy."""
    from learner.networks.frozen_runtime import TopGraph

    learner = after_the_stream(eurosat_latents[1], streamed, epochs=1)
    assert learner.sleep().kept
    stored, _, _ = learner.held_back.stacked()
    served = learner.inference_features()
    assert isinstance(served, TopGraph) and learner.inference_features() is served  # one build a version
    with torch.inference_mode():
        eager = torch.softmax(learner.serving_model.eval()(learner.to_input(stored)), 1)
    assert torch.allclose(learner.top_probabilities(stored), eager, atol=1e-5)
    awake = sleeping_learner(eurosat_latents[1], train_every=1)
    assert not isinstance(awake.inference_features(), TopGraph)


def test_the_temperature_prior_is_streaming_ldas_until_the_pool_weighs_a_trained_top(eurosat_latents, streamed):
    """Calibration's prior follows what is served. Before a sleep has taught the top a class the pool is streaming
    LDA's answer and fits nothing: streaming LDA's logits earn a temperature near 5. Once the pool weighs the top, its
    temperature, fitted by likelihood on the same held-back samples, has set the served scale: the prior is 1 (under
    5, a hundred images into a class the top had not learned, the answers were far less sure than right:
    docs/results/calibration.md)."""
    from learner import make_learner
    from learner.heads.calibration import FITTED_PRIOR_TEMPERATURE, PRIOR_TEMPERATURE, fit_temperature
    from learner.methods.sleep import SleepConfig

    learner = make_learner("cb-sv-duel", 4, mem_size=100, loss="ace", lr=0.01, ema_decay=0.99,
                           backbone=eurosat_latents[1], serving_head="slda", choose_head="held-back", head_prior="pool",
                           train_every=0, sleep=SleepConfig(epochs=1), seed=0, calibrate=True)
    learner.load_state_dict(streamed)

    def fitted_under(prior: float) -> float:
        stored, frozen, labels = learner.held_back.stacked()
        return fit_temperature(learner.served_logits(stored, frozen).cpu(), labels, prior)

    learner.measure_held()
    assert learner.head_choice.pool == (0.0, 1.0) and not learner.head_choice.serves_fitted_pool(4)
    temperature = learner.calibration().temperature
    assert temperature == fitted_under(PRIOR_TEMPERATURE) != fitted_under(FITTED_PRIOR_TEMPERATURE)
    assert learner.sleep().kept and learner.head_choice.serves_fitted_pool(4)
    assert learner.calibration().temperature == fitted_under(FITTED_PRIOR_TEMPERATURE)


def test_a_photo_answered_by_a_class_the_top_has_not_learned_gets_streaming_ldas_answer_everywhere(tmp_path):
    """After a sleep, ten-odd photos into a new class: the top has not learned it, so the pool answers it on streaming
    LDA's term alone against the top's vote for the classes it knows, and its answers came far less sure than right
    (docs/results/calibration.md). A photo answered by that class gets streaming LDA's own calibrated answer instead,
    where that answer is the same: in the learner, the service's predictor and the ONNX snapshot alike; every other
    photo keeps the pool's, and no answer moves."""
    from dataclasses import replace

    import numpy as np
    import onnxruntime as ort

    from learner import make_learner
    from learner.data import load_dataset, task_batches
    from learner.methods.sleep import SleepConfig
    from learner.networks.backbone import make_backbone
    from service.learning.serving import Predictor
    from service.storage.snapshots import PixelsToLogits, export_onnx

    data = load_dataset("eurosat", EUROSAT_ZIP, train_per_class=120, test_per_class=30)  # 120: ten held back a class
    backbone = make_backbone("lite0", data.image_shape, 64, 11, 16)
    learner = make_learner("cb-sv-duel", 4, mem_size=100, loss="ace", lr=0.01, ema_decay=0.99, backbone=backbone,
                           serving_head="slda", choose_head="held-back", head_prior="pool", train_every=0,
                           sleep=SleepConfig(epochs=2), seed=0, calibrate=True)
    for x, y in task_batches(data, [0, 1], 10, torch.Generator().manual_seed(0)):
        learner.observe(x, y)
    assert learner.sleep().kept
    young = torch.nonzero(data.train_y == 2).flatten()[:12]
    learner.observe(data.train_x[young], data.train_y[young])
    test = data.test_x[data.test_y < 3]
    candidates = learner.candidate_probabilities(test)
    calibration = learner.calibration()
    assert learner.head_choice.reads_top(4) and calibration.blind[:3].tolist() == [False, False, True]
    pooled = calibration.probabilities(candidates["served"].clamp_min(1e-30).log())
    streamed = replace(calibration, temperature=calibration.stream_temperature).probabilities(
        candidates["slda"][:, :3].clamp_min(1e-30).log())  # over the classes it has: class 3 is not seen
    streamed = torch.cat([streamed, torch.zeros(len(streamed), 1)], 1)
    rows = (pooled.argmax(1) == 2) & (streamed.argmax(1) == 2)
    served = torch.softmax(learner.logits(test), 1).cpu()
    assert torch.equal(served.argmax(1), pooled.argmax(1)) and int(rows.sum()) >= 5
    assert torch.allclose(served[rows], streamed[rows], atol=1e-6) and torch.allclose(served[~rows], pooled[~rows])
    assert float(streamed[rows].max(1).values.mean()) > float(pooled[rows].max(1).values.mean())

    labels, served = [data.class_names[c] for c in range(3)], served[:, :3]  # class 3 not seen: none of it
    assert torch.allclose(served.sum(1), torch.ones(len(served)))
    predictor = Predictor.from_learner(learner, labels, trained_upto=0)
    assert torch.allclose(predictor.probabilities(test), served, atol=1e-4)  # its top: onnxruntime's
    weight, bias, choice = learner.served_choice()
    path = tmp_path / "young.onnx"
    export_onnx(PixelsToLogits(learner.serving_model, [0, 1, 2], learner.served_head(), backbone=learner.backbone,
                               stream_head=(weight, bias), choice=choice.tolist(),
                               pool=learner.head_choice.pool_of(learner.num_classes), calibrated=calibration),
                labels, path, {"head": "chosen"})
    logits, scores = ort.InferenceSession(str(path)).run(None, {"pixels": test.numpy()})
    assert np.abs(np.exp(logits) - served.numpy()).max() < 1e-4
    # "none of these" reads the stored latent's channel means beside the frozen features, alike everywhere
    assert calibration.parts is not None
    learned = learner.unknown_scores(test)
    assert torch.allclose(predictor.answers(test)[1], learned, atol=1e-3)
    assert np.abs(scores - learned.numpy()).max() < 1e-3

"""A real client's view (clients.bench.live.client_stream): a fresh service on its defaults, fed Split
EuroSAT's real photos over HTTP task by task, answers the seen classes well above chance, trains every
photo sent once, and its ONNX snapshot answers every held-out photo as /predict does."""

from __future__ import annotations

import json
import zipfile

from clients.bench.live import client_stream
from clients.bench.live.local_service import file_number, real_jpegs, split_of

from .conftest import EUROSAT_ZIP, MINI_ZIP


def test_eurosat_photos_split_by_the_readme_rule_in_the_order_of_their_number():
    with zipfile.ZipFile(EUROSAT_ZIP) as z:
        names = [x for x in z.namelist() if x.endswith(".jpg")]
    test = [x for x in names if split_of(x) == "test"]
    assert len(test) == 5400 and len(names) - len(test) == 21600
    assert all(file_number(x) % 5 == 0 for x in test)
    first = real_jpegs(EUROSAT_ZIP, 3, classes=["River"])
    with zipfile.ZipFile(EUROSAT_ZIP) as z:  # River_1, River_2, River_3: by number, not by name
        assert [image for _, image in first] == [z.read(f"River/River_{n}.jpg") for n in (1, 2, 3)]


def test_a_paced_split_stream_through_the_service_is_learned_and_the_snapshot_answers_as_predict(tmp_path):
    out = tmp_path / "stream.json"
    assert client_stream.main(["--data", str(EUROSAT_ZIP), "--train-per-class", "12", "--test-per-class", "5",
                               "--rate", "30", "--env", "ASER_IDLE_REHEARSAL=true",
                               "--env", "ASER_IDLE_REHEARSAL_PER_STEP=2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert [list(task) for task in run["tasks"]] == [["10", "end"]] * 5
    assert run["samples_sent"] == run["samples_trained"] == 120 and run["samples_skipped"] == 0
    # paced: idle between batches and while measured, it rehearses within the budget of two a stream step
    assert result["rate"] == 30 and run["steps"] >= 12 and 0 < run["rehearsal_steps"] <= 2 * run["steps"]
    assert run["final_accuracy"] >= 40 and run["anytime"]["10"] >= 40  # 10 classes: chance is 10
    parity = run["onnx_parity"]
    assert parity["compared"] == 50 and parity["same_top1"] == 50 and parity["max_probability_gap"] < 1e-3
    assert run["serving_head"] == parity["snapshot_head"] == "slda"
    assert result["command"].startswith("python -m clients.bench.live.client_stream")


def test_none_of_these_through_the_service_a_held_out_class_and_another_world(tmp_path):
    """Class `seed` is never sent; at the end /predict's score tells its photos (near) and Mini-ImageNet's (far) from
    the learned tiles, and the snapshot scores as /predict does."""
    out = tmp_path / "stream.json"
    assert client_stream.main(["--data", str(EUROSAT_ZIP), "--train-per-class", "40", "--test-per-class", "10",
                               "--seeds", "1", "--hold-out", "--far-data", str(MINI_ZIP), "--far-photos", "40",
                               "--env", "ASER_SLEEP_IDLE_S=1", "--env", "ASER_SLEEP_EPOCHS=1",
                               "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]  # 40 a class: 27 held back, a threshold (20 or more)
    assert run["held_out_class"] == "Forest" and run["samples_sent"] == 9 * 40  # nine classes: the last task one
    assert [list(task) for task in run["tasks"]] == [["10", "end"]] * 5
    unknowns = run["none_of_these"]
    assert unknowns["photos"] == {"known": 90, "near": 10, "far": 40}
    assert unknowns["auroc"]["far"] > 0.9 and 0 <= unknowns["auroc"]["near"] <= 1  # photos of another world
    assert unknowns["caught"]["far"] > unknowns["false_alarm_rate"]
    parity = run["onnx_parity"]
    assert parity["unknown_scores_compared"] == 90 and parity["max_unknown_score_gap"] < 1e-3


def test_a_sleeping_service_is_measured_after_its_idle_sleep_and_after_its_nights(tmp_path):
    """With ASER_SLEEP and ASER_SLEEP_FRESH_IDLE_S, `--fresh-sleep` asks for nothing: it waits for the service's own
    night sleep over everything sent (the top trained again from ImageNet's weights) and measures after it."""
    out = tmp_path / "stream.json"
    assert client_stream.main(["--data", str(EUROSAT_ZIP), "--train-per-class", "12", "--test-per-class", "5",
                               "--env", "ASER_IMAGE_SIZE=64", "--env", "ASER_SLEEP=true",
                               "--env", "ASER_SLEEP_IDLE_S=1", "--env", "ASER_SLEEP_MIN_NEW=1",
                               "--env", "ASER_SLEEP_EPOCHS=1", "--env", "ASER_SLEEP_FRESH_IDLE_S=3",
                               "--fresh-sleep", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["samples_sent"] == run["samples_trained"] == 120 and run["samples_skipped"] == 0
    night = run["after_fresh"]["sleep"]
    assert night["last"]["fresh"] and night["new_since_fresh"] == 0 and night["state"] == "awake"
    assert night["last"]["updates"] == night["last"]["budget"] == night["store"]["samples"]  # one pass over all
    assert run["after_idle"]["sleep"]["new_samples"] == 0 and run["after_fresh"]["accuracy"] >= 40
    assert run["onnx_parity"]["same_top1"] == run["onnx_parity"]["compared"] == 50

"""One sample through the API on a real uvicorn server with real CIFAR-10 photos: GET /samples/{seq} and its
image, GET /suspects, PATCH /samples/{seq} (a wrong label corrected) and DELETE /samples/{seq} (one sample
forgotten), idempotent, refused clearly when wrong, and durable across a SIGKILL: the forgotten sample never comes
back, from the log, a retry of its ingest or the memory, and its pixels leave the database."""

import base64
import io
import sqlite3

import httpx
import pytest
from PIL import Image

from clients.api import ServiceClient
from clients.bench.live.local_service import real_jpegs

from .conftest import CIFAR10_ZIP
from .test_forget import wait_idle
from .test_service import Server


def rows(server, sql, *args):
    with sqlite3.connect(f"file:{server.data_dir / 'aser.db'}?mode=ro", uri=True) as conn:
        return conn.execute(sql, args).fetchall()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("svc"), mem_size=60, checkpoint_every_steps=5).start()
    yield s
    s.stop()


def send(server, samples: list[tuple[str, bytes, str]]) -> list[int]:
    body = {"samples": [{"label": label, "image": base64.b64encode(data).decode(), "id": sid}
                        for label, data, sid in samples]}
    answer = httpx.post(server.url + "/samples", json=body)
    assert answer.status_code == 201, answer.text
    return answer.json()["seqs"]


@pytest.fixture(scope="module")
def stream(server):
    """90 photos of three classes, ten frogs of them sent as airplanes; each sample's seq, given and true label."""
    photos = real_jpegs(CIFAR10_ZIP, 90, classes=["airplane", "frog", "ship"])
    frogs = [i for i, (label, _) in enumerate(photos) if label == "frog"]
    given = ["airplane" if i in frogs[::3] else label for i, (label, _) in enumerate(photos)]
    seqs = send(server, [(g, data, f"p{i}") for i, (g, (_, data)) in enumerate(zip(given, photos))])
    with ServiceClient(server.url) as client:
        wait_idle(client)
    return [(seq, g, label, data, f"p{i}") for i, (seq, g, (label, data)) in enumerate(zip(seqs, given, photos))]


def test_a_sample_says_what_it_is_and_where_it_went(server, stream):
    seq, given, _, _, sid = stream[0]
    info = httpx.get(f"{server.url}/samples/{seq}").json()
    assert info["seq"] == seq and info["id"] == sid and info["label"] == given
    assert info["state"] == "learned" and info["pixels_retained"] is True
    memory_seqs = {s for s, *_ in stream if httpx.get(f"{server.url}/samples/{s}").json()["in_memory"]}
    assert 0 < len(memory_seqs) <= 60
    image = Image.open(io.BytesIO(httpx.get(f"{server.url}/samples/{seq}/image").content))
    assert image.format == "PNG" and image.size == (32, 32)
    for bad, status in (("999999", 404), ("-1", 404), ("x1", 404), (str(2**63), 422)):
        assert httpx.get(f"{server.url}/samples/{bad}").status_code == status


def test_the_suspects_come_with_their_label_the_answer_and_their_value(server, stream):
    answer = httpx.get(server.url + "/suspects", params={"limit": 15}).json()
    suspects = answer["suspects"]
    assert len(suspects) == 15 and answer["model_version"] > 0
    values = [s["value"] for s in suspects]
    assert values == sorted(values)  # most suspected first
    given = {seq: g for seq, g, *_ in stream}
    assert all(s["seq"] in given and s["label"] == given[s["seq"]] for s in suspects)
    assert all(s["answer"] in ("airplane", "frog", "ship") and 0 < s["probability"] <= 1 for s in suspects)
    assert httpx.get(server.url + "/suspects", params={"limit": 0}).status_code == 422


def test_the_latest_samples_are_valued_too_those_the_memory_never_kept_among_them(server, stream):
    answer = httpx.get(server.url + "/suspects", params={"limit": 90, "recent": 90}, timeout=180).json()
    suspects = answer["suspects"]
    given = {seq: g for seq, g, *_ in stream}
    assert sorted(s["seq"] for s in suspects) == sorted(given)  # every learned sample, each once
    assert [s["value"] for s in suspects] == sorted(s["value"] for s in suspects)
    assert all(s["label"] == given[s["seq"]] for s in suspects)
    outside = [s for s in suspects if s["slot"] is None]
    assert len(outside) >= 30  # a memory of 60 holds the rest at most
    wrong = {seq for seq, g, t, *_ in stream if g != t}
    values = {s["seq"]: s["value"] for s in suspects}
    flipped = sum(values[s] for s in wrong) / len(wrong)
    assert flipped < sum(v for s, v in values.items() if s not in wrong) / (len(values) - len(wrong))
    for bad in ({"recent": -1}, {"recent": 1001}, {"recent": "x"}):
        assert httpx.get(server.url + "/suspects", params=bad).status_code == 422


def test_a_wrong_label_is_corrected_and_a_sample_forgotten_for_good(server, stream):
    wrong = [(seq, g, t, data, sid) for seq, g, t, data, sid in stream if g != t]
    seq, given, true, data, sid = wrong[0]
    fixed = httpx.patch(f"{server.url}/samples/{seq}", json={"label": true}).json()
    assert fixed["previous_label"] == given and fixed["label"] == true and fixed["learned"] is True
    info = httpx.get(f"{server.url}/samples/{seq}").json()
    assert info["label"] == true and fixed["in_memory"] == info["in_memory"]
    for _ in range(2):  # a confirmation: the model keeps it from the suspects; recorded once
        again = httpx.patch(f"{server.url}/samples/{seq}", json={"label": true}).json()
        assert again["previous_label"] == again["label"] == true and not (again["in_memory"] or again["stream_head"])
    assert rows(server, "SELECT old_class = new_class FROM corrections WHERE seq = ? ORDER BY id", seq) == [(0,), (1,)]
    suspects = httpx.get(server.url + "/suspects", params={"limit": 1000}).json()["suspects"]
    assert seq not in {s["seq"] for s in suspects}
    for body, status in (({"label": ""}, 422), ({"label": "a\u200bb"}, 422), ({"name": "frog"}, 422), ([], 422)):
        assert httpx.patch(f"{server.url}/samples/{seq}", json=body).status_code == status
    assert httpx.patch(f"{server.url}/samples/999999", json={"label": "frog"}).json()["error"] == "not_found"

    seq, given, *_, data, sid = wrong[1]
    gone = httpx.delete(f"{server.url}/samples/{seq}").json()
    assert gone["label"] is None and gone["previous_label"] == given and gone["learned"] is True
    assert httpx.delete(f"{server.url}/samples/{seq}").status_code == 200  # asked again: the same state
    server.kill()  # right after the answer: nothing of it may come back
    server.start()
    assert send(server, [(given, data, sid)]) == [seq]  # a retry of its ingest: acknowledged, not stored again
    info = httpx.get(f"{server.url}/samples/{seq}").json()
    assert info["state"] == "forgotten" and info["pixels_retained"] is False and info["in_memory"] is False
    assert httpx.get(f"{server.url}/samples/{seq}/image").status_code == 404
    assert rows(server, "SELECT length(image), deleted IS NOT NULL FROM samples WHERE seq = ?", seq) == [(0, 1)]
    assert rows(server, "SELECT image FROM corrections WHERE seq = ?", seq) == [(None,)]  # a checkpoint holds it
    assert httpx.patch(f"{server.url}/samples/{seq}", json={"label": given}).status_code == 404


def test_the_command_line_lists_suspects_and_corrects_a_sample(server, stream, capsys):
    from clients.cli import main

    assert main(["suspects", "--url", server.url, "--limit", "3", "--json"]) == 0
    rows = __import__("json").loads(capsys.readouterr().out)
    assert len(rows) == 3 and all({"seq", "label", "answer", "probability", "value"} <= set(r) for r in rows)
    seq, given, true, *_ = [s for s in stream if s[1] != s[2]][2]  # the test above corrected the first two
    assert main(["relabel", str(seq), true, "--url", server.url]) == 0
    assert f"{given!r} -> {true!r}" in capsys.readouterr().out
    assert main(["forget-sample", str(seq), "--url", server.url]) == 2  # not without --yes
    assert "--yes" in capsys.readouterr().err
    assert main(["relabel", "999999", true, "--url", server.url]) == 1
    assert "no sample 999999" in capsys.readouterr().err

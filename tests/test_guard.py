"""A web page the device's browser opens cannot read or write the service (issue 39, item 17): DNS
rebinding meets the Host allow-list, a cross-site form POST or WebSocket meets the Origin check. A
real server on loopback, real images."""

import json

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from .test_service import Server, b64, status


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("guard")).start()
    yield s
    s.stop()


def test_a_rebound_host_name_gets_nothing(open_server):
    s = open_server
    port = s.url.rsplit(":", 1)[1]
    for path in ("/status", "/memory/0", "/", "/metrics"):
        r = httpx.get(f"{s.url}{path}", headers={"Host": f"attacker.example:{port}"})
        assert r.status_code == 400 and r.json()["error"] == "invalid_host", path
    for name in ("127.0.0.1", "localhost"):
        assert httpx.get(f"{s.url}/status", headers={"Host": f"{name}:{port}"}).status_code == 200


def test_a_cross_site_form_post_and_websocket_are_refused_and_store_nothing(open_server, jpegs):
    s = open_server
    before = status(s)["samples_received"]
    files = [("image", ("a.jpg", jpegs[0][1], "image/jpeg"))]
    r = httpx.post(f"{s.url}/samples", files=files, data={"label": "cat"},
                   headers={"Origin": "http://attacker.example"})
    assert r.status_code == 403 and r.json()["error"] == "cross_origin"
    r = httpx.post(f"{s.url}/samples", json={"label": "cat", "image": b64(jpegs[0][1])}, headers={"Origin": "null"})
    assert r.status_code == 403
    with pytest.raises(InvalidStatus) as refused:
        connect(s.url.replace("http", "ws") + "/samples/ws", origin="http://attacker.example")
    assert refused.value.response.status_code == 403
    assert status(s)["samples_received"] == before
    # the dashboard's own page (same origin), a device (no Origin) and a safe cross-site read still work
    assert httpx.post(f"{s.url}/samples", files=files, data={"label": "cat"}, headers={"Origin": s.url}).status_code == 201
    with connect(s.url.replace("http", "ws") + "/samples/ws") as ws:
        ws.send(json.dumps({"label": "cat", "image": b64(jpegs[1][1])}))
        assert json.loads(ws.recv())["accepted"] == 1
    assert httpx.get(f"{s.url}/healthz", headers={"Origin": "http://attacker.example"}).status_code == 200


def test_a_token_passes_the_origin_check_and_the_allow_list_is_a_setting(tmp_path, jpegs):
    s = Server(tmp_path, write_token="w", allowed_hosts='["svc.example"]').start()
    try:
        port = s.url.rsplit(":", 1)[1]
        headers = {"Host": f"svc.example:{port}", "Origin": "http://app.example", "Authorization": "Bearer w"}
        r = httpx.post(f"{s.url}/samples", json={"label": "cat", "image": b64(jpegs[0][1])}, headers=headers)
        assert r.status_code == 201
        r = httpx.get(f"{s.url}/status", headers={"Authorization": "Bearer w"})
        assert r.status_code == 400 and r.json()["error"] == "invalid_host"  # 127.0.0.1 is not in this list
    finally:
        s.stop()


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
def test_a_browser_that_strips_origin_is_refused_by_its_fetch_metadata(open_server, jpegs, site):
    """OWASP's Fetch Metadata policy: Sec-Fetch-Site marks a request from another origin even when an
    extension or a privacy setting strips Origin (issue 53, item 3)."""
    s = open_server
    before = status(s)["samples_received"]
    foreign = {"Sec-Fetch-Site": site}
    r = httpx.post(f"{s.url}/samples", json={"label": "cat", "image": b64(jpegs[0][1])}, headers=foreign)
    assert r.status_code == 403 and r.json()["error"] == "cross_site"
    assert httpx.delete(f"{s.url}/classes/cat", headers=foreign).json()["error"] == "cross_site"
    with pytest.raises(InvalidStatus) as refused:
        connect(s.url.replace("http", "ws") + "/samples/ws", additional_headers=foreign)
    assert refused.value.response.status_code == 403
    assert status(s)["samples_received"] == before
    assert httpx.get(f"{s.url}/status", headers=foreign).status_code == 200  # a read is safe


def test_fetch_metadata_of_the_same_origin_or_the_user_passes_and_a_token_passes_all(tmp_path, jpegs):
    s = Server(tmp_path, write_token="w").start()
    try:
        body = {"label": "cat", "image": b64(jpegs[0][1])}
        auth = {"Authorization": "Bearer w"}
        for site in ("same-origin", "none"):
            r = httpx.post(f"{s.url}/samples", json=body, headers={**auth, "Sec-Fetch-Site": site})
            assert r.status_code == 201, site
        r = httpx.post(f"{s.url}/samples", json=body, headers={**auth, "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 201  # a bearer token is no browser's ambient credential
        with connect(s.url.replace("http", "ws") + "/samples/ws",
                     additional_headers={**auth, "Sec-Fetch-Site": "cross-site"}) as ws:
            ws.send(json.dumps(body))
            assert json.loads(ws.recv())["accepted"] == 1
    finally:
        s.stop()

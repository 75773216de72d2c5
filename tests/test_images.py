"""The one input rule (`learner.formats.snapshot.read_image`) on real and hostile images: what it
refuses before decoding, what camera formats it reads, and that the service and the ONNX client
apply the same rule."""

import io
import zipfile

import httpx
import numpy as np
import pytest
from PIL import Image

from clients.bench.cost.image_costs import band_script, jpegtran_scans, lying_jpeg, repeat_last_scan, textured
from learner.formats.jpeg_structure import read_structure
from learner.formats.snapshot import MAX_PIXELS, MAX_SCANS, ImageRejected, read_image

from .conftest import CIFAR10_ZIP, MINI_ZIP
from .test_service import Server, b64, status, wait_trained

TIMEOUT = 180


@pytest.fixture(scope="module")
def photo() -> bytes:
    """A real 84x84 Mini-ImageNet photo, upscaled to 336x252 as a camera would give it."""
    with zipfile.ZipFile(MINI_ZIP) as z:
        name = sorted(n for n in z.namelist() if n.endswith(".jpg"))[0]
        im = Image.open(io.BytesIO(z.read(name))).convert("RGB")
    out = io.BytesIO()
    im.resize((336, 252)).save(out, "JPEG", quality=90)
    return out.getvalue()


def encoded(im: Image.Image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def rejected(data: bytes, size: int = 32) -> ImageRejected:
    with pytest.raises(ImageRejected) as info:
        read_image(data, size)
    return info.value


def test_extreme_aspect_ratios_are_refused_from_the_header():
    thin = encoded(Image.new("L", (300_000, 1)), "PNG")  # a few hundred bytes
    assert len(thin) < 2000
    err = rejected(thin)
    assert (err.code, err.status) == ("extreme_aspect_ratio", 422)
    assert read_image(encoded(Image.new("L", (600, 30)), "PNG"), 32).shape == (3, 32, 32)  # 20:1 is fine


def test_images_over_the_pixel_cap_are_refused_before_decoding():
    big = encoded(Image.new("L", (7000, 7000)), "PNG")  # 49 MP, ~50 KB
    err = rejected(big)
    assert (err.code, err.status) == ("too_many_pixels", 413) and 7000 * 7000 > MAX_PIXELS


def test_a_jpeg_is_decoded_at_reduced_scale(photo):
    """A large JPEG within 64x the cap decodes by draft at 1/8 scale: the result is the fitted square."""
    im = Image.open(io.BytesIO(photo)).resize((8000, 6000))
    out = read_image(encoded(im, "JPEG", quality=50), 32)
    assert out.shape == (3, 32, 32) and out.std() > 5


def test_truncated_jpegs_are_corrupt(photo):
    err = rejected(photo[: len(photo) // 2])
    assert (err.code, err.status) == ("corrupt_image", 422)
    lying = bytearray(photo[:-2])  # the end marker gone: a header that claims more than the data holds
    assert rejected(bytes(lying)).code == "corrupt_image"


def test_a_phones_multi_picture_jpeg_is_read_as_its_first_frame(photo):
    first = Image.open(io.BytesIO(photo))
    second = Image.new("RGB", first.size, (0, 255, 0))
    mpo = encoded(first, "MPO", save_all=True, append_images=[second])
    assert Image.open(io.BytesIO(mpo)).format == "MPO"
    got = read_image(mpo, 32).astype(int)
    assert np.abs(got - read_image(photo, 32)).mean() < 4  # the first frame (MPO re-encodes it)
    assert np.abs(got - np.array([0, 255, 0])[:, None, None]).mean() > 40  # not the green second one


def test_exif_orientation_is_applied(photo):
    """A portrait photo stored sideways with orientation 6 (rotate 90° clockwise to view) reads as
    the upright image does."""
    upright = Image.open(io.BytesIO(photo)).rotate(-90, expand=True)  # what the viewer should see
    stored = upright.rotate(90, expand=True)  # how the camera wrote it
    exif = Image.Exif()
    exif[0x0112] = 6
    sideways = encoded(stored, "JPEG", quality=95, exif=exif.tobytes())
    plain = encoded(upright, "JPEG", quality=95)
    a, b = read_image(sideways, 32).astype(int), read_image(plain, 32).astype(int)
    assert np.abs(a - b).mean() < 4  # the same picture, up to JPEG's rounding
    assert np.abs(read_image(encoded(stored, "JPEG", quality=95), 32).astype(int) - b).mean() > 10


@pytest.mark.parametrize("kind", ["cmyk", "16-bit", "gif"])
def test_formats_and_modes_outside_the_rule_are_refused_with_the_accepted_list(kind, photo):
    im = Image.open(io.BytesIO(photo))
    data = {"cmyk": lambda: encoded(im.convert("CMYK"), "JPEG"),
            "16-bit": lambda: encoded(Image.fromarray(np.full((40, 40), 60000, dtype=np.uint16)), "PNG"),
            "gif": lambda: encoded(im, "GIF")}[kind]()
    err = rejected(data)
    if kind == "gif":
        assert (err.code, err.status) == ("unsupported_format", 415) and "PNG, JPEG, MPO, WEBP, BMP" in err.detail
    else:
        assert (err.code, err.status) == ("unsupported_mode", 422) and "8-bit RGB" in err.detail


def test_the_service_and_the_onnx_client_apply_the_same_rule(tmp_path, photo):
    """Every hostile image gets a 4xx JSON error from a real server and stores nothing; the ONNX
    client refuses what the service refuses; an upright and a sideways photo get one answer."""
    from clients.onnx_client import OnnxClassifier, SnapshotError

    with zipfile.ZipFile(CIFAR10_ZIP) as z:
        names = [n for n in sorted(z.namelist()) if n.startswith("cifar10/train/") and n.endswith(".jpg")]
        cats = [z.read(n) for n in names if "/cat/" in n][:20]
        ships = [z.read(n) for n in names if "/ship/" in n][:20]
    hostile = {
        "thin": encoded(Image.new("L", (300_000, 1)), "PNG"),
        "huge": encoded(Image.new("L", (7000, 7000)), "PNG"),
        "truncated": photo[: len(photo) // 2],
        "cmyk": encoded(Image.open(io.BytesIO(photo)).convert("CMYK"), "JPEG"),
    }
    server = Server(tmp_path / "svc").start()
    try:
        for label, blobs in (("cat", cats), ("ship", ships)):
            files = [("image", (f"{i}.jpg", b, "image/jpeg")) for i, b in enumerate(blobs)]
            assert httpx.post(f"{server.url}/samples", files=files, data={"label": label}).status_code == 201
        for name, data in hostile.items():
            r = httpx.post(f"{server.url}/samples", files=[("image", ("x", data, "image/png"))], data={"label": "cat"})
            assert 400 <= r.status_code < 500 and r.json()["error"] in (
                "extreme_aspect_ratio", "too_many_pixels", "corrupt_image", "unsupported_mode"), (name, r.text)
            assert 400 <= httpx.post(f"{server.url}/predict", json={"images": [b64(data)]}).status_code < 500
        assert status(server)["samples_received"] == 40
        wait_trained(server, 40)  # both classes learned: the snapshot below answers what /predict did
        exif = Image.Exif()
        exif[0x0112] = 6
        upright = Image.open(io.BytesIO(photo)).rotate(-90, expand=True)
        sideways = encoded(upright.rotate(90, expand=True), "JPEG", quality=95, exif=exif.tobytes())
        answers = httpx.post(f"{server.url}/predict", json={"images": [b64(sideways), b64(read_png(sideways))],
                                                            "k": 2}).json()["results"]
        assert answers[0] == answers[1]
        snap = httpx.post(f"{server.url}/snapshots", timeout=300).json()
        onnx = OnnxClassifier(httpx.get(f"{server.url}/snapshots/{snap['id']}").content)
    finally:
        server.stop()
    for name, data in hostile.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SnapshotError):
            onnx.predict([tmp_path / name])
    (tmp_path / "sideways.jpg").write_bytes(sideways)
    assert [t["label"] for t in onnx.predict([tmp_path / "sideways.jpg"], k=2)[0]] == [t["label"] for t in answers[0]]


def read_png(data: bytes) -> bytes:
    """The image as the rule reads it, saved losslessly at the input size."""
    return encoded(Image.fromarray(read_image(data, 32).transpose(1, 2, 0)), "PNG")


@pytest.fixture(scope="module")
def jpegtran():
    """libjpeg-turbo's jpegtran (Debian: libjpeg-turbo-progs), which scripts/test.sh installs."""
    import shutil

    if shutil.which("jpegtran") is None:
        pytest.fail("jpegtran is missing: scripts/test.sh installs libjpeg-turbo-progs")


def test_real_progressive_jpegs_are_read_up_to_the_scan_limit_and_refused_past_it(photo, jpegtran):
    im = Image.open(io.BytesIO(photo))
    pillow = encoded(im, "JPEG", progressive=True, quality=90)
    assert read_structure(pillow).scans == 10 and read_image(pillow, 32).std() > 5
    for scans in (12, MAX_SCANS):  # jpegtran's scan scripts: a few scans, and as many as its own limit
        scripted = jpegtran_scans(photo, band_script(scans))
        assert read_structure(scripted).scans == scans
        assert np.abs(read_image(scripted, 32).astype(int) - read_image(photo, 32)).mean() < 1  # lossless
    one_more = repeat_last_scan(jpegtran_scans(photo, band_script(MAX_SCANS)), at_most=1)
    err = rejected(one_more)
    assert (err.code, err.status) == ("too_many_scans", 422) and str(MAX_SCANS) in err.detail


def test_a_scan_bomb_is_refused_before_decoding(photo):
    bomb = repeat_last_scan(encoded(Image.open(io.BytesIO(photo)), "JPEG", progressive=True), until_bytes=400_000)
    assert read_structure(bomb).scans > MAX_SCANS
    err = rejected(bomb)
    assert (err.code, err.status) == ("too_many_scans", 422)


@pytest.mark.parametrize("progressive", [False, True])
def test_a_jpeg_whose_data_cannot_cover_its_declared_frame_is_corrupt(progressive):
    lie = lying_jpeg(6000, 6000, progressive)  # under every size cap: only the data gives it away
    assert len(lie) < 1000 and read_structure(lie).width == 6000
    err = rejected(lie)
    assert (err.code, err.status) == ("corrupt_image", 422) and "covered" in err.detail
    honest = encoded(textured(600, 600), "JPEG", progressive=progressive, quality=10)
    assert read_image(honest, 32).shape == (3, 32, 32)  # a small, flat but honest JPEG passes


def test_a_progressive_jpeg_whose_coefficients_exceed_the_cap_is_refused():
    big = encoded(Image.new("RGB", (4800, 4800), (90, 140, 200)), "JPEG", progressive=True, subsampling=0)
    err = rejected(big)  # 4:4:4 at 4800x4800: 3 x 360,000 blocks x 128 bytes = 132 MiB buffered
    assert (err.code, err.status) == ("too_many_pixels", 413) and "MiB" in err.detail
    baseline = encoded(Image.new("RGB", (4800, 4800), (90, 140, 200)), "JPEG", subsampling=0)
    assert read_image(baseline, 32).shape == (3, 32, 32)  # a baseline JPEG decodes at 1/8 scale: no buffer


def test_lying_and_bombing_jpegs_are_refused_in_every_form_and_store_nothing(tmp_path, photo):
    from clients.onnx_client import OnnxClassifier, SnapshotError

    from .test_hardening import post_samples, stream_acks, ws_ack

    hostile = {"lying": lying_jpeg(9000, 9000), "lying progressive": lying_jpeg(6000, 6000, progressive=True),
               "scan bomb": repeat_last_scan(encoded(Image.open(io.BytesIO(photo)), "JPEG", progressive=True),
                                             until_bytes=600_000)}
    server = Server(tmp_path / "svc").start()
    try:
        assert post_samples(server, [("cat", photo)]).status_code == 201
        for name, data in hostile.items():
            one = {"label": "cat", "image": b64(data)}
            answers = [post_samples(server, [("cat", data)]),
                       httpx.post(f"{server.url}/samples", files={"image": ("x.jpg", data, "image/jpeg")},
                                  data={"label": "cat"}, timeout=TIMEOUT),
                       httpx.post(f"{server.url}/predict", json={"images": [b64(data)]}, timeout=TIMEOUT),
                       httpx.post(f"{server.url}/predict", files={"image": ("x.jpg", data, "image/jpeg")},
                                  timeout=TIMEOUT)]
            codes = {r.json().get("error") for r in answers}
            assert all(r.status_code == 422 for r in answers) and codes <= {"corrupt_image", "too_many_scans"}, \
                (name, [(r.status_code, r.text[:100]) for r in answers])
            assert stream_acks(server, [one])[0]["status"] == 422, name
            assert ws_ack(server, one)["status"] == 422, name
        assert status(server)["samples_received"] == 1
        wait_trained(server, 1)
        snap = httpx.post(f"{server.url}/snapshots", timeout=300).json()
        onnx = OnnxClassifier(httpx.get(f"{server.url}/snapshots/{snap['id']}").content)
    finally:
        server.stop()
    for name, data in hostile.items():
        (tmp_path / "hostile.jpg").write_bytes(data)
        with pytest.raises(SnapshotError):
            onnx.predict([tmp_path / "hostile.jpg"])

"""What one image can cost the input rule (`learner.formats.snapshot.read_image`): hostile JPEGs
built as an attacker would, and the worst images the rule still accepts, each decoded in a fresh
process whose CPU seconds and peak resident memory are measured.

- a scan bomb: a progressive JPEG whose last scan is repeated until the file is just under 1 MB;
- a lying JPEG: a small image's frame header rewritten to declare 9000x9000 (baseline) or
  9400x9400 (progressive) over its few bytes of data;
- a progressive JPEG of `jpegtran -scans` (spectral selection split band by band: a valid file) at
  the rule's MAX_SCANS, which is jpegtran's own limit for a scan script, and its last scan once more;
- the worst accepted: a progressive JPEG at the coefficient cap with MAX_SCANS scans, and a baseline
  JPEG at Pillow's bomb limit, both under the 1 MB body limit.

    python -m clients.bench.cost.image_costs --out results/images/image-costs.json
"""

from __future__ import annotations

import argparse
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from clients.bench.results import write_result
from learner.formats.jpeg_structure import read_structure
from learner.formats.snapshot import MAX_COEFFICIENT_BYTES, MAX_SCANS

BODY_LIMIT = 1024 * 1024  # the service's default ASER_MAX_IMAGE_BYTES


def encode(image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", **options)
    return out.getvalue()


def textured(width: int, height: int, seed: int = 0):
    """A smooth random image (cheap to build at any size, compresses like a photo's sky)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(2, height // 64), max(2, width // 64), 3), dtype=np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)


def scan_segments(data: bytes) -> tuple[int, int]:
    """(start of the last scan's SOS marker, start of the end-of-image marker)."""
    eoi = data.rindex(b"\xff\xd9")
    return data.rindex(b"\xff\xda", 0, eoi), eoi


def repeat_last_scan(data: bytes, until_bytes: int = BODY_LIMIT - 1024, at_most: int | None = None) -> bytes:
    """The scan bomb: the last scan repeated until the file is just under `until_bytes` (or `at_most` times)."""
    start, eoi = scan_segments(data)
    last = data[start:eoi]
    copies = max(1, (until_bytes - len(data)) // len(last))
    copies = min(copies, at_most) if at_most else copies
    return data[:eoi] + last * copies + data[eoi:]


def lying_jpeg(width: int, height: int, progressive: bool = False) -> bytes:
    """A 16x16 JPEG whose frame header declares width x height: a few bytes of data for a large frame."""
    data = bytearray(encode(textured(16, 16), quality=75, progressive=progressive))
    sof = data.index(b"\xff\xc2" if progressive else b"\xff\xc0")
    data[sof + 5:sof + 7] = height.to_bytes(2, "big")
    data[sof + 7:sof + 9] = width.to_bytes(2, "big")
    return bytes(data)


def band_script(scans: int) -> str:
    """A valid `jpegtran -scans` script of exactly `scans` scans (4 to 100, jpegtran's own limit):
    the DC scan, then each component's AC coefficients split into bands of one coefficient (luma
    first), the last band of each component widened to fit."""
    if not 4 <= scans <= 100:
        raise ValueError(f"a band script has 4 to 100 scans, not {scans}")
    luma = min(63, scans - 3)
    cb = min(63, scans - 1 - luma - 1)
    lines = ["0 1 2: 0 0 0 0;"]
    for component, bands in ((0, luma), (1, cb), (2, scans - 1 - luma - cb)):
        lines += [f"{component}: {b} {b} 0 0;" for b in range(1, bands)]
        lines.append(f"{component}: {bands} 63 0 0;")
    return "\n".join(lines) + "\n"


def jpegtran_scans(data: bytes, script: str) -> bytes:
    """`data` rewritten losslessly by libjpeg-turbo's jpegtran with the scan script `script`."""
    if shutil.which("jpegtran") is None:
        raise RuntimeError("jpegtran is not installed (Debian: libjpeg-turbo-progs)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "scans.txt").write_text(script)
        (Path(tmp) / "in.jpg").write_bytes(data)
        subprocess.run(["jpegtran", "-scans", str(Path(tmp) / "scans.txt"), "-outfile", str(Path(tmp) / "out.jpg"),
                        str(Path(tmp) / "in.jpg")], check=True)
        return (Path(tmp) / "out.jpg").read_bytes()


def largest_under(build, low: int, high: int, limit: int = BODY_LIMIT) -> tuple[int, bytes]:
    """The largest side in [low, high] whose `build(side)` fits `limit` bytes (bisection)."""
    best = (low, build(low))
    while high - low > 64:
        mid = (low + high) // 2
        data = build(mid)
        if len(data) <= limit:
            best, low = (mid, data), mid
        else:
            high = mid
    return best


# the child reads its peak resident memory from VmHWM (this process's own, unlike getrusage's
# ru_maxrss, which an exec'd child inherits from its parent)
_CHILD = """
import re, resource, sys, time
from learner.formats.snapshot import ImageRejected, read_image
def peak_kib():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
data = open(sys.argv[1], "rb").read()
before, rss0 = resource.getrusage(resource.RUSAGE_SELF), peak_kib()
t0 = time.perf_counter()
try:
    if sys.argv[3] == "rule":
        read_image(data, int(sys.argv[2]))
    else:  # what the rule did before the marker checks: Pillow's decode at draft scale
        from PIL import Image; import io
        im = Image.open(io.BytesIO(data)); im.draft("RGB", (int(sys.argv[2]),) * 2); im.load()
    answer = "accepted"
except ImageRejected as e:
    answer = f"{e.status} {e.code}"
after = resource.getrusage(resource.RUSAGE_SELF)
print(answer, time.perf_counter() - t0, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
      rss0, peak_kib())
"""


def measure(data: bytes, size: int, how: str = "rule") -> dict:
    """read_image on `data` in a fresh process (`how` "decode": Pillow's decode alone, as before the
    marker checks): the answer, its wall and CPU seconds, and how much its peak resident memory grew."""
    with tempfile.NamedTemporaryFile(suffix=".jpg") as f:
        f.write(data)
        f.flush()
        out = subprocess.run([sys.executable, "-c", _CHILD, f.name, str(size), how], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[3]).stdout.split()
    answer = " ".join(out[:-4])
    wall, cpu, rss0, rss1 = (float(x) for x in out[-4:])
    structure = read_structure(data)
    return {"answer": answer, "bytes": len(data), "declared": f"{structure.width}x{structure.height}",
            "scans": structure.scans, "progressive": structure.progressive,
            "coefficient_mib": round(structure.coefficient_bytes / 2**20, 1),
            "wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "peak_rss_growth_mib": round((rss1 - rss0) / 1024, 1)}


def cases() -> dict[str, bytes]:
    from PIL import Image

    cap_side = int(math.sqrt(MAX_COEFFICIENT_BYTES / (1.5 * 128)) * 8) // 16 * 16  # 4:2:0 at the cap
    at_limit = band_script(MAX_SCANS)
    image = textured(cap_side, cap_side)
    for quality in range(30, 0, -5):  # as much data as the body limit holds: every coefficient page touched
        worst_progressive = jpegtran_scans(encode(image, quality=quality), at_limit)
        if len(worst_progressive) <= BODY_LIMIT:
            break
    bomb_side = 9400
    bomb = repeat_last_scan(encode(Image.new("RGB", (bomb_side, bomb_side), "grey"), quality=50, progressive=True))
    bomb_limit = int(math.sqrt(Image.MAX_IMAGE_PIXELS)) // 16 * 16
    _, worst_baseline = largest_under(lambda s: encode(textured(s, s), quality=5), 4000, bomb_limit)
    return {
        "scan bomb (9400x9400, last scan repeated to 1 MB)": bomb,
        "lying baseline JPEG (16x16 data, declares 9000x9000)": lying_jpeg(9000, 9000),
        "lying progressive JPEG (16x16 data, declares 9400x9400)": lying_jpeg(9400, 9400, progressive=True),
        f"jpegtran -scans, {MAX_SCANS} band scans of a 1024x768 photo and its last one again": repeat_last_scan(
            jpegtran_scans(encode(textured(1024, 768), quality=90), band_script(MAX_SCANS)), at_most=1),
        f"worst accepted progressive ({cap_side}x{cap_side}, {MAX_SCANS} scans)": worst_progressive,
        "worst accepted baseline (largest side under the bomb limit and 1 MB)": worst_baseline,
        "an ordinary camera JPEG (4032x3024, quality 85)": encode(textured(4032, 3024), quality=85),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m clients.bench.cost.image_costs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=32, help="the model's input size the rule fits images to")
    parser.add_argument("--out", help="write the measurements (JSON) here")
    args = parser.parse_args(argv)
    rows = {}
    for name, data in cases().items():
        rows[name] = measure(data, args.size)
        print(f"{name}: {rows[name]}", flush=True)
        if name.startswith(("scan bomb", "lying")):  # what it cost before the rule read the markers
            rows[f"{name}, decoded without the marker checks"] = measure(data, args.size, "decode")
            print(f"  without the checks: {rows[f'{name}, decoded without the marker checks']}", flush=True)
    result = {"cases": rows, "max_scans": MAX_SCANS, "max_coefficient_mib": MAX_COEFFICIENT_BYTES // 2**20,
              "decodes_at_once": os.cpu_count(), "machine": f"{os.cpu_count()} cores",
              "command": "python -m clients.bench.cost.image_costs " + " ".join(argv or sys.argv[1:]),
              "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.out:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

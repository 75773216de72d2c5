"""What a JPEG's markers say before a pixel is decoded: its frame, its scans, and how many bytes of
entropy-coded data each scan carries. The input rule (`learner.formats.snapshot.read_image`) reads
it to refuse the two JPEGs whose cost hides past the header:

- a scan bomb: every scan of a progressive JPEG is a pass over the whole coefficient buffer, so a
  file of repeated (even empty) scans costs time in proportion to their number, not to its size;
- a lying JPEG: a header that declares a large frame over a few bytes of data; libjpeg fills what
  is missing with grey, with a warning no caller sees, after allocating the whole frame.

The coverage bound: every block of every component has a DC coefficient, coded with at least one
bit of Huffman code in the first scan that carries it (Ss = 0, Ah = 0), so that scan holds at least
(its components' blocks) / 8 bytes of data. Arithmetic coding can spend less than a bit a block:
no camera writes it, and the rule refuses it.

>>> import io
>>> from PIL import Image
>>> buf = io.BytesIO(); Image.new("RGB", (64, 48), "red").save(buf, "JPEG", progressive=True)
>>> s = read_structure(buf.getvalue())
>>> (s.width, s.height, s.progressive, s.scans), s.uncovered()
((64, 48, True, 10), [])
>>> s.coefficient_bytes
9216
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

# SOFn markers: 0 baseline, 1 extended, 2 progressive (Huffman); 3, 5-7 lossless or hierarchical;
# 9-11, 13-15 arithmetic-coded
SOF_HUFFMAN = {0xC0: False, 0xC1: False, 0xC2: True}
SOF_OTHER = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
SOS, EOI, SOI = 0xDA, 0xD9, 0xD8
STANDALONE = {0x01, *range(0xD0, 0xD8)}
# the next marker after entropy-coded data: 0xFF (after any fill 0xFFs) not followed by 0x00 (a stuffed
# byte) or a restart marker
_NEXT_MARKER = re.compile(rb"\xff+[^\x00\xd0-\xd7\xff]")
_RESTART = re.compile(rb"\xff[\xd0-\xd7]")


class JpegStructureError(ValueError):
    """The markers themselves are broken (`kind`: "corrupt") or name a coding the rule refuses
    ("unsupported")."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


@dataclass
class Scan:
    components: list[int]  # component ids
    first_dc: bool  # Ss = 0 and Ah = 0: the scan that first codes these components' DC coefficients
    data_bytes: int  # entropy-coded bytes, without stuffed zeros and restart markers


@dataclass
class JpegStructure:
    width: int
    height: int
    progressive: bool
    components: dict[int, tuple[int, int]]  # id -> (horizontal, vertical) sampling factor
    scan_list: list[Scan] = field(default_factory=list)

    @property
    def scans(self) -> int:
        return len(self.scan_list)

    def blocks(self, component: int) -> int:
        """8x8 blocks of one component (without the MCU padding of interleaved scans: a lower bound)."""
        h, v = self.components[component]
        h_max = max(c[0] for c in self.components.values())
        v_max = max(c[1] for c in self.components.values())
        return math.ceil(math.ceil(self.width * h / h_max) / 8) * math.ceil(math.ceil(self.height * v / v_max) / 8)

    @property
    def coefficient_bytes(self) -> int:
        """What a progressive decode buffers: every coefficient of every block, 2 bytes each."""
        return sum(self.blocks(c) for c in self.components) * 64 * 2

    def uncovered(self) -> list[int]:
        """Components whose first DC scan is missing or holds fewer bytes than one bit a block."""
        short, seen = [], set()
        for scan in self.scan_list:
            fresh = [c for c in scan.components if c not in seen] if scan.first_dc else []
            seen.update(fresh)
            if fresh and scan.data_bytes * 8 < sum(self.blocks(c) for c in fresh):
                short.extend(fresh)
        return short + [c for c in self.components if c not in seen]


def read_structure(data: bytes) -> JpegStructure:
    """Walk the markers of the first image in `data` (up to its end-of-image marker); the entropy-
    coded data is skipped with a regular expression, so this costs a scan of the bytes, no decode."""
    if data[:2] != b"\xff\xd8":
        raise JpegStructureError("corrupt", "no JPEG start-of-image marker")
    frame, pos, n = None, 2, len(data)
    while pos < n:
        if data[pos] != 0xFF:
            raise JpegStructureError("corrupt", f"expected a JPEG marker at byte {pos}")
        while pos + 1 < n and data[pos + 1] == 0xFF:
            pos += 1  # fill bytes
        if pos + 1 >= n:
            break
        marker, pos = data[pos + 1], pos + 2
        if marker == EOI:
            break
        if marker in STANDALONE or marker == SOI:
            continue
        if pos + 2 > n:
            break
        length = int.from_bytes(data[pos:pos + 2], "big")
        segment, pos = data[pos + 2:pos + length], pos + length
        if length < 2 or len(segment) != length - 2:
            raise JpegStructureError("corrupt", "a JPEG marker segment runs past the data")
        if marker in SOF_OTHER:
            raise JpegStructureError("unsupported", "arithmetic-coded, lossless and hierarchical JPEGs are not "
                                                    "accepted; send a baseline or progressive JPEG")
        if marker in SOF_HUFFMAN:
            frame = _frame(segment, SOF_HUFFMAN[marker])
        elif marker == SOS:
            if frame is None:
                raise JpegStructureError("corrupt", "a JPEG scan before its frame header")
            end = (m.start() if (m := _NEXT_MARKER.search(data, pos)) else n)
            frame.scan_list.append(_scan(segment, data[pos:end]))
            pos = end
    if frame is None:
        raise JpegStructureError("corrupt", "no JPEG frame header")
    return frame


def _frame(segment: bytes, progressive: bool) -> JpegStructure:
    if len(segment) < 6:
        raise JpegStructureError("corrupt", "a short JPEG frame header")
    height, width, count = int.from_bytes(segment[1:3], "big"), int.from_bytes(segment[3:5], "big"), segment[5]
    if width == 0 or height == 0 or count == 0 or len(segment) < 6 + 3 * count:
        raise JpegStructureError("corrupt", "the JPEG frame header declares no size or no components")
    components = {segment[6 + 3 * i]: (segment[7 + 3 * i] >> 4, segment[7 + 3 * i] & 15) for i in range(count)}
    if any(h == 0 or v == 0 for h, v in components.values()):
        raise JpegStructureError("corrupt", "a JPEG component with a zero sampling factor")
    return JpegStructure(width, height, progressive, components)


def _scan(segment: bytes, entropy: bytes) -> Scan:
    count = segment[0] if segment else 0
    if count == 0 or len(segment) < 4 + 2 * count:
        raise JpegStructureError("corrupt", "a short JPEG scan header")
    ids = [segment[1 + 2 * i] for i in range(count)]
    ss, ah = segment[1 + 2 * count], segment[3 + 2 * count] >> 4
    data_bytes = len(entropy) - entropy.count(b"\xff\x00") - 2 * len(_RESTART.findall(entropy))
    return Scan(ids, ss == 0 and ah == 0, data_bytes)

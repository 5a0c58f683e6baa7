"""JPEG routing: which images a fast decoder may take, which go to the PIL reference.

A fast decoder (DALI, nvJPEG) fails whole batches on one bad image, and DALI's CPU
decoder can crash the process when a sample fails to parse (a header-only JPEG is
enough). So each image is routed on its marker structure before a fast decoder sees
it: `jpeg_header` walks every segment from SOI to EOI and accepts only what
libjpeg-turbo decodes without an error (the checks of its jdmarker/jdhuff/jdinput/
jdsample, restated), with at least one scan that carries entropy-coded data. Anything
else goes to the PIL reference, which reads it exactly as the reference does (or fails
that one image).
"""
from __future__ import annotations

import io
import re
from dataclasses import dataclass

from engine.core.spec import Spec
from engine.decoders.pil import checked_window, failure

# modes the fast decoders take (DALI's decode is bit-exact with PIL for them). Not CMYK/YCCK: PIL reads
# every 4-component JPEG as Adobe-inverted CMYK, whatever its markers say, while DALI inverts only
# under an Adobe APP14 marker, so 4-component JPEGs (rare in photo sets) go to the reference
_JPEG_MODES = ("RGB", "L")
_FAST_SOF = {0xC0: "baseline", 0xC1: "extended", 0xC2: "progressive"}  # Huffman-coded 8-bit frames
_MODE_OF = {1: "L", 3: "RGB", 4: "CMYK"}   # components -> the mode PIL reports
MAX_PIXELS = 89_478_485    # PIL's Image.MAX_IMAGE_PIXELS: larger images take the reference path
MAX_BLOCKS_IN_MCU = 10     # libjpeg's D_MAX_BLOCKS_IN_MCU for an interleaved scan
MAX_FAST_SCANS = 256       # DALI's decoder refuses more scans (failing its whole batch): the reference reads them
# the next marker after entropy-coded data: FF00 (stuffing), FFD0-FFD7 (restarts), FFFF (fill) are data
_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


@dataclass(frozen=True)
class JpegHeader:
    width: int
    height: int
    mode: str          # L | RGB | CMYK
    frame: str         # baseline | extended | progressive
    scans: int
    subsampled: bool = False   # chroma at a lower resolution than luma (4:2:0, 4:2:2, ...)


class NotFast(ValueError):
    """The JPEG's structure is outside what the fast decoders are fed; the message says where."""


def jpeg_header(blob: bytes) -> JpegHeader:
    """The header of a JPEG a fast decoder may take; NotFast naming the first problem otherwise."""
    if blob[:2] != b"\xff\xd8":
        raise NotFast("no SOI marker: not a JPEG")
    n, pos = len(blob), 2
    frame = None                          # (marker, width, height, {component id: (h, v, tq)})
    qt: set[int] = set()
    dc: set[int] = set()
    ac: set[int] = set()
    scanned: dict[int, int] = {}          # component id -> scans that carried it
    dc_started: set[int] = set()          # progressive: components whose first DC scan was seen
    scans = 0
    while True:
        if pos >= n or blob[pos] != 0xFF:
            raise NotFast(f"no marker at byte {pos} (truncated or corrupt)")
        while pos < n and blob[pos] == 0xFF:  # fill bytes before a marker
            pos += 1
        if pos >= n:
            raise NotFast("ends inside a marker")
        m = blob[pos]
        pos += 1
        if m == 0xD9:                     # EOI
            if not scans:
                raise NotFast("no scan (SOS with data) before the end-of-image marker")
            _check_complete(frame, scanned, dc_started)
            w, h = frame[1], frame[2]
            sampling = {c[:2] for c in frame[3].values()}
            return JpegHeader(w, h, _MODE_OF[len(frame[3])], _FAST_SOF[frame[0]], scans, len(sampling) > 1)
        if m in (0x01, 0xD8) or 0xD0 <= m <= 0xD7:
            raise NotFast(f"unexpected marker FF{m:02X} at byte {pos - 2}")
        if pos + 2 > n:
            raise NotFast(f"segment FF{m:02X} cut off at byte {pos}")
        length = int.from_bytes(blob[pos:pos + 2], "big")
        if length < 2 or pos + length > n:
            raise NotFast(f"segment FF{m:02X} at byte {pos - 2}: length {length} runs past the end ({n} bytes)")
        seg = memoryview(blob)[pos + 2:pos + length]
        pos += length
        if 0xC0 <= m <= 0xCF and m not in (0xC4, 0xC8, 0xCC):          # SOFn
            if frame is not None:
                raise NotFast("a second frame header")
            if m not in _FAST_SOF:
                raise NotFast(f"frame type SOF{m - 0xC0} (lossless, hierarchical or arithmetic-coded)")
            frame = _sof(m, seg)
        elif m == 0xC4:
            _dht(seg, dc, ac)
        elif m == 0xDB:
            _dqt(seg, qt)
        elif m == 0xDD:
            if len(seg) != 2:
                raise NotFast(f"restart interval segment of {len(seg)} bytes, not 2")
        elif m == 0xDA:
            if frame is None:
                raise NotFast("scan before the frame header")
            _sos(seg, frame, qt, dc, ac, scanned, dc_started)
            nxt = _NEXT_MARKER.search(blob, pos)
            if nxt is None:
                raise NotFast("scan data runs to the end: no end-of-image marker (truncated)")
            if nxt.start() == pos:
                raise NotFast("a scan with no entropy-coded data")
            pos = nxt.start()
            scans += 1
        elif 0xE0 <= m <= 0xEF or m == 0xFE:                            # APPn, COM: skipped as libjpeg does
            pass
        else:
            raise NotFast(f"marker FF{m:02X} is not taken by the fast decoders")


def _sof(m: int, seg: memoryview):
    if len(seg) < 6:
        raise NotFast("frame header too short")
    precision, h, w, nf = seg[0], int.from_bytes(seg[1:3], "big"), int.from_bytes(seg[3:5], "big"), seg[5]
    if precision != 8:
        raise NotFast(f"{precision}-bit samples")
    if w == 0 or h == 0:
        raise NotFast(f"frame size {w}x{h} (a zero side needs a DNL marker)")
    if w * h > MAX_PIXELS:
        raise NotFast(f"{w}x{h} is above {MAX_PIXELS} pixels")
    if nf not in _MODE_OF or len(seg) != 6 + 3 * nf:
        raise NotFast(f"frame header with {nf} components in {len(seg) + 2} bytes")
    comps = {}
    for i in range(nf):
        cid, hv, tq = seg[6 + 3 * i], seg[7 + 3 * i], seg[8 + 3 * i]
        hs, vs = hv >> 4, hv & 15
        if cid in comps or not (1 <= hs <= 4 and 1 <= vs <= 4) or tq > 3:
            raise NotFast(f"frame component {cid}: duplicate id, sampling {hs}x{vs} or table {tq} out of range")
        comps[cid] = (hs, vs, tq)
    hmax, vmax = max(c[0] for c in comps.values()), max(c[1] for c in comps.values())
    if any(hmax % c[0] or vmax % c[1] for c in comps.values()):
        raise NotFast("fractional sampling factors (libjpeg cannot upsample them)")
    return m, w, h, comps


def _dqt(seg: memoryview, qt: set[int]) -> None:
    i = 0
    while i < len(seg):
        pq, tq = seg[i] >> 4, seg[i] & 15
        size = 64 * (pq + 1)
        if pq > 1 or tq > 3 or i + 1 + size > len(seg):
            raise NotFast(f"quantisation table {tq}: precision {pq} or length out of range")
        qt.add(tq)
        i += 1 + size


def _dht(seg: memoryview, dc: set[int], ac: set[int]) -> None:
    i = 0
    while i < len(seg):
        if i + 17 > len(seg):
            raise NotFast("Huffman table cut off")
        tc, th = seg[i] >> 4, seg[i] & 15
        counts = seg[i + 1:i + 17]
        total = sum(counts)
        if tc > 1 or th > 3 or total > 256 or i + 17 + total > len(seg):
            raise NotFast(f"Huffman table {tc}/{th}: class, index or {total} symbols out of range")
        code = 0
        for bits, count in enumerate(counts, 1):  # canonical codes; none may be all ones (jdhuff)
            code += count
            if code >= 1 << bits:
                raise NotFast(f"Huffman table {tc}/{th}: code lengths overflow at {bits} bits")
            code <<= 1
        values = seg[i + 17:i + 17 + total]
        if tc == 0 and any(v > 15 for v in values):
            raise NotFast(f"DC Huffman table {th}: a symbol above 15")
        (ac if tc else dc).add(th)
        i += 17 + total


def _sos(seg: memoryview, frame, qt, dc, ac, scanned: dict[int, int], dc_started: set[int]) -> None:
    m, _, _, comps = frame
    ns = seg[0] if len(seg) else 0
    if not 1 <= ns <= 4 or len(seg) != 4 + 2 * ns:
        raise NotFast(f"scan header with {ns} components in {len(seg) + 2} bytes")
    ss, se, ah, al = seg[1 + 2 * ns], seg[2 + 2 * ns], seg[3 + 2 * ns] >> 4, seg[3 + 2 * ns] & 15
    ids = [seg[1 + 2 * k] for k in range(ns)]
    tables = [(seg[2 + 2 * k] >> 4, seg[2 + 2 * k] & 15) for k in range(ns)]
    if len(set(ids)) != ns or any(c not in comps for c in ids):
        raise NotFast(f"scan components {ids} are not the frame's {sorted(comps)}")
    if ns > 1 and sum(comps[c][0] * comps[c][1] for c in ids) > MAX_BLOCKS_IN_MCU:
        raise NotFast("sampling factors too large for an interleaved scan")
    if any(comps[c][2] not in qt for c in ids):
        raise NotFast("a scan component's quantisation table is not defined")
    progressive = m == 0xC2
    if not progressive:
        if (ss, se, ah, al) != (0, 63, 0, 0):
            raise NotFast(f"sequential scan with spectral selection {ss}-{se}, approximation {ah}/{al}")
        need_dc, need_ac = True, True
    else:
        bad = (se != 0) if ss == 0 else (ss > se or se > 63 or ns != 1)
        if bad or (ah != 0 and al != ah - 1) or al > 13:
            raise NotFast(f"progressive scan parameters {ss}-{se}, {ah}/{al} for {ns} components")
        need_dc, need_ac = ss == 0 and ah == 0, ss > 0
        if ss > 0 and ids[0] not in dc_started:
            raise NotFast("an AC scan before the component's first DC scan")
        if ss == 0 and ah == 0:
            dc_started.update(ids)
    for (td, ta) in tables:
        if (need_dc and td not in dc) or (need_ac and ta not in ac):
            raise NotFast(f"scan uses Huffman table DC {td} / AC {ta}, which is not defined")
    for c in ids:
        scanned[c] = scanned.get(c, 0) + 1


def _check_complete(frame, scanned: dict[int, int], dc_started: set[int]) -> None:
    comps = frame[3]
    if frame[0] == 0xC2:
        if set(dc_started) != set(comps):
            raise NotFast("a component never gets a DC scan")
    elif any(scanned.get(c) != 1 for c in comps):
        raise NotFast("sequential JPEG whose components are not each scanned exactly once")


def probe(blob: bytes) -> tuple[int, int, str, str]:
    """(width, height, format, mode) from the header only; raises if PIL cannot parse it."""
    from PIL import Image

    with Image.open(io.BytesIO(blob)) as im:
        return im.size[0], im.size[1], im.format or "", im.mode


def route(blobs: list[bytes | None], spec: Spec, modes: tuple[str, ...] = _JPEG_MODES, subsampled: bool = True):
    """Split a batch: (fast [(index, Window)], slow [index], failed {index: reason}).

    Fast: JPEGs whose whole marker structure `jpeg_header` accepts, in `modes`, with at
    most MAX_FAST_SCANS scans, for a GPU/DALI decoder. Slow: every other file PIL can open
    (other formats, truncated or header-only JPEGs, unusual frames), for the PIL reference,
    which reads them as the reference does. Failed: nothing reads them, or the image is
    over the pixel budget (pil.checked_window), found from its header before any decode.
    `subsampled=False` also sends chroma-subsampled JPEGs to the reference (for a decoder
    without libjpeg's fancy upsampling).
    """
    fast, slow, failed = [], [], {}
    for i, blob in enumerate(blobs):
        if blob is None:
            failed[i] = "not read"
            continue
        try:
            head = jpeg_header(blob)
        except (NotFast, ValueError):
            head = None
        try:
            if head is not None:
                win = checked_window(head.width, head.height, spec)
                if head.mode in modes and (subsampled or not head.subsampled) and head.scans <= MAX_FAST_SCANS:
                    fast.append((i, win))
                    continue
            else:
                w, h, _, _ = probe(blob)
                checked_window(w, h, spec)
        except Exception as e:  # noqa: BLE001 - unparseable header or over the budget: nothing reads it
            failed[i] = failure(e)
            continue
        slow.append(i)
    return fast, slow, failed

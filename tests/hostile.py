"""Hostile inputs, generated: JPEGs that parse as headers but carry no image, JPEGs with flipped
header bits, and the non-files (FIFO, directory, device, empty file) a scored run may meet."""
from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import numpy as np


def segments(blob: bytes) -> list[tuple[int, int, int]]:
    """(marker, offset of FFxx, segment length) of every segment before the first scan's data."""
    out, pos = [], 2
    while pos + 4 <= len(blob) and blob[pos] == 0xFF:
        m, length = blob[pos + 1], int.from_bytes(blob[pos + 2:pos + 4], "big")
        out.append((m, pos, length))
        if m == 0xDA:
            break
        pos += 2 + length
    return out


def header_only(blob: bytes) -> bytes:
    """SOI, APPn, DQT, SOF, DHT ... then EOI: every header, no scan (the DALI crash of the issue)."""
    sos = next(off for m, off, _ in segments(blob) if m == 0xDA)
    return blob[:sos] + b"\xff\xd9"


def flip(blob: bytes, at: int, bit: int = 0) -> bytes:
    data = bytearray(blob)
    data[at] ^= 1 << bit
    return bytes(data)


def header_flips(blob: bytes, rng: np.random.Generator, n: int) -> list[bytes]:
    """`n` variants of `blob` with 1-3 bits flipped among its header bytes (SOI .. the scan header),
    plus one targeted flip each in the frame size, a Huffman count and the scan's component count."""
    segs = segments(blob)
    end = segs[-1][1] + 2 + segs[-1][2]
    out = []
    for _ in range(n):
        data = blob
        for _ in range(int(rng.integers(1, 4))):
            data = flip(data, int(rng.integers(2, end)), int(rng.integers(0, 8)))
        out.append(data)
    for m, off, _ in segs:
        if m == 0xC0:
            out.append(flip(blob, off + 5, 7))         # frame height, high bit
        elif m == 0xC4:
            out.append(flip(blob, off + 5 + 3, 2))     # a code-length count of the first table
        elif m == 0xDA:
            out.append(flip(blob, off + 4, 1))         # number of scan components
    return out


def hostile_jpegs(good: list[bytes], seed: int = 0) -> list[tuple[str, bytes]]:
    """(kind, bytes): header-only files and header bit flips made from `good` JPEGs."""
    rng = np.random.default_rng(seed)
    out = []
    for i, blob in enumerate(good):
        out.append(("header-only", header_only(blob)))
        out += [("header-flip", b) for b in header_flips(blob, rng, 2 if i % 2 else 1)]
    return out


def hostile_cohort(src: Path, dst: Path, batch: int, seed: int = 0) -> dict[str, str]:
    """A cohort in `dst` from the generated cohort `src` in which every batch of `batch` rows holds a
    header-only or header-flipped JPEG (two per batch), plus a FIFO, a directory, an empty file and (as root) a
    character device. Returns {request id: kind} of the hostile rows; writes dst/manifest.tsv."""
    items = json.loads((src / "cohort.json").read_text())["items"]
    goods = [it for it in items if it["encoding"].split()[0] in ("rgb", "progressive", "gray")]
    good_blobs = [(src / it["path"]).read_bytes() for it in goods]
    bad = hostile_jpegs(good_blobs[:6], seed)
    img = dst / "images"
    img.mkdir(parents=True)
    rows, kinds = [], {}
    for i, it in enumerate(goods):
        shutil.copy(src / it["path"], img / f"good_{i:03d}.JPEG")
    specials = {"fifo": lambda p: os.mkfifo(p), "directory": lambda p: p.mkdir(),
                "empty": lambda p: p.write_bytes(b"")}
    if os.geteuid() == 0:
        specials["device"] = lambda p: os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # like /dev/null
    for name, make in specials.items():
        make(img / f"{name}.JPEG")
    n_batches = (len(bad) + 1) // 2 + 1
    g = b = 0
    for k in range(n_batches):
        for j in range(batch):
            rid = f"r{k:02d}_{j:02d}"
            if j in (3, 11) and b < len(bad):                 # two hostile JPEGs in every batch
                kind, data = bad[b]
                (img / f"bad_{b:03d}.JPEG").write_bytes(data)
                rows.append(f"{rid}\timages/bad_{b:03d}.JPEG")
                kinds[rid] = kind
                b += 1
            elif j == 7 and k < len(specials):
                name = list(specials)[k]
                rows.append(f"{rid}\timages/{name}.JPEG")
                kinds[rid] = name
            else:
                rows.append(f"{rid}\timages/good_{g % len(goods):03d}.JPEG")
                g += 1
    (dst / "manifest.tsv").write_text("\n".join(rows) + "\n")
    return kinds


def many_scans(side: int = 4096, copies: int = 5000) -> bytes:
    """A progressive grey JPEG of side x side px whose first AC scan is repeated `copies` times.

    libjpeg only warns about the repeated scans (a bogus progression) and decodes every one: each
    visits all (side / 8)^2 blocks, ~6 ms at 4096 px, so 5000 copies keep PIL busy ~30 s for
    a file of ~240 KB (a flat image: each scan is a few end-of-band runs). More than DALI's 256
    scans, so the router sends it to the reference. The 20,000-scan JPEG of a hostile cohort,
    at test size.
    """
    import io
    import re

    from PIL import Image

    buf = io.BytesIO()
    Image.new("L", (side, side), 128).save(buf, "JPEG", progressive=True, quality=90)
    blob = buf.getvalue()
    pos = 0
    while True:                                       # the first scan with Ss > 0 (an AC scan)
        sos = blob.index(b"\xff\xda", pos)
        head = 2 + int.from_bytes(blob[sos + 2:sos + 4], "big")
        end = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]").search(blob, sos + head).start()
        if blob[sos + 4 + 1 + 2 * blob[sos + 4]] > 0:
            break
        pos = end
    return blob[:end] + blob[sos:end] * copies + blob[end:]


def padded_jpeg(blob: bytes, size: int) -> bytes:
    """`blob` (a JPEG) grown to exactly `size` bytes with APP15 segments after SOI: decoders skip
    them, so a file of any size decodes as the small image it holds."""
    need = size - len(blob)
    segs = []
    while need > 0:
        body = min(need - 4, 65533)
        if body < 0:                                  # fewer than 4 bytes left: no segment fits
            raise ValueError(f"cannot pad {len(blob)} bytes to exactly {size}")
        segs.append(b"\xff\xef" + (body + 2).to_bytes(2, "big") + bytes(body))
        need -= 4 + body
        if 0 < need < 4:                              # leave room for one more whole segment
            segs[-1] = segs[-1][:-(4 - need)]
            segs[-1] = segs[-1][:2] + (len(segs[-1]) - 2).to_bytes(2, "big") + segs[-1][4:]
            need = 4
    return blob[:2] + b"".join(segs) + blob[2:]

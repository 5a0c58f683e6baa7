"""A damaged index is refused, never answered: every file's sha256, finite unit rows and distinct
ids are checked when it is opened (load_index, scripts/run.sh), and a damaged chunk of an
unfinished build is rebuilt with one line."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from cir_helpers import build_args, built_index, clip_dirs, corpus, run_args

from engine.retrieval.index import BUILD_DIR, NORM_TOL, IndexLoadError, commit, load_index
from evaluator.cir import build as cir_build
from evaluator.cir import run as cir_run

HEADER = 128   # bytes of the .npy header numpy writes for a [320, 64] float16 array


def _copy(tmp_path):
    d = tmp_path / "index"
    shutil.copytree(built_index(), d)
    meta = json.loads((d / "meta.json").read_text())
    return d, meta, d / meta["files"]["embeddings"], d / meta["files"]["ids"]


def _poke(path, offsets, value: int) -> None:
    data = bytearray(path.read_bytes())
    for o in offsets:
        data[o] = value
    path.write_bytes(bytes(data))


def _set_rows(path, rows, value) -> None:
    data = bytearray(path.read_bytes())
    arr = np.frombuffer(data, np.float16, offset=HEADER).reshape(320, 64).copy()
    arr[rows] = value
    data[HEADER:] = arr.tobytes()
    path.write_bytes(bytes(data))


def _swap_ids(path) -> None:
    ids = json.loads(path.read_text())
    ids[3], ids[7] = ids[7], ids[3]
    path.write_text(json.dumps(ids))


def _other_build(d, meta, emb_path, ids_path, tmp_path) -> None:
    """meta.json pointing at another build's embeddings of the same shape (rows in another order)."""
    other = tmp_path / "other"
    other.mkdir()
    idx = load_index(built_index())
    m = commit(other, np.asarray(idx.emb)[::-1], idx.ids, {})
    shutil.copy(other / m["files"]["embeddings"], d / m["files"]["embeddings"])
    meta["files"]["embeddings"] = m["files"]["embeddings"]
    (d / "meta.json").write_text(json.dumps(meta))


DAMAGE = {
    # one byte: the high byte of row 5, column 3 -> about -26,000 (that row ranked first for every query)
    "one flipped byte": lambda d, m, e, i, t: _poke(e, [HEADER + (5 * 64 + 3) * 2 + 1], 0xF6),
    "64 flipped bytes": lambda d, m, e, i, t: _poke(e, range(HEADER + 1000, HEADER + 1064), 0x00),
    "4 NaN rows": lambda d, m, e, i, t: _set_rows(e, [0, 9, 99, 199], np.nan),
    "10 zeroed rows": lambda d, m, e, i, t: _set_rows(e, list(range(10, 20)), 0),
    "two swapped ids": lambda d, m, e, i, t: _swap_ids(i),
    "another build's embeddings": _other_build,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_index_is_refused_naming_the_file_and_force(damage, tmp_path, capsys):
    d, meta, emb, ids = _copy(tmp_path)
    DAMAGE[damage](d, meta, emb, ids, tmp_path)
    with pytest.raises(IndexLoadError, match="sha256 differs") as e:
        load_index(d)
    named = json.loads((d / "meta.json").read_text())["files"]["ids" if "ids" in damage else "embeddings"]
    assert named in str(e.value) and "scripts/build.sh --force" in str(e.value)
    args = run_args(corpus() / "requests.jsonl", tmp_path / "o.jsonl")
    args[args.index("--index-dir") + 1] = str(d)
    capsys.readouterr()
    assert cir_run.main(args) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("scripts/run.sh: error: ") and named in lines[0], err
    assert "rebuild it with scripts/build.sh --force" in lines[0]
    assert not (tmp_path / "o.jsonl").exists()                # nothing answered from it


def _rehash(d, meta, name) -> None:
    """meta.json's sha256 made to match the damaged file: the row and id checks must still hold."""
    meta["sha256"][name] = hashlib.sha256((d / meta["files"][name]).read_bytes()).hexdigest()
    (d / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize("damage, needle", [("4 NaN rows", "row 0 has norm nan"),
                                            ("10 zeroed rows", "row 10 has norm 0"),
                                            ("one flipped byte", "row 5 has norm 2.5")])
def test_rows_are_checked_even_when_the_digest_agrees(damage, needle, tmp_path):
    d, meta, emb, ids = _copy(tmp_path)
    DAMAGE[damage](d, meta, emb, ids, tmp_path)
    _rehash(d, meta, "embeddings")
    with pytest.raises(IndexLoadError, match=needle):
        load_index(d)
    assert load_index(d, verify=False).emb.shape == (320, 64)     # the check is what refuses it


def test_ids_must_be_distinct_even_when_the_digest_agrees(tmp_path):
    d, meta, emb, ids = _copy(tmp_path)
    values = json.loads(ids.read_text())
    values[4] = str(values[2])                                 # "12" and 12 name one image
    ids.write_text(json.dumps(values))
    _rehash(d, meta, "ids")
    with pytest.raises(IndexLoadError, match="occurs twice"):
        load_index(d)


def test_an_index_without_digests_is_refused(tmp_path):
    d, meta, emb, ids = _copy(tmp_path)
    del meta["sha256"]
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(IndexLoadError, match="records no sha256.*--force"):
        load_index(d)


def test_the_norm_tolerance_holds_every_row_of_a_real_build():
    """Rows of the tiny CLIP rounded to FP16 sit well inside NORM_TOL (its stated margin: 20x)."""
    emb = np.asarray(load_index(built_index()).emb, np.float32)
    assert np.abs(np.linalg.norm(emb, axis=1) - 1).max() < NORM_TOL / 20


def test_commit_refuses_rows_and_ids_it_would_refuse_to_read(tmp_path):
    emb = np.eye(4, 8, dtype=np.float16)
    with pytest.raises(ValueError, match="row 2"):
        commit(tmp_path, np.concatenate([emb[:2], np.zeros((1, 8), np.float16)]), [1, 2, 3], {})
    with pytest.raises(ValueError, match="occurs twice"):
        commit(tmp_path, emb, [1, "2", 2, 4], {})
    assert list(tmp_path.iterdir()) == []                     # nothing written
    commit(tmp_path, emb, [1, "2", 3, 4], {})
    assert load_index(tmp_path).ids == [1, "2", 3, 4]


def _build(index_dir, *extra, stop_after_chunks=0):
    return cir_build.main(build_args(index_dir, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu",
                                     *extra), stop_after_chunks=stop_after_chunks)


def test_a_damaged_chunk_is_rebuilt_with_one_line(tmp_path, capsys):
    """Flipped bytes, a truncated chunk and an unreadable zip: each rebuilt on resume, no traceback."""
    d = tmp_path / "index"
    assert _build(d, stop_after_chunks=4) == cir_build.STOPPED
    b = d / BUILD_DIR
    c0, c1, c2 = (b / f"chunk-{i:06d}.npz" for i in range(3))
    _poke(c0, range(2000, 2064), 0x55)                         # bytes flipped inside the zip
    c1.write_bytes(c1.read_bytes()[:-300])                     # truncated
    c2.write_bytes(b"PK\x03\x04 not a zip at all")             # an unreadable zip
    capsys.readouterr()
    assert _build(d) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "BadZipFile" not in err
    for i, name in enumerate((c0, c1, c2)):
        lines = [ln for ln in err.splitlines() if f"chunk {i + 1}/6 ({name.name})" in ln]
        assert len(lines) == 1 and "sha256 differs from its record" in lines[0] and "rebuilding it" in lines[0]
    assert "resuming: 1 of 6 chunks already built" in err
    a, ref = load_index(d), load_index(built_index())
    assert a.ids == ref.ids and np.array_equal(np.asarray(a.emb), np.asarray(ref.emb))
    assert a.meta["timing"]["resumed_chunks"] == 1

"""How an index changes hands: readers never see it between two commits, one build at a time
holds it, and the decoder meta.json names is the one that decoded every row."""
from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from cir_helpers import REPO, build_args, clip_dirs, script, workspace

from engine.retrieval.index import BUILD_DIR, BuildLock, IndexLoadError, load_index
from evaluator.cir import build as cir_build

COMMITTER = """
import sys
from pathlib import Path
import numpy as np
from engine.retrieval.index import commit
d, n = Path(sys.argv[1]), int(sys.argv[2])
a = np.random.default_rng(0).standard_normal((2000, 64)).astype(np.float32)
a /= np.linalg.norm(a, axis=1, keepdims=True)
for k in range(n):
    commit(d, a if k % 2 else a[::-1], list(range(2000)), {"k": k})
"""


def test_loads_racing_commits_never_fail(tmp_path):
    """A process commits the index again and again while this one loads it: every load sees a
    whole, verified index (before, a reader saw files deleted under it about 3 % of the time)."""
    d = tmp_path / "index"
    d.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", COMMITTER, str(d), "1"], env=env, check=True, timeout=60)
    committer = subprocess.Popen([sys.executable, "-c", COMMITTER, str(d), "400"], env=env)
    loads, failures, seen = 0, [], set()
    end = time.monotonic() + 20
    try:
        while committer.poll() is None and time.monotonic() < end:
            try:
                idx = load_index(d)
                seen.add(idx.meta["build_id"])
                loads += 1
            except IndexLoadError as e:
                failures.append(str(e))
    finally:
        committer.kill()
        committer.wait()
    assert failures == [], f"{len(failures)} of {loads + len(failures)} loads failed: {failures[:3]}"
    assert loads >= 100 and len(seen) >= 20, (loads, len(seen))     # the loads did race many commits
    assert sorted(p.name.split("-")[0] for p in d.iterdir() if not p.name.startswith(".")) \
        == ["embeddings", "ids", "meta.json"]                            # old builds' files are gone


HOLDER = """
import sys
from engine.retrieval.index import BuildLock
with BuildLock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.mark.abi
def test_a_second_build_is_refused_in_one_line_naming_the_holder(tmp_path):
    d = tmp_path / "index"
    d.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(d)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = script("build.sh", *build_args(d))
        assert r.returncode == 2, r.stderr[-2000:]
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "rendering" not in ln]
        assert lines == [f"scripts/build.sh: error: another build holds this index {d} (pid {holder.pid})"], lines
        assert not (d / BUILD_DIR).exists() and not (d / "meta.json").exists()   # the loser touched nothing
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    with BuildLock(d):                            # released when its holder leaves
        assert (d / ".lock").read_text().strip() == str(os.getpid())


def _build(index_dir, *extra, stop_after_chunks=0):
    return cir_build.main(build_args(index_dir, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu",
                                     *extra), stop_after_chunks=stop_after_chunks)


@functools.cache
def pil_index():
    d = workspace() / "index-pil"
    assert _build(d, "--decoder", "pil") == 0
    return load_index(d)


class GivesWay:
    """A decoder that says `first` until `after` decode calls, then `pil`, decoding with PIL all along:
    an isolated DALI decoder that cannot start (after=1: it gives way at its first call) or that
    fails past its restarts mid-build (after > 1)."""

    def __init__(self, spec, batch_size, first: str, after: int):
        from engine.decoders.pil import PilDecoder

        self.inner, self.name, self.first, self.after, self.calls = PilDecoder(spec, batch_size), first, first, after, 0

    def decode(self, blobs):
        self.calls += 1
        if self.calls >= self.after:
            self.name = "pil"
        return self.inner.decode(blobs)


def _gives_way(monkeypatch, after: int) -> None:
    import engine.decoders

    monkeypatch.setattr(engine.decoders, "make_decoder",
                        lambda name, spec, bsz, threads=None, isolate=True: GivesWay(spec, bsz, name, after))


def _check_all_pil(d) -> None:
    idx, ref = load_index(d), pil_index()
    assert idx.meta["decoder"] == idx.meta["build_key"]["decoder"] == "pil"
    assert idx.ids == ref.ids and np.array_equal(np.asarray(idx.emb), np.asarray(ref.emb))


def test_a_resume_where_dali_gives_way_rebuilds_its_chunks(tmp_path, monkeypatch, capsys):
    d = tmp_path / "index"
    assert _build(d, stop_after_chunks=2) == cir_build.STOPPED              # DALI decodes chunks 1-2
    recs = [json.loads((d / BUILD_DIR / f"chunk-00000{i}.json").read_text()) for i in range(2)]
    assert [r["decoder"] for r in recs] == ["dali-cpu", "dali-cpu"]
    _gives_way(monkeypatch, after=1)                                       # resumed where DALI cannot start
    capsys.readouterr()
    assert _build(d) == 0
    err = capsys.readouterr().err
    assert "rebuilding 2 of 6 chunks decoded with dali-cpu: this build decodes with pil" in err, err
    _check_all_pil(d)
    dali = load_index(workspace() / "index") if (workspace() / "index").exists() else None
    if dali is not None:      # the two decoders differ here, so equality above proves which one decoded
        assert not np.array_equal(np.asarray(dali.emb), np.asarray(pil_index().emb))


def test_a_decoder_that_gives_way_mid_build_leaves_no_mixed_index(tmp_path, monkeypatch, capsys):
    d = tmp_path / "index"
    _gives_way(monkeypatch, after=5)        # the probe and 3 batches as "dali-cpu": chunk 1, half of chunk 2
    assert _build(d) == 0
    err = capsys.readouterr().err
    assert "rebuilding 2 of 6 chunks decoded with dali-cpu, dali-cpu+pil: this build decodes with pil" in err, err
    _check_all_pil(d)


def test_temp_files_are_created_exclusively(tmp_path, monkeypatch):
    """A temp name another writer holds is never written through (O_EXCL): the writer draws another."""
    import itertools
    import secrets
    import time

    from engine.io import write_atomic

    target = tmp_path / "chunk-000001.npz"
    ticks = itertools.chain([7, 7], itertools.count(8))           # the first two draws collide
    monkeypatch.setattr(time, "time_ns", lambda: next(ticks))
    monkeypatch.setattr(secrets, "token_hex", lambda n: "f" * 2 * n)
    theirs = tmp_path / f".tmp-{target.name}-{7:016x}{'f' * 8}"
    theirs.write_bytes(b"another writer's bytes")
    write_atomic(target, b"mine")
    assert theirs.read_bytes() == b"another writer's bytes" and target.read_bytes() == b"mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, target.name]


def _unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def test_the_committed_embeddings_are_np_saves_bytes_and_its_sha256(tmp_path):
    import hashlib
    import io

    from engine.retrieval.index import commit

    emb = _unit_rows(300, 64, 0)
    meta = commit(tmp_path, emb, [f"i{k}" for k in range(300)], {})
    data = (tmp_path / meta["files"]["embeddings"]).read_bytes()
    want = io.BytesIO()
    np.save(want, emb, allow_pickle=False)
    assert data == want.getvalue() and meta["sha256"]["embeddings"] == hashlib.sha256(data).hexdigest()
    got = load_index(tmp_path)
    assert np.array_equal(np.asarray(got.emb), emb) and list(got.ids) == [f"i{k}" for k in range(300)]


def test_chunks_load_and_commit_holding_the_index_about_once(tmp_path):
    """ChunkStore.load fills one [N, D] array chunk by chunk and commit writes it without a copy:
    each step's peak of traced memory stays under 1.5x the embeddings (it was 2x each)."""
    import tracemalloc

    from engine.retrieval.index import ChunkStore, commit

    n_chunks, size, dim = 8, 2048, 256                       # 8 MiB of embeddings
    store = ChunkStore(tmp_path / "idx", {"embed_dim": dim, "chunk_size": size})
    store.dir.mkdir(parents=True, exist_ok=True)
    want = []
    for c in range(n_chunks):
        e = _unit_rows(size, dim, c)
        store.save(c, np.arange(c * size, (c + 1) * size, dtype=np.int64), e, [], "pil")
        want.append(e)
    nbytes = n_chunks * size * dim * 2
    tracemalloc.start()
    try:
        rows, emb, failed = store.load(range(n_chunks))
        _, load_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        commit(tmp_path / "idx", emb, [f"i{k}" for k in rows.tolist()], {})
        _, commit_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(emb, np.concatenate(want)) and rows.tolist() == list(range(n_chunks * size))
    assert load_peak < 1.5 * nbytes, (load_peak, nbytes)
    assert commit_peak - base < 0.5 * nbytes, (commit_peak - base, nbytes)


def test_a_chunk_whose_rows_differ_from_its_record_is_refused(tmp_path):
    from engine.retrieval.index import ChunkStore

    store = ChunkStore(tmp_path, {"embed_dim": 8, "chunk_size": 4})
    store.dir.mkdir(parents=True, exist_ok=True)
    store.save(0, np.arange(4, dtype=np.int64), _unit_rows(4, 8, 0), [], "pil")
    rec = json.loads(store.record_path(0).read_text())
    store.record_path(0).write_text(json.dumps({**rec, "rows": 5}))
    with pytest.raises(IndexLoadError, match="unreadable chunk .*the record says 5 rows"):
        store.load(range(1))
    store.record_path(0).write_text(json.dumps({k: v for k, v in rec.items() if k != "rows"}))
    rows, emb, _ = store.load(range(1))                      # a record without its count: still read
    assert rows.tolist() == [0, 1, 2, 3] and emb.shape == (4, 8)

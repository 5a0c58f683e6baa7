"""scripts/build.sh: the index it writes, resume after a stop, atomic commit, bad input,
a read-only parent directory, and (GPU marker) the CUDA build."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from cir_helpers import (
    build_args,
    built_index,
    check_abi,
    clip_dirs,
    corpus,
    read_rows,
    requests_of,
    script,
    workspace,
)

from engine.retrieval.index import BUILD_DIR, IndexLoadError, load_index
from engine.retrieval.jsonl import read_records
from evaluator.cir import build as cir_build


def _build(index_dir, *extra, stop_after_chunks=0):
    """In-process build on the CPU (same arguments as the reference build)."""
    return cir_build.main(build_args(index_dir, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu",
                                     *extra), stop_after_chunks=stop_after_chunks)


def test_build_script_writes_the_index():
    idx = load_index(built_index())
    records = read_records(corpus() / "records.jsonl", print)
    broken = [r.image_id for r in records if str(r.image_id).startswith("broken")]
    assert idx.ids == [r.image_id for r in records if r.image_id not in broken]   # record order, ints kept
    assert idx.emb.shape == (320, 64) and idx.emb.dtype == np.float16
    norms = np.linalg.norm(idx.emb.astype(np.float32), axis=1)
    assert np.allclose(norms, 1.0, atol=2e-3)
    m = idx.meta
    assert sorted(u["image_id"] for u in m["unreadable"]) == sorted(broken)
    assert m["counts"] == {"records": 323, "indexed": 320, "unreadable": 3}
    assert m["decoder"] == "dali-cpu" and m["device"] == "cpu" and m["precision"] == "fp32"
    assert m["method"]["name"] == "slerp" and len(m["model"]["digest"]) == 64
    assert m["clip_spec"]["image"]["crop_mode"] == "center" and m["clip_spec"]["image"]["crop_pct"] == 1.0
    assert not (built_index() / BUILD_DIR).exists()
    err = (workspace() / "build.stderr").read_text()
    assert "images/s" in err and "unreadable image 'broken-0'" in err
    assert "[cir_build] embedding: 323/323 images, in " in err and "[cir_build] chunk 6/6 done" in err
    if not torch.cuda.is_available():   # the top-k kernel is compiled into the index only where CUDA is
        assert m["kernels"] == {"topk": {"stored": False, "reason": "no CUDA device"}}
        assert not (built_index() / "kernels").exists() and "top-k kernel: not stored (no CUDA device)" in err


def test_stored_rows_equal_the_towers():
    """Spot check: re-embed a few records through the same decoder and tower."""
    from engine.clip.load import load_clip
    from engine.clip.towers import ClipTowers
    from engine.decoders import make_decoder

    idx = load_index(built_index())
    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    towers = ClipTowers(model, spec, "cpu", "fp32")
    recs = {str(r.image_id): r for r in read_records(corpus() / "records.jsonl", print)}
    rows = [0, 1, 100, 319]
    blobs = [(corpus() / recs[str(idx.ids[r])].path).read_bytes() for r in rows]
    px, failed = make_decoder("dali-cpu", spec.image, 32).decode(blobs)
    assert not failed
    want = towers.encode_images(px).half().numpy()
    np.testing.assert_allclose(idx.emb[rows].astype(np.float32), want.astype(np.float32), atol=2e-3)


def test_resume_after_a_stopped_build_matches_an_uninterrupted_one(tmp_path, monkeypatch, capsys):
    d = tmp_path / "index"
    assert _build(d, stop_after_chunks=2) == cir_build.STOPPED
    assert len(list((d / BUILD_DIR).glob("chunk-*.npz"))) == 2
    with pytest.raises(IndexLoadError, match="unfinished build"):
        load_index(d)
    capsys.readouterr()
    assert _build(d) == 0
    err = capsys.readouterr().err
    assert "resuming: 2 of 6 chunks already built" in err
    # off a terminal the progress closes with one line; its rate counts this run's images only
    done = [ln for ln in err.splitlines() if ln.startswith("[cir_build] embedding: 323/323 images, in ")]
    assert len(done) == 1 and done[0].endswith("images/s, 128 done before"), err
    a, b = load_index(d), load_index(built_index())
    assert a.ids == b.ids
    assert np.array_equal(np.asarray(a.emb), np.asarray(b.emb))
    assert a.meta["timing"]["resumed_chunks"] == 2 and a.meta["timing"]["images_embedded_this_run"] < 320


def test_a_finished_index_is_never_half_overwritten(tmp_path, monkeypatch, capsys):
    d = tmp_path / "index"
    shutil.copytree(built_index(), d)
    before = (d / "meta.json").read_bytes()
    assert _build(d) == 0                                         # same inputs: nothing to do
    assert "is up to date" in capsys.readouterr().err
    assert _build(d, "--force", stop_after_chunks=1) == 3
    assert (d / "meta.json").read_bytes() == before              # the old index is intact and loads
    assert np.array_equal(np.asarray(load_index(d).emb), np.asarray(load_index(built_index()).emb))
    assert _build(d, "--force") == 0
    new = json.loads((d / "meta.json").read_text())
    assert new["build_id"] != json.loads(before)["build_id"]
    assert len(list(d.glob("embeddings-*.npy"))) == 1 and len(list(d.glob("ids-*.json"))) == 1


def test_build_errors_are_clear(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cir_build.main(["--corpus", str(empty), "--index-dir", str(tmp_path / "i")]) == 2
    assert "records.jsonl not found" in capsys.readouterr().err
    assert cir_build.main(["--corpus", str(corpus()), "--index-dir", str(tmp_path / "no" / "parent")]) == 2
    assert "cannot create the index dir" in capsys.readouterr().err
    assert cir_build.main(["--corpus", str(corpus()), "--index-dir", str(tmp_path / "i"),
                           "--model-dir", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "no CLIP model in" in err and "open_clip_config.json" in err and "config.json" in err


def test_records_reader_tolerates_synonyms_and_bad_lines(tmp_path):
    p = tmp_path / "records.jsonl"
    p.write_bytes(b'{"image_id": 1, "path": "a.jpg"}\n'
                  b'{"id": "b", "file": "b.jpg"}\n'
                  b'{"image": "c", "filename": "c.jpg"}\n'
                  b'{"image_id": "d", "image": "d.jpg"}\n'
                  b'{"image_id": 1, "path": "dup.jpg"}\n'
                  b'{"image_id": "e"}\n'
                  b'not json\n'
                  b'\n'
                  b'{"image_id": "caf\xe9", "path": "f.jpg"}\r\n')
    msgs = []
    recs = read_records(p, msgs.append)
    assert [(r.image_id, r.path) for r in recs] == [(1, "a.jpg"), ("b", "b.jpg"), ("c", "c.jpg"), ("d", "d.jpg"),
                                                    ("caf\ufffd", "f.jpg")]
    text = "\n".join(msgs)
    for line, what in [(5, "duplicate image id"), (6, "no usable path"), (7, "malformed JSON"), (9, "UTF-8")]:
        assert f"records.jsonl:{line}: " in text and what in text


NOBODY = 65534
# run under a restricting prefix: the interpreter starts, imports what the build imports, and
# tries one write; prints how the write ended (the cause, not a message to grep)
WRITE_PROBE = """import json, sys
for name in sys.argv[2:]:
    __import__(name)
try:
    open(sys.argv[1], "w").close()
    print(json.dumps({"wrote": True}))
except OSError as e:
    print(json.dumps({"errno": e.errno, "filename": e.filename}))
"""


def _write_refused(prefix: list[str], path) -> str | None:
    """None when, under `prefix`, this interpreter runs (with the build's imports) and a write of
    `path` fails with EACCES or EROFS on that very path; else what happened instead."""
    import errno
    import importlib.util

    mods = ["torch", "open_clip"] + (["nvidia.dali"] if importlib.util.find_spec("nvidia") and
                                     importlib.util.find_spec("nvidia.dali") else [])
    r = subprocess.run([*prefix, sys.executable, "-c", WRITE_PROBE, str(path), *mods], capture_output=True,
                       text=True, cwd="/", timeout=300)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    try:
        got = json.loads(last) if r.returncode == 0 else None
    except ValueError:
        got = None
    if not isinstance(got, dict):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the interpreter did not run the probe (exit {r.returncode}: {tail})"
    if got.get("wrote"):
        os.unlink(path)
        return f"{path} was writable"
    if got.get("errno") not in (errno.EACCES, errno.EROFS) or got.get("filename") != str(path):
        return f"the write failed for another reason (errno {got.get('errno')} on {got.get('filename')!r})"
    return None


def _restricted_prefix(base, env: dict) -> tuple[list[str], int]:
    """A command prefix under which file permissions bind, running with exactly `env`, and the uid
    that will own the index dir.

    As root (tests run as root, where permissions are not enforced): user nobody without
    capabilities, the interpreter's tree bound back where nobody cannot reach it (as
    evaluator.rehearsal.sandbox does for the rehearsal); else root without CAP_DAC_OVERRIDE,
    which makes mode bits bind the owner too; else a skip naming why neither binds. Each is
    taken only when a probe under it runs this interpreter and its write into a read-only
    folder fails with EACCES/EROFS on that path.
    """
    if os.geteuid() != 0:
        return [], os.geteuid()
    if not shutil.which("setpriv"):
        pytest.skip("needs setpriv to drop root's permission override")
    from evaluator.rehearsal.sandbox import interpreter_mounts, user_command

    ro, stage = base / "ro", base / "stage"
    ro.mkdir()
    stage.mkdir()
    ro.chmod(0o555)
    try:
        tried = []
        mounts = interpreter_mounts(NOBODY, NOBODY)
        if mounts and not shutil.which("unshare"):
            tried.append("user nobody: the interpreter lies where nobody cannot reach it, and there is no unshare "
                         "to bind it back")
        else:
            nobody = user_command([], env, NOBODY, NOBODY, None, 4096, False, mounts, stage)
            why = _write_refused(nobody, ro / "x")
            if why is None:
                return nobody, NOBODY
            tried.append(f"user nobody: {why}")
        nodac = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
                 "--bounding-set=-dac_override,-dac_read_search", "env", "-i", *[f"{k}={v}" for k, v in env.items()]]
        why = _write_refused(nodac, ro / "x")
        if why is None:
            return nodac, 0
        tried.append(f"root without CAP_DAC_OVERRIDE: {why}")
    finally:
        ro.chmod(0o755)
    pytest.skip("cannot make file permissions bind for this test's subprocess: " + "; ".join(tried))


@pytest.mark.abi
def test_read_only_parent_of_the_index_dir():
    base = workspace() / "restricted"
    base.mkdir()
    for d in (workspace(), base):
        d.chmod(0o755)
    data, clip = base / "corpus", base / "clip"
    parent, tmp, out = base / "parent", base / "tmp", base / "out"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "/nonexistent",
           "TMPDIR": str(tmp), "PYTHON": sys.executable, "CLIP_MODEL_DIR": str(clip), "CLIP_DEVICE": "cpu",
           "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1",
           **{k: os.environ[k] for k in ("LD_LIBRARY_PATH",) if k in os.environ}}
    prefix, owner = _restricted_prefix(base, env)
    shutil.copytree(corpus(), data)
    shutil.copytree(clip_dirs()["open_clip"], clip)
    subprocess.run(["chmod", "-R", "u=rwX,go=rX", str(data), str(clip)], check=True)
    index = parent / "index"
    for d in (parent, index, tmp, out):
        d.mkdir()
        os.chown(d, owner, owner)
    parent.chmod(0o555)
    try:
        why = _write_refused(prefix, parent / "x")
        assert why is None, why                                              # the restriction binds
        r = script("build.sh", "--corpus", str(data), "--index-dir", str(index), "--chunk-size", "64",
                   env=env, prefix=prefix)
        assert r.returncode == 0, r.stderr[-3000:]
        assert [p.name for p in parent.iterdir()] == ["index"]
        r = script("run.sh", "--index-dir", str(index), "--queries", str(data / "requests.jsonl"),
                   "--output", str(out / "rows.jsonl"), env=env, prefix=prefix)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        parent.chmod(0o755)
    assert [p.name for p in parent.iterdir()] == ["index"]
    reqs = requests_of(data / "requests.jsonl")
    check_abi(read_rows(out / "rows.jsonl"), reqs, load_index(index).ids)


@pytest.mark.gpu
def test_cuda_build_agrees_with_the_cpu_build(tmp_path):
    """DALI GPU decode + FP16 autocast tower: rows within cosine 0.99 of the CPU FP32 build."""
    d = tmp_path / "index"
    rc = cir_build.main(build_args(d, "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cuda"))
    assert rc == 0
    gpu, cpu = load_index(d), load_index(built_index())
    assert gpu.meta["decoder"] == "dali-gpu" and gpu.meta["device"] == "cuda" and gpu.meta["precision"] == "fp16"
    assert gpu.ids == cpu.ids
    cos = (torch.from_numpy(np.asarray(gpu.emb)).float() * torch.from_numpy(np.asarray(cpu.emb)).float()).sum(-1)
    assert cos.min().item() > 0.99, cos.min().item()


def test_build_progress_is_a_bar_on_a_tty_and_lines_off_it(monkeypatch):
    """The build's progress (engine.progress.Progress) resumed at 2 of 10 images: a bar on a
    terminal; off one, periodic lines and a closing line, the rate over this run's images."""
    from engine.progress import Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        bar = Progress(10, "[cir_build] embedding", unit="images", every_s=0.0, stream=stream, initial=2)
        bar.update(5)
        bar.close()
    assert "7/10" in tty.getvalue() and "images/s" in tty.getvalue()
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[cir_build] embedding: 7/10 images (70 %), ")
    assert "about" in lines[0] and lines[0].endswith("left")
    assert lines[1].startswith("[cir_build] embedding: 7/10 images, in ") and lines[1].endswith(" done before")


def _hostile_corpus(tmp_path):
    """A small corpus whose records also name paths outside it, FIFOs and a directory.

    Returns (corpus dir, outside image path, FIFO-trap checker)."""
    src = read_records(corpus() / "records.jsonl", print)[:6]
    base = tmp_path / "corpus"
    (base / "images").mkdir(parents=True)
    recs = []
    for r in src:
        dst = base / "images" / os.path.basename(r.path)
        shutil.copy(corpus() / r.path, dst)
        recs.append({"image_id": r.image_id, "path": f"images/{dst.name}"})
    outside = tmp_path / "outside.jpg"
    shutil.copy(corpus() / src[0].path, outside)
    trap = tmp_path / "trap.jpg"            # outside the corpus: opening it for reading would block
    os.mkfifo(trap)
    (base / "images" / "link.jpg").symlink_to(trap)
    os.mkfifo(base / "images" / "fifo.jpg")
    (base / "images" / "folder.jpg").mkdir()
    recs += [{"image_id": "etc", "path": "../../../../../../etc/passwd"},
             {"image_id": "abs", "path": str(outside)},
             {"image_id": "up", "path": "../outside.jpg"},
             {"image_id": "link", "path": "images/link.jpg"},
             {"image_id": "fifo", "path": "images/fifo.jpg"},
             {"image_id": "folder", "path": "images/folder.jpg"}]
    (base / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))

    def opened() -> bool:
        try:
            os.close(os.open(trap, os.O_WRONLY | os.O_NONBLOCK))   # succeeds only if a reader has it open
            return True
        except OSError:
            return False

    return base, outside, opened


def _cpu_build_args(base, index_dir, *extra):
    return ["--corpus", str(base), "--index-dir", str(index_dir), "--model-dir", str(clip_dirs()["open_clip"]),
            "--device", "cpu", "--chunk-size", "64", "--batch-size", "8", *extra]


def test_records_paths_are_followed_and_confined_only_when_asked(tmp_path, capsys):
    base, outside, opened = _hostile_corpus(tmp_path)
    args = _cpu_build_args(base, tmp_path / "index")
    # the default follows the records as PIL's Image.open would: the absolute and the escaping
    # paths are indexed; FIFOs (also behind a link) and folders are still not files, never a hang
    assert cir_build.main(args) == 0
    err = capsys.readouterr().err
    assert not opened()
    idx = load_index(tmp_path / "index")
    assert {"abs", "up"} <= set(idx.ids) and idx.meta["confine_to_corpus"] is False
    for iid, what in [("link", "a FIFO, not a regular file"), ("fifo", "a FIFO, not a regular file"),
                      ("folder", "a directory, not a regular file")]:
        assert any(f"unreadable image {iid!r}" in e and what in e for e in err.splitlines()), (iid, err[-3000:])
    # confined (untrusted records): every path that is absolute or leaves the corpus is refused and named,
    # and the change of rule is a different build (rebuilt, not taken as up to date)
    assert cir_build.main([*args, "--confine-to-corpus"]) == 0
    err = capsys.readouterr().err
    assert not opened() and "up to date" not in err
    for iid, what in [("etc", "path escapes the corpus folder"), ("abs", "absolute path refused"),
                      ("up", "path escapes the corpus folder"), ("link", "path escapes the corpus folder"),
                      ("fifo", "a FIFO, not a regular file"), ("folder", "a directory, not a regular file")]:
        assert any(f"unreadable image {iid!r}" in e and what in e for e in err.splitlines()), (iid, err[-3000:])
    idx = load_index(tmp_path / "index")
    assert len(idx.ids) == 6 and idx.meta["confine_to_corpus"] is True and \
        {u["image_id"] for u in idx.meta["unreadable"]} == {"etc", "abs", "up", "link", "fifo", "folder"}
    # the old opt-out is still accepted (a no-op), but not together with the opt-in
    assert cir_build.main([*args, "--allow-outside-corpus"]) == 0
    assert load_index(tmp_path / "index").meta["confine_to_corpus"] is False
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cir_build.main([*args, "--allow-outside-corpus", "--confine-to-corpus"])
    assert e.value.code == 2 and "contradict" in capsys.readouterr().err


def _staged_corpus(tmp_path, n=8):
    """The corpus images staged three ways over one store outside the corpus folder: a farm of
    symlinks, hard links, and records holding absolute paths. Returns (corpus dir, records)."""
    src = read_records(corpus() / "records.jsonl", print)[:3 * n]
    store, base = tmp_path / "store", tmp_path / "staged"
    store.mkdir()
    (base / "links").mkdir(parents=True)
    (base / "hard").mkdir()
    recs = []
    for k, r in enumerate(src):
        blob = store / f"{k:04d}.bin"                      # a content store: names unrelated to the records
        shutil.copy(corpus() / r.path, blob)
        if k < n:                                          # a symlink farm into the store
            (base / "links" / f"{k}.jpg").symlink_to(blob)
            path = f"links/{k}.jpg"
        elif k < 2 * n:                                    # hard links: the same inode inside the corpus
            os.link(blob, base / "hard" / f"{k}.jpg")
            path = f"hard/{k}.jpg"
        else:                                              # absolute records paths into the store
            path = str(blob)
        recs.append({"image_id": f"s{k}", "path": path})
    (base / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return base, recs


def test_a_staged_corpus_indexes_every_record_and_confinement_names_each_refusal(tmp_path, capsys):
    base, recs = _staged_corpus(tmp_path)
    assert cir_build.main(_cpu_build_args(base, tmp_path / "index")) == 0
    idx = load_index(tmp_path / "index")
    assert idx.ids == [r["image_id"] for r in recs] and idx.meta["unreadable"] == []
    # the staged images embed exactly as the originals do (same bytes behind every link)
    ref = load_index(built_index())
    rows = ref.rows()
    src = read_records(corpus() / "records.jsonl", print)[:len(recs)]
    want = np.asarray(ref.emb)[[rows[str(r.image_id)] for r in src]].astype(np.float32)
    np.testing.assert_allclose(np.asarray(idx.emb, np.float32), want, atol=2e-3)
    capsys.readouterr()
    # confined: the links out of the corpus and the absolute paths are refused, each named; hard links stay
    assert cir_build.main(_cpu_build_args(base, tmp_path / "confined", "--confine-to-corpus")) == 0
    err = capsys.readouterr().err
    idx = load_index(tmp_path / "confined")
    assert idx.ids == [r["image_id"] for r in recs if r["path"].startswith("hard/")]
    for r in recs:
        if not r["path"].startswith("hard/"):
            what = "absolute path refused" if r["path"].startswith("/") else "path escapes the corpus folder"
            assert any(f"unreadable image {r['image_id']!r}" in e and what in e for e in err.splitlines()), r


def test_the_record_reader_follows_by_default_and_confines_when_asked(tmp_path):
    """The rule re-inspection shares with the build (engine.retrieval.jsonl.record_reader)."""
    from engine.retrieval.jsonl import record_reader

    base, recs = _staged_corpus(tmp_path, n=2)
    paths = [r["path"] for r in recs]
    store = sorted((tmp_path / "store").iterdir())
    follow, confine = record_reader(base, paths), record_reader(base, paths, confine=True)
    for i, path in enumerate(paths):
        assert follow(i) == store[i].read_bytes()                  # link, hard link, absolute: the same bytes
        if path.startswith("hard/"):
            assert confine(i) == store[i].read_bytes()
        else:
            with pytest.raises(ValueError, match="absolute path refused|path escapes the corpus folder"):
                confine(i)


def test_re_inspection_follows_the_records_as_the_build_did_unless_confined(tmp_path):
    from evaluator.cir import run as cir_run

    base, recs = _staged_corpus(tmp_path, n=4)
    assert cir_build.main(_cpu_build_args(base, tmp_path / "index")) == 0
    queries = tmp_path / "q.jsonl"
    queries.write_text("".join(json.dumps({"query_id": i, "reference_image_id": r["image_id"],
                                           "modification": "the same, in red"}) + "\n"
                               for i, r in enumerate(recs[:6])))
    reports = {}
    for name, extra in (("follow", []), ("confine", ["--confine-to-corpus"])):
        out, rep = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        assert cir_run.main(["--index-dir", str(tmp_path / "index"), "--queries", str(queries), "--output", str(out),
                             "--model-dir", str(clip_dirs()["open_clip"]), "--device", "cpu", "--method",
                             "slerp+reinspect:n=8", "--report", str(rep), *extra]) == 0
        reports[name] = json.loads(rep.read_text())
        assert len(read_rows(out)) == 6
    assert reports["follow"]["reinspected_total"] > 0 and reports["follow"]["reinspect_unreadable"] == 0
    assert reports["confine"]["reinspect_unreadable"] > 0      # links out and absolute paths refused


def test_malformed_files_in_the_index_dir_are_rebuilt_or_refused(tmp_path, capsys):
    d = tmp_path / "index"
    d.mkdir()
    (d / "meta.json").write_text("[]")                         # not a committed index: built over
    (d / BUILD_DIR).mkdir()
    (d / BUILD_DIR / "progress.json").write_text('["not", "a", "key"]')
    assert _build(d) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert load_index(d).meta["count"] == load_index(built_index()).meta["count"]


# scripts/build.sh's flags as they were written by hand before they were made from BuildConfig's
# fields: (flag, dest, type, choices, default, required); a default None is "derived" (the device's
# image batch, the CLIP's settings), the others are the retrieval table's
BUILD_FLAGS = [
    ("--corpus", "corpus", "Path", None, None, True), ("--index-dir", "index_dir", "Path", None, None, True),
    ("--model-dir", "model_dir", "Path", None, None, False), ("--model-name", "model_name", None, None, None, False),
    ("--decoder", "decoder", None, ("auto", "pil", "dali-cpu", "dali-gpu", "nvjpeg"), "auto", False), ("--batch-size", "batch_size", "int", None, None, False),
    ("--chunk-size", "chunk_size", "int", None, 4096, False), ("--readers", "readers", "int", None, 8, False),
    ("--device", "device", "device_name", None, None, False),
    ("--precision", "precision", None, ("fp32", "fp16", "bf16"), None, False),
    ("--method", "method", None, None, "slerp", False), ("--text-weight", "text_weight", "float", None, None, False),
    ("--prompt", "prompt", None, None, None, False), ("--force", "force", None, None, False, False),
    ("--mapping", "mapping", None, ("none", "pic2word"), "none", False),
    ("--p2w-epochs", "p2w_epochs", "int", None, 20, False), ("--p2w-steps", "p2w_steps", "int", None, 0, False),
    ("--p2w-batch-size", "p2w_batch_size", "int", None, 256, False), ("--p2w-lr", "p2w_lr", "float", None, 1e-4, False),
    ("--p2w-warmup", "p2w_warmup", "int", None, -1, False), ("--p2w-hidden", "p2w_hidden", "int", None, 512, False),
    ("--p2w-seed", "p2w_seed", "int", None, 0, False), ("--p2w-ckpt-every", "p2w_ckpt_every", "int", None, 200, False),
    ("--p2w-time-budget", "p2w_time_budget", "float", None, 2400.0, False),
    ("--text-bank", "text_bank", "int", None, -1, False), ("--dba", "dba", "int", None, 0, False),
    ("--dba-alpha", "dba_alpha", "float", None, 3.0, False), ("--dba-chunk", "dba_chunk", "int", None, 1024, False),
    ("--confine-to-corpus", "confine_to_corpus", None, None, False, False),
    ("--allow-outside-corpus", "allow_outside_corpus", None, None, False, False),
    ("--ray", "ray", None, None, False, False), ("--workers", "workers", "int", None, 2, False),
    ("--debug", "debug", None, None, False, False)]


def test_the_build_flags_are_made_from_the_config_fields_and_keep_their_names_types_and_defaults(monkeypatch):
    import argparse
    import dataclasses

    from engine.presets.retrieval import RETRIEVAL

    seen = {}
    parse = argparse.ArgumentParser.parse_args
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args",
                        lambda self, *a, **k: seen.setdefault("parser", self) and parse(self, *a, **k))
    cfg = cir_build.parse_args(["--corpus", "c", "--index-dir", "i"])
    got = [(a.option_strings[0], a.dest, getattr(a.type, "__name__", None), a.choices, a.default, a.required)
           for a in seen["parser"]._actions if a.dest != "help"]
    assert sorted(got) == sorted(BUILD_FLAGS)
    # each flag's default is its field's, the table's where the table holds one
    fields = {f.name: f for f in dataclasses.fields(cir_build.BuildConfig)}
    for _, dest, _, _, default, required in BUILD_FLAGS:
        if dest in fields and not required:
            assert fields[dest].default == default == getattr(cfg, dest), dest
    assert (cfg.chunk_size, cfg.readers, cfg.p2w_hidden, cfg.p2w_time_budget, cfg.dba_alpha, cfg.workers) == (
        RETRIEVAL.chunk_size, RETRIEVAL.image_readers, RETRIEVAL.p2w_hidden, RETRIEVAL.p2w_time_budget,
        RETRIEVAL.dba_alpha, RETRIEVAL.ray_workers)
    help_text = " ".join(seen["parser"].format_help().split())
    assert "images per resumable chunk (range: 1..1000000000 images) (default: 4096)" in help_text
    assert "cpu 64, cuda 256" in help_text
    monkeypatch.setenv("CIR_METHOD", "sum")
    from engine import settings

    monkeypatch.setattr(settings, "_cache", {})
    assert cir_build.parse_args(["--corpus", "c", "--index-dir", "i"]).method == "sum"   # the env's, at parse time

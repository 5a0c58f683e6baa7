"""engine.classify.artifact + engine.build: the manifest, its checks and the atomic build directory."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from conftest import REPO, tiny_spec
from safetensors.torch import save_file

from engine.classify.artifact import (
    DIGEST_KEY,
    FORMAT,
    MANIFEST,
    SAMPLE_BLOCKS,
    SAMPLE_BYTES,
    ArtifactError,
    load_artifact,
    manifest_digest,
    sample_sha256,
)
from engine.classify.runtime import load_runtime
from engine.core.checkpoint import create_model, load_model
from engine.core.model import wrap
from engine.tuning import build


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """Random-init tiny EVA-02 weights (the artifact mechanics do not need a fitted head)."""
    torch.manual_seed(1)
    p = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in create_model(tiny_spec()).state_dict().items()}, str(p))
    return p


@pytest.fixture(scope="module")
def built(tmp_path_factory, ckpt) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("built") / "artifact"
    meta = build(tiny_spec(), ckpt, out, backend="eager", device="cpu")
    return out, meta


@pytest.fixture
def art(tmp_path, built) -> Path:
    """A private copy of the built artifact, free to corrupt."""
    dst = tmp_path / "artifact"
    shutil.copytree(built[0], dst)
    return dst


def test_manifest_fields(built, ckpt):
    out, meta = built
    disk = json.loads((out / MANIFEST).read_text())
    assert disk == meta
    assert disk["format"] == FORMAT
    assert disk["spec"] == json.loads(json.dumps(tiny_spec().to_dict()))
    assert (disk["backend"], disk["device"], disk["precision"], disk["batch_size"]) == ("eager", "cpu", "fp32", 16)
    assert disk["checkpoint"]["sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    assert disk["checkpoint"]["bytes"] == ckpt.stat().st_size
    assert disk["checkpoint"]["path"] == str(ckpt)
    assert set(disk["files"]) == {"weights.safetensors"}
    for name, info in disk["files"].items():
        data = (out / name).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "sample_sha256": sample_sha256(out / name),
                        "bytes": len(data)}
    # the distribution version (importlib.metadata): torch.__version__ adds the local build tag (+cu130)
    assert disk["versions"]["torch"] == torch.__version__.split("+")[0]
    assert disk["versions"]["timm"] == timm.__version__
    assert disk["build"]["seconds"] >= 0
    # every file in the directory is listed (the manifest itself aside): nothing unverified ships
    on_disk = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()}
    assert on_disk == set(disk["files"]) | {MANIFEST}
    # the graph the build ran once, and the manifest's own digest over everything else
    assert disk["graph"] == {"input": {"shape": [16, 112, 112, 3], "dtype": "uint8"},
                             "outputs": [{"shape": [16], "dtype": "int32"}]}
    body = {k: v for k, v in disk.items() if k != DIGEST_KEY}
    assert disk[DIGEST_KEY] == hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                                              ).hexdigest()


def test_load_artifact_passes(built):
    out, meta = built
    a = load_artifact(out)
    assert a.root == out and a.spec == tiny_spec()
    assert (a.backend, a.device, a.precision, a.batch_size) == ("eager", "cpu", "fp32", 16)
    assert a.files == meta["files"] and a.meta == meta
    assert a.path("weights.safetensors") == out / "weights.safetensors"


def test_eager_runtime_matches_the_checkpoint(built, ckpt):
    """The weights in the artifact are the checkpoint's: same top-1 as the model loaded directly."""
    rt = load_runtime(load_artifact(built[0]))
    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (16, 112, 112, 3), dtype=np.uint8))
    with torch.inference_mode():
        want = wrap(load_model(tiny_spec(), ckpt), tiny_spec(), "cpu").logits(x).argmax(-1).numpy()
    assert np.array_equal(rt.run(x.numpy()), want)
    with pytest.raises(ValueError, match="static batch shape is 16"):
        rt.run(x[:15])


def _flip_byte(p: Path, at: int | None = None) -> None:
    data = bytearray(p.read_bytes())
    i = len(data) // 2 if at is None else at
    data[i] ^= 0x01
    p.write_bytes(bytes(data))


def test_flipped_byte_is_a_sha256_error(art):
    _flip_byte(art / "weights.safetensors")
    with pytest.raises(ArtifactError, match="SHA-256") as e:
        load_artifact(art, verify="sha256")
    assert "weights.safetensors" in str(e.value)


def _between_samples(p: Path) -> int:
    """An offset of `p` that no block of sample_sha256 reads: halfway between its 8th and 9th blocks."""
    span = p.stat().st_size - SAMPLE_BYTES
    starts = [span * k // (SAMPLE_BLOCKS - 1) for k in range(SAMPLE_BLOCKS)]
    at = (starts[7] + SAMPLE_BYTES + starts[8]) // 2
    assert not any(s <= at < s + SAMPLE_BYTES for s in starts)
    return at


def test_quick_verification_is_the_default_and_catches_a_replaced_file(art, monkeypatch):
    """quick (default): sizes + a sampled SHA-256 before the load: a same-size file with other
    contents is refused there; a byte flipped between the sampled blocks passes it, and the full
    SHA-256 that runs meanwhile refuses it when the answers wait for it (check_weights)."""
    monkeypatch.delenv("ENGINE_ARTIFACT_VERIFY", raising=False)
    w = art / "weights.safetensors"
    _flip_byte(w, at=_between_samples(w))
    loaded = load_artifact(art)
    assert loaded.backend == "eager"
    with pytest.raises(ArtifactError, match="weights.safetensors is corrupt: its SHA-256 differs"):
        loaded.check_weights()
    w.write_bytes(bytes(reversed(w.read_bytes())))                    # same size, other bytes
    with pytest.raises(ArtifactError, match="sampled SHA-256"):
        load_artifact(art)


def test_size_verification_checks_sizes_before_the_load_and_every_byte_after(art, monkeypatch):
    _flip_byte(art / "weights.safetensors", at=0)
    monkeypatch.setenv("ENGINE_ARTIFACT_VERIFY", "size")
    loaded = load_artifact(art)
    assert loaded.backend == "eager"              # same size: the check before the load passes
    with pytest.raises(ArtifactError, match="SHA-256 differs"):
        loaded.check_weights()                    # ... the full hash does not
    monkeypatch.delenv("ENGINE_ARTIFACT_VERIFY")
    assert load_artifact(art, verify="size").backend == "eager"
    with pytest.raises(ArtifactError, match="sampled SHA-256"):
        load_artifact(art)                        # the first block is always sampled
    with pytest.raises(ArtifactError, match="SHA-256"):
        load_artifact(art, verify="sha256")       # every byte, before the load


def test_an_intact_artifact_passes_the_full_hash_in_every_mode(built):
    for verify in ("quick", "size", "sha256"):
        a = load_artifact(built[0], verify=verify)
        a.check_weights()
        a.check_weights()                          # a finished check answers again at once
        assert a.weights.report()["bytes"] == (0 if verify == "sha256" else a.total_bytes())


@pytest.mark.parametrize("verify", ["", "size"])    # "": the default (quick)
def test_damaged_weights_answer_nothing(art, small_cohort, monkeypatch, verify):
    """A byte of the weights flipped where no sampled block reads: the artifact loads (its
    checks before the load pass), and classify and classify_bytes raise ArtifactError naming
    the file instead of answering from those weights."""
    import engine
    from engine import settings

    monkeypatch.setenv("ENGINE_ARTIFACT_VERIFY", verify)
    settings.reload()
    w = art / "weights.safetensors"
    _flip_byte(w, at=_between_samples(w))
    assert sample_sha256(w) == json.loads((art / MANIFEST).read_text())["files"]["weights.safetensors"]["sample_sha256"]
    paths = sorted(small_cohort.rglob("*.JPEG"))[:4]
    try:
        with engine.load(art, decoder="pil") as clf:
            with pytest.raises(ArtifactError, match="weights.safetensors is corrupt"):
                clf.classify(paths)
            with pytest.raises(ArtifactError, match="weights.safetensors is corrupt"):
                clf.classify_bytes([p.read_bytes() for p in paths])
    finally:
        settings.reload()


@pytest.mark.abi
def test_a_run_on_damaged_weights_writes_no_output_in_one_line(art, small_cohort, tmp_path):
    """scripts/run under the default ENGINE_ARTIFACT_VERIFY, on an artifact whose weights have a byte
    flipped between the sampled blocks: one `run: error:` line naming the file, exit 2, no OUTPUT."""
    from conftest import run_abi

    w = art / "weights.safetensors"
    _flip_byte(w, at=_between_samples(w))
    out = tmp_path / "p.i32"
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, out, art, env={"ENGINE_ARTIFACT_VERIFY": ""},
                timeout=300)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("run: error:")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
    assert str(w) in lines[0] and "SHA-256 differs from the manifest" in lines[0], lines[0]
    assert "Traceback" not in r.stderr and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]   # no temp OUTPUT left


def test_bad_verify_mode_is_an_error(art, monkeypatch):
    monkeypatch.setenv("ENGINE_ARTIFACT_VERIFY", "none")
    with pytest.raises(ArtifactError, match="ENGINE_ARTIFACT_VERIFY"):
        load_artifact(art)


def _edit(art: Path, change, redigest: bool = False) -> None:
    """Apply `change(meta)` to the manifest; `redigest` recomputes its digest (a deliberate forgery)."""
    p = art / MANIFEST
    meta = json.loads(p.read_text())
    change(meta)
    if redigest:
        meta[DIGEST_KEY] = manifest_digest(meta)
    p.write_text(json.dumps(meta))


@pytest.mark.parametrize("field, value", [("input_size", 96), ("input_size", 224), ("batch_size", 8),
                                          ("crop_pct", 0.5), ("crop_mode", "center"), ("interpolation", "bilinear"),
                                          ("mean", [0.5, 0.5, 0.5])])
def test_an_edited_spec_is_refused(art, field, value):
    _edit(art, lambda m: m["spec"].__setitem__(field, value))
    with pytest.raises(ArtifactError, match=f"{MANIFEST} was changed after the build"):
        load_artifact(art)


def test_an_emptied_file_list_is_refused(art):
    _edit(art, lambda m: m.__setitem__("files", {}))
    with pytest.raises(ArtifactError, match="changed after the build"):
        load_artifact(art)
    _edit(art, lambda m: None, redigest=True)          # even with a matching digest: the backend's file is unlisted
    with pytest.raises(ArtifactError, match=r"loads \['weights.safetensors'\], which the manifest does not list"):
        load_artifact(art)


@pytest.mark.parametrize("field, value", [("input_size", 224), ("batch_size", 8)])
def test_spec_that_differs_from_the_compiled_graph_is_refused(art, field, value):
    """A forged manifest (digest recomputed) still cannot ask for another shape than the build ran."""
    def change(m):
        m["spec"][field] = value
        if field == "batch_size":
            m["batch_size"] = value
    _edit(art, change, redigest=True)
    with pytest.raises(ArtifactError, match="does not match the compiled graph"):
        load_artifact(art)


@pytest.mark.parametrize("change, match", [
    (lambda m: m.pop("graph"), "no compiled-graph record"),
    (lambda m: m.__setitem__("batch_size", 8), "field 'batch_size'"),
    (lambda m: m.__setitem__("precision", "fp16"), "field 'precision'"),
    (lambda m: m.__setitem__("device", "tpu"), "field 'device'"),
    (lambda m: m.__setitem__("backend", "nonesuch"), "unknown backend"),
    (lambda m: m["spec"].__setitem__("input_size", "112"), "spec"),
    (lambda m: m["spec"].__setitem__("mean", [0.5]), "spec"),
    (lambda m: m["spec"].__setitem__("bogus", 1), "bogus"),
    (lambda m: m["files"]["weights.safetensors"].__setitem__("bytes", "many"), "malformed"),
    (lambda m: m["files"].__setitem__("../outside.bin", m["files"]["weights.safetensors"]), "not a plain path"),
    (lambda m: m["graph"]["outputs"][0].__setitem__("dtype", "int64"), "top-1 output"),
])
def test_malformed_fields_are_refused_even_with_a_matching_digest(art, change, match):
    _edit(art, change, redigest=True)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(art)


def test_manifest_of_the_wrong_json_type_or_format(art):
    (art / MANIFEST).write_text("[]")
    with pytest.raises(ArtifactError, match="a JSON list, not an object"):
        load_artifact(art)
    _edit_text = json.dumps({"format": "eva-engine-artifact/1"})
    (art / MANIFEST).write_text(_edit_text)
    with pytest.raises(ArtifactError, match="rebuild the artifact"):
        load_artifact(art)
    (art / MANIFEST).write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ArtifactError, match="corrupt"):
        load_artifact(art)


def test_a_listed_file_that_is_a_symlink_out_of_the_artifact_is_refused(art, tmp_path):
    w = art / "weights.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    w.rename(outside)
    w.symlink_to(outside)
    with pytest.raises(ArtifactError, match="not a regular file inside the artifact"):
        load_artifact(art)


def test_a_listed_file_that_is_a_fifo_is_refused_without_opening_it(art):
    w = art / "weights.safetensors"
    w.unlink()
    os.mkfifo(w)
    with pytest.raises(ArtifactError, match="not a regular file"):
        load_artifact(art, verify="sha256")


@pytest.mark.parametrize("verify", ["sha256", "size"])
def test_truncated_file_is_a_size_error(art, verify):
    p = art / "weights.safetensors"
    n = p.stat().st_size
    p.write_bytes(p.read_bytes()[: n - 100])
    with pytest.raises(ArtifactError, match=f"has {n - 100} bytes, manifest says {n}"):
        load_artifact(art, verify=verify)


def test_missing_listed_file(art):
    (art / "weights.safetensors").unlink()
    with pytest.raises(ArtifactError, match="artifact file missing.*weights.safetensors"):
        load_artifact(art)


def test_missing_manifest(art):
    (art / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match=f"{MANIFEST} is missing"):
        load_artifact(art)


@pytest.mark.parametrize("text, match", [
    ("{not json", "corrupt"),
    (json.dumps({"format": "something-else/9"}), "format"),
    (json.dumps({"format": FORMAT}), "changed after the build"),
    (json.dumps({"format": FORMAT, "spec": {"model": "m", "input_size": 112, "bogus": 1}, "files": {}}),
     "changed after the build"),
])
def test_corrupt_manifest(art, text, match):
    (art / MANIFEST).write_text(text)
    with pytest.raises(ArtifactError, match=match):
        load_artifact(art)


def test_not_a_directory(tmp_path, art):
    with pytest.raises(ArtifactError, match="not found"):
        load_artifact(tmp_path / "no_such_dir")
    with pytest.raises(ArtifactError, match="not found"):
        load_artifact(art / "weights.safetensors")  # a file, not a directory


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir())


def test_rebuild_replaces_atomically(tmp_path, ckpt):
    out = tmp_path / "artifact"
    build(tiny_spec(), ckpt, out, backend="eager")
    (out / "stale.bin").write_bytes(b"left from an older build")
    spec8 = dataclasses.replace(tiny_spec(), batch_size=8)
    meta = build(spec8, ckpt, out, backend="eager")
    assert _siblings(out) == ["artifact"]  # no .artifact.* temp or .old dirs left behind
    assert not (out / "stale.bin").exists()
    assert meta["batch_size"] == 8 and load_artifact(out).batch_size == 8


def test_failed_rebuild_keeps_the_old_artifact(tmp_path, ckpt, monkeypatch):
    import engine.tuning.assemble

    out = tmp_path / "artifact"
    build(tiny_spec(), ckpt, out, backend="eager")
    before = (out / MANIFEST).read_text()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(engine.tuning.assemble, "write_manifest", boom)   # the manifest, written last
    with pytest.raises(RuntimeError, match="disk full"):
        build(dataclasses.replace(tiny_spec(), batch_size=8), ckpt, out, backend="eager")
    assert _siblings(out) == ["artifact"]
    assert (out / MANIFEST).read_text() == before
    assert load_artifact(out).batch_size == 16


@pytest.mark.abi
def test_cli_missing_checkpoint_exits_2_with_one_line(tmp_path):
    missing = tmp_path / "absent.safetensors"
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "engine.build", "--model", "eva02_tiny_patch14_224",
                        "--checkpoint", str(missing), "--out", str(out), "--backend", "eager",
                        "--input-size", "112", "--crop-pct", "1.0", "--model-kwargs", '{"depth": 4}'],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("engine.build: error:") and str(missing) in lines[0]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_the_artifact_records_the_stack_and_refuses_another_torch(art):
    meta = json.loads((art / MANIFEST).read_text())
    assert meta["versions"]["torch_cuda"] == torch.version.cuda
    assert meta["versions"]["torchvision"] is not None
    _edit(art, lambda m: m["versions"].__setitem__("torch", "2.13.0"), redigest=True)
    here = torch.__version__.split("+")[0]
    with pytest.raises(ArtifactError, match=f"built with torch 2.13.0, this is torch {here}: rebuild it"):
        load_artifact(art)
    _edit(art, lambda m: m.pop("versions"), redigest=True)
    with pytest.raises(ArtifactError, match="built with torch None"):
        load_artifact(art)


@pytest.mark.abi
def test_a_run_refuses_another_torchs_artifact_in_one_line(art, small_cohort, tmp_path):
    from conftest import run_abi

    _edit(art, lambda m: m["versions"].__setitem__("torch", "2.13.0"), redigest=True)
    r = run_abi(small_cohort / "manifest.tsv", small_cohort, tmp_path / "p.i32", art, timeout=120)
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("run: error:")]
    assert r.returncode == 2 and len(lines) == 1 and "built with torch 2.13.0" in lines[0], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not (tmp_path / "p.i32").exists()


# ---------------------------------------------------------------- AOTInductor loaded in place

@pytest.mark.abi   # the AOTInductor artifact (a compile)
def test_the_aot_artifact_holds_the_unpacked_graph(aot_artifact):
    from engine.backends import aot, compiled_suffixes

    meta = json.loads((aot_artifact / MANIFEST).read_text())
    assert "aot/model.so" in meta["files"] and "aot/model_metadata.json" in meta["files"]
    assert not [n for n in meta["files"] if n.endswith((".pt2", ".cpp", ".h"))], meta["files"]
    assert meta["aot"]["so"] == aot.FILES[0] and meta["aot"]["compile_workers"] >= 1
    assert sorted(f"aot/{n}" for n in meta["aot"]["files"]) == sorted(n for n in meta["files"] if n.startswith("aot/"))
    assert ".so" in compiled_suffixes()                 # the rehearsal and provenance see compiled code
    assert json.loads((aot_artifact / "aot" / "model_metadata.json").read_text())["AOTI_DEVICE_KEY"] == "cpu"


def test_unpack_refuses_a_package_without_exactly_one_library(tmp_path):
    import zipfile

    from engine.backends.aot import unpack

    pkg = tmp_path / "m.pt2"
    with zipfile.ZipFile(pkg, "w") as z:
        z.writestr("m/data/aotinductor/model/a.wrapper.cpp", "int x;")
    with pytest.raises(RuntimeError, match="expected one compiled .so in the package, found"):
        unpack(pkg, tmp_path / "out")


_LOAD_THEN = """
import os, signal, sys, tempfile
from pathlib import Path
from engine.classify.artifact import load_artifact
from engine.classify.runtime import load_runtime
import numpy as np
rt = load_runtime(load_artifact(sys.argv[1]))
rt.run(np.zeros((rt.batch_size, 112, 112, 3), np.uint8))
held = sorted(str(p) for p in Path(tempfile.gettempdir()).rglob("*"))
print(repr(held), flush=True)
how = sys.argv[2]
if how == "error":
    raise RuntimeError("an error after the graph was loaded")
if how == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
os._exit(0)        # the fast exit of scripts/run: no destructor runs
"""


def _aoti_entries_in_tmp() -> set[str]:
    return {p.name for p in Path("/tmp").glob("aotinductor_*")}


@pytest.mark.abi
@pytest.mark.parametrize("how, rc", [("exit", 0), ("error", 1), ("kill", -9)])
def test_a_loaded_aot_graph_writes_nothing_to_tmpdir_or_tmp(aot_artifact, tmp_path, how, rc):
    """Loaded, run once, then exited fast, failed or killed: TMPDIR held nothing while the graph
    was loaded and holds nothing after; /tmp got no aotinductor_* folder."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    before = _aoti_entries_in_tmp()
    r = subprocess.run([sys.executable, "-c", _LOAD_THEN, str(aot_artifact), how], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)})
    assert r.returncode == rc, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout      # nothing in TMPDIR while loaded
    assert list(tmp.iterdir()) == []
    assert not (_aoti_entries_in_tmp() - before)


def _maps(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


@pytest.mark.abi
def test_a_terminated_aot_run_leaves_nothing_behind(aot_artifact, small_cohort, tmp_path):
    """scripts/run, SIGTERM once the compiled .so is mapped: TMPDIR and /tmp hold nothing of it."""
    import signal
    import time

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    rows = (small_cohort / "manifest.tsv").read_text().splitlines()
    m = tmp_path / "long.tsv"
    m.write_text("\n".join(rows * 40) + "\n")                         # long enough to be caught mid-run
    before = _aoti_entries_in_tmp()
    so = str((aot_artifact / "aot" / "model.so").resolve())
    env = {**os.environ, "ENGINE_ARTIFACT": str(aot_artifact), "TMPDIR": str(tmp)}
    p = subprocess.Popen([str(REPO / "scripts" / "run"), str(m), str(small_cohort), str(tmp_path / "p.i32")],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while so not in _maps(p.pid) and time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.02)
    if p.poll() is not None:
        pytest.skip("the run ended before it could be terminated")
    assert so in _maps(p.pid)                                          # loaded from the artifact itself
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 128 + signal.SIGTERM, p.stderr.read()[-3000:]
    assert list(tmp.iterdir()) == []
    assert not (_aoti_entries_in_tmp() - before)


def test_the_aot_compile_keeps_inductors_autotune_reports_out_of_the_log_unless_debugging(monkeypatch, tmp_path):
    """max-autotune makes Inductor write an `AUTOTUNE addmm(...)` block and a JSON stats line per GEMM
    straight to stderr: the compile runs with both reports off; ENGINE_DEBUG=1 (engine.build --debug)
    leaves Inductor's own settings. Errors are Inductor's logging, which neither setting touches."""
    import zipfile

    from engine.backends import aot

    assert all(hasattr(torch._inductor.config, k) for k in aot.QUIET_REPORTS)   # names this torch knows
    seen = []

    def fake_compile(ep, package_path, inductor_configs):
        cfg = torch._inductor.config
        seen.append((cfg.autotune_num_choices_displayed, cfg.max_autotune_report_choices_stats,
                     inductor_configs.get("max_autotune")))
        with zipfile.ZipFile(package_path, "w") as z:
            z.writestr("model/data/aotinductor/model/c1.wrapper.so", b"\x7fELF")
        return package_path

    monkeypatch.setattr(aot, "export_top1", lambda net, spec, device, margin: (None, torch.zeros(2, 8, 8, 3)))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    monkeypatch.delenv("ENGINE_DEBUG", raising=False)
    net = torch.nn.Linear(8, 8)
    (tmp_path / "quiet").mkdir()
    (tmp_path / "debug").mkdir()
    aot.save(net, tiny_spec(), "cpu", tmp_path / "quiet", options="max-autotune")
    monkeypatch.setenv("ENGINE_DEBUG", "1")
    aot.save(net, tiny_spec(), "cpu", tmp_path / "debug", options="max-autotune")
    defaults = (torch._inductor.config.autotune_num_choices_displayed,
                torch._inductor.config.max_autotune_report_choices_stats)
    assert seen[0] == (0, False, True)
    assert seen[1] == (*defaults, True) and defaults != (0, False)


def test_engine_build_debug_lets_the_library_reports_through(monkeypatch, tmp_path):
    """`python -m engine.build --debug` is ENGINE_DEBUG=1 for the compiles in it (and its children),
    and only for that call: main() called in-process leaves the environment as it found it."""
    from engine.backends import aot
    from engine.tuning import command

    monkeypatch.setenv("ENGINE_DEBUG", "0")
    monkeypatch.delenv("ENGINE_DEBUG")          # absent, and put back as it was at teardown
    seen = []

    def build(*a, **k):
        seen.append((os.environ.get("ENGINE_DEBUG"), aot.quiet_reports()))
        raise ValueError("stop here")

    monkeypatch.setattr(command, "build", build)
    args = ["--model", "eva02_tiny_patch14_224", "--out", str(tmp_path / "a"), "--backend", "eager",
            "--precision", "fp32", "--batch-size", "8"]
    assert aot.quiet_reports()
    assert command.main(args) == 2 and seen[-1][0] is None and seen[-1][1]
    with pytest.raises(ValueError, match="stop here"):   # --debug re-raises
        command.main([*args, "--debug"])
    assert seen[-1] == ("1", {})
    assert "ENGINE_DEBUG" not in os.environ and aot.quiet_reports()


def test_the_aot_build_bounds_its_compile_workers_and_says_what_tmpdir_needs(monkeypatch, tmp_path, capsys):
    """Inductor's compile workers are the thread budget (a bounded sandbox counts PIDs); the build
    says the worker count and the TMPDIR space it needs, has and used (no compile here: a fake one)."""
    import zipfile

    from engine import threads
    from engine.backends import aot

    seen = {}

    def fake_compile(ep, package_path, inductor_configs):
        seen["threads"] = torch._inductor.config.compile_threads
        with zipfile.ZipFile(package_path, "w") as z:
            z.writestr("model/data/aotinductor/model/c1.wrapper.so", b"\x7fELF" + b"\0" * 4096)
            z.writestr("model/data/aotinductor/model/c1.wrapper_metadata.json", b'{"AOTI_DEVICE_KEY": "cpu"}')
            z.writestr("model/data/aotinductor/model/c1.wrapper.cpp", b"int main;")
        return package_path

    monkeypatch.setattr(threads, "budget", lambda device="cpu": threads.Budget(3, 2, 3, 3, 1))
    monkeypatch.setattr(aot, "export_top1", lambda net, spec, device, margin: (None, torch.zeros(2, 8, 8, 3)))
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    net = torch.nn.Linear(256, 256)                     # 257 KiB of weights
    extra = aot.save(net, tiny_spec(), "cpu", tmp_path)["aot"]
    assert seen["threads"] == 3 and extra["compile_workers"] == 3
    assert sorted(p.name for p in (tmp_path / "aot").iterdir()) == ["model.so", "model_metadata.json"]
    assert not list(tmp_path.glob("*.pt2")) and extra["files"] == ["model.so", "model_metadata.json"]
    err = capsys.readouterr().err
    assert "AOTInductor compile with 3 worker processes" in err and "needs about 0.3 GiB" in err
    assert "GiB free there" in err and "the Inductor cache grew by" in err

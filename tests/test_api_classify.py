"""The Python API (engine.load -> Classifier) answers exactly what scripts/run writes."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, readme_python_block
from PIL import Image

import engine
from evaluator.contest.manifest import read_manifest

# the README's first example, as it runs from the repository after `python3 -m evaluator.demo`:
# the demo's artifact in demo/artifact, its cohort in demo/cohort
EXAMPLE = readme_python_block(0)


@pytest.fixture(scope="module")
def abi_output(plain_run):
    """scripts/run's OUTPUT on the small cohort with the eager artifact (the session's run), as int32."""
    r, out, _ = plain_run
    assert r.returncode == 0, r.stderr[-3000:]
    return np.fromfile(out, "<i4")


def _paths(cohort) -> list[str]:
    return [str(cohort / r.path) for r in read_manifest(cohort / "manifest.tsv")]


def _broken(cohort) -> list[int]:
    items = json.loads((cohort / "cohort.json").read_text())["items"]
    return [i for i, it in enumerate(items) if it["encoding"].startswith("broken")]


def _black_png(size: int = 64) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((size, size, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.abi
def test_the_example_answers_what_scripts_run_writes(small_cohort, eager_artifact, abi_output, capsys, tmp_path,
                                                     monkeypatch):
    """The block as the README shows it, in a folder laid out as the demo leaves the repository
    (demo/artifact, demo/cohort/manifest.tsv and its images; see evaluator/contest/demo.py)."""
    from evaluator.contest.demo import parse_args

    assert str(parse_args([]).out) == "demo"        # where `python3 -m evaluator.demo` writes by default
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "artifact").symlink_to(eager_artifact)
    (tmp_path / "demo" / "cohort").symlink_to(small_cohort)
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(EXAMPLE, ns)
    assert ns["paths"] == [f"demo/cohort/{r.path}" for r in read_manifest(small_cohort / "manifest.tsv")]
    assert ns["top1"].dtype == np.int32 and ns["top1"].tolist() == abi_output.tolist()
    assert {"imports", "artifact_load", "read", "decode", "inference", "pipeline"} <= set(ns["stages"])
    printed = capsys.readouterr().out
    assert all(f"{ns['paths'][i]}: unreadable" in printed for i in _broken(small_cohort))


@pytest.mark.abi
def test_classify_bytes_paths_and_failures(small_cohort, eager_artifact, abi_output, tmp_path, capsys):
    paths = _paths(small_cohort)
    blobs = [open(p, "rb").read() for p in paths]
    broken = _broken(small_cohort)
    assert len(broken) == 3
    with engine.load(eager_artifact) as clf:
        capsys.readouterr()
        assert clf.classify_bytes(blobs).tolist() == abi_output.tolist()
        assert sorted(clf.last_failed) == broken
        err = capsys.readouterr().err.splitlines()
        assert [ln for ln in err if ": unreadable, predicted " in ln] == \
            [f"[engine] item {i}: unreadable, predicted {abi_output[i]}: {clf.last_failed[i]}" for i in broken]

        # an unreadable file is named and gets the prediction of a zero image, as in scripts/run
        zero = int(clf.classify_bytes([_black_png()])[0])
        missing = str(tmp_path / "no-such.jpg")
        got = clf.classify([paths[0], missing, paths[1]])
        assert got.tolist() == [abi_output[0], zero, abi_output[1]]
        assert list(clf.last_failed) == [1] and "No such file" in clf.last_failed[1]
        err = capsys.readouterr().err
        assert sum(f"[engine] {missing}: unreadable, predicted {zero}: " in ln for ln in err.splitlines()) == 1
        assert all(abi_output[i] == zero for i in broken)

        rep = clf.report()
        assert rep["images"] == 3 and rep["failed"] == 1 and rep["backend"] == "eager"
        assert all(rep["stages"][k] >= 0 for k in ("imports", "artifact_load", "read", "decode", "inference",
                                                   "pipeline"))
        assert {e["stage"] for e in rep["timeline"]} == {"decode", "inference"}
        assert rep["threads"]["readers"] >= 1 and rep["peak_rss_mib"]["process"] > 0
    with pytest.raises(RuntimeError, match="closed"):
        clf.classify(paths[:1])


def test_a_directory_that_is_not_an_artifact_is_a_load_error(tmp_path):
    with pytest.raises(engine.LoadError) as e:
        engine.load(tmp_path)
    assert e.value.stage == "artifact" and str(e.value).startswith(f"cannot load artifact {tmp_path}: ")


def test_an_address_space_limit_below_the_need_is_a_load_error_before_torch(eager_artifact):
    """The limit is checked first (stage "memory"), in a child so the limit binds nothing else."""
    code = ("import resource, sys, engine; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, resource.RLIM_INFINITY))\n"
            "try:\n    engine.load(sys.argv[1])\nexcept engine.LoadError as e:\n"
            "    print(e.stage, 'torch' in sys.modules, str(e).split(' (')[0])")
    r = subprocess.run([sys.executable, "-c", code, str(eager_artifact)], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().split(maxsplit=2) == ["memory", "False", "the address-space limit"]


def test_importing_engine_loads_neither_torch_nor_numpy():
    code = ("import sys, engine; heavy = sorted(m for m in ('torch', 'numpy') if m in sys.modules); "
            "r = engine.retrieval; print(heavy, r.__name__, callable(engine.load))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]", "engine.retrieval", "True"]

"""evaluator.rehearsal.provenance: the demo artifact's record says what made it; planted validation data is flagged."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO

from evaluator.rehearsal import provenance

pytestmark = pytest.mark.abi   # python -m evaluator.provenance (and the demo's prepare) as whole processes

VAL_FILE = "ILSVRC2012" + "_val_" + "00000001.JPEG"  # assembled: this file must not match itself


@pytest.fixture(scope="module")
def demo_artifact(tiny_checkpoint, tmp_path_factory) -> Path:
    """The artifact `python -m evaluator.demo prepare` makes, from the session's tiny checkpoint."""
    out = tmp_path_factory.mktemp("prov_demo")
    for suffix in (".safetensors", ".json"):  # prepare reuses a checkpoint whose recipe has the same seed
        shutil.copy(tiny_checkpoint.with_suffix(suffix), out / f"tiny_eva02{suffix}")
    r = subprocess.run([sys.executable, "-m", "evaluator.demo", "prepare", "--out", str(out), "--count", "12",
                        "--backend", "eager", "--batch-size", "4"], cwd=REPO, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "artifact"


def _provenance(*args: str) -> tuple[int, dict, str]:
    r = subprocess.run([sys.executable, "-m", "evaluator.provenance", *args], cwd=REPO, capture_output=True,
                       text=True, timeout=300)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}, r.stderr


@pytest.fixture
def planted(demo_artifact, tmp_path) -> Path:
    """A copy of the demo artifact to plant files in."""
    art = tmp_path / "artifact"
    shutil.copytree(demo_artifact, art)
    return art


def test_demo_record_says_generated_images(demo_artifact, tmp_path):
    out = tmp_path / "prov.json"
    rc, summary, err = _provenance(str(demo_artifact), "--out", str(out))
    assert rc == 0, err[-3000:]
    assert summary["verdict"] == "CLEAN" and "generated images" in summary["checkpoint_made_from"]
    rec = json.loads(out.read_text())
    assert rec["checkpoint"]["sha256_matches_manifest"] is True
    assert "generated images" in rec["checkpoint"]["metadata"]["made_from"]
    files = {f["path"]: f for f in rec["files"]}
    assert set(files) == {"manifest.json", "weights.safetensors"}
    w = files["weights.safetensors"]
    assert w["matches_manifest"] and "generated images" in w["made_from"] and w["flags"] == []
    assert w["sha256"] == provenance.sha256_file(demo_artifact / "weights.safetensors")
    assert "--checkpoint" in rec["build"]["argv"]
    assert rec["environment"]["torch"] and rec["environment"]["timm"]
    sources = {f["path"] for f in rec["source"]["files"]}
    assert {"evaluator/rehearsal/provenance.py", "scripts/run", "engine/tuning/command.py"} <= sources
    assert rec["flagged"] == []


def test_planted_validation_file_name_is_flagged(planted):
    (planted / VAL_FILE).write_bytes(b"\xff\xd8\xff")
    rc, rec, err = _provenance(str(planted), "--no-source")
    assert rc == 1 and rec["verdict"] == "FLAGGED"
    flags = {f["path"]: " ".join(f["flags"]) for f in rec["flagged"]}
    assert "ImageNet validation image" in flags[VAL_FILE] and "not listed in manifest" in flags[VAL_FILE]
    assert "FLAG" in err


@pytest.mark.parametrize("name, content, why", [
    ("answers.tsv", "".join(f"req{i:05d}\t{i % 1000}\n" for i in range(1200)), "answer table"),
    ("labels.txt", "".join(f"{(i * 7) % 1000 + 1}\n" for i in range(50_000)), "answer column"),
    ("synsets.txt", "".join(f"n{i:08d} thing {i}\n" for i in range(1000)), "synset"),
    ("notes.json", json.dumps([f"ILSVRC2012_val_{i:08d}.JPEG" for i in range(20)]), "validation file names"),
    ("val.txt", "a 1\n", "val.txt"),
], ids=["answer-table", "answer-column", "synsets", "val-names", "val-txt"])
def test_planted_text_tables_are_flagged(planted, name, content, why):
    (planted / name).write_text(content)
    rc, rec, _ = _provenance(str(planted), "--no-source")
    assert rc == 1
    assert any(why in fl for f in rec["flagged"] if f["path"] == name for fl in f["flags"]), rec["flagged"]


@pytest.mark.parametrize("name, n", [("answers.i32", 10_000), ("cohort.npy", 50_000)], ids=["i32", "npy"])
def test_planted_answer_arrays_are_flagged(planted, name, n):
    a = (np.arange(n) * 37 % 1000).astype(np.int32)
    if name.endswith(".npy"):
        np.save(planted / name, a)
    else:
        a.astype("<i4").tofile(planted / name)
    rc, rec, _ = _provenance(str(planted), "--no-source")
    assert rc == 1
    assert any("answer array" in fl for f in rec["flagged"] for fl in f["flags"]), rec["flagged"]


def test_near_misses_are_not_flagged(tmp_path):
    (tmp_path / "a.i32").write_bytes(np.full(9_999, 5, "<i4").tobytes())          # not a cohort size
    (tmp_path / "b.i32").write_bytes(np.full(10_000, 1000, "<i4").tobytes())      # outside [0, 999]
    (tmp_path / "c.txt").write_text("".join(f"k{i}\t{i}\n" for i in range(999)))  # too short for a table
    (tmp_path / "d.md").write_text(f"Never ship files named like {VAL_FILE}.\n")   # one mention in prose
    for p in tmp_path.iterdir():
        flags = provenance.content_flags(p) + (provenance.name_flags(p.name) if p.name != "d.md" else [])
        assert flags == [], (p.name, flags)


def test_not_an_artifact(tmp_path):
    rc, _, err = _provenance(str(tmp_path))
    assert rc == 2 and "not an artifact" in err


def test_not_an_artifact_is_one_error_line_and_exit_2(tmp_path):
    rc, summary, err = _provenance(str(tmp_path))
    assert rc == 2 and summary == {} and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"python -m evaluator.provenance: error: {tmp_path} has no manifest.json " \
                                           "(not an artifact)"

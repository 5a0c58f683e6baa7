"""evaluator.synthetic.cohort: the generated images cover the hard encodings, and the tiny checkpoint looks trained."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_spec
from PIL import Image, JpegImagePlugin

from engine.core.checkpoint import create_model, load_model
from engine.decoders.pil import reference_tensor
from evaluator.contest.manifest import read_manifest
from evaluator.synthetic.cohort import class_ids, make_cohort

SMALL_COUNT, SMALL_BROKEN = 40, 3  # as conftest's small_cohort makes it


def _open(p: Path) -> Image.Image:
    im = Image.open(p)
    im.load()
    return im


def _readable(root: Path) -> dict[str, Image.Image]:
    out = {}
    for r in read_manifest(root / "manifest.tsv"):
        try:
            out[r.path] = _open(root / r.path)
        except Exception:  # noqa: BLE001 - the broken files are counted in their own test
            pass
    return out


@pytest.fixture(scope="module")
def small(small_cohort) -> tuple[Path, dict, dict[str, Image.Image]]:
    record = json.loads((small_cohort / "cohort.json").read_text())
    return small_cohort, record, _readable(small_cohort)


def test_manifest_rows_ids_and_order(small):
    root, record, _ = small
    rows = read_manifest(root / "manifest.tsv")
    assert len(rows) == SMALL_COUNT == record["count"]
    ids = [r.request_id for r in rows]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    paths = [r.path for r in rows]
    assert len(set(paths)) == len(paths) and all((root / p).is_file() for p in paths)
    # rows are not in file order, and ids are not sorted either: output order is by row only
    assert paths != sorted(paths)
    assert ids != sorted(ids)
    # cohort.json lists the same items in manifest order
    assert [(it["request_id"], it["path"]) for it in record["items"]] == list(zip(ids, paths))
    assert sorted(paths) == sorted(p.relative_to(root).as_posix() for p in (root / "images").rglob("*.JPEG"))


def test_sizes_within_range(small):
    _, _, images = small
    assert len(images) == SMALL_COUNT - SMALL_BROKEN
    for path, im in images.items():
        w, h = im.size
        assert 150 <= w <= 800 and 150 <= h <= 800, (path, im.size)
    assert len({im.size for im in images.values()}) > len(images) // 2  # sizes vary


def test_encodings_present_and_detectable(small):
    _, record, images = small
    jpegs = {p: im for p, im in images.items() if im.format == "JPEG"}
    found = {
        "progressive": [p for p, im in jpegs.items() if im.info.get("progressive")],
        "grayscale": [p for p, im in jpegs.items() if im.mode == "L"],
        "cmyk": [p for p, im in jpegs.items() if im.mode == "CMYK"],
        "444": [p for p, im in jpegs.items() if im.mode == "RGB" and JpegImagePlugin.get_sampling(im) == 0],
        "420": [p for p, im in jpegs.items() if im.mode == "RGB" and JpegImagePlugin.get_sampling(im) == 2],
        "png_as_jpeg": [p for p, im in images.items() if im.format == "PNG" and p.endswith(".JPEG")],
    }
    assert all(found.values()), {k: len(v) for k, v in found.items()}
    # the record's encoding labels agree with what PIL sees
    enc = {it["path"]: it["encoding"] for it in record["items"]}
    assert all(enc[p].startswith("progressive") for p in found["progressive"])
    assert all(enc[p].startswith("gray") for p in found["grayscale"])
    assert all(enc[p].startswith("cmyk") for p in found["cmyk"])
    assert all(enc[p].startswith("png") for p in found["png_as_jpeg"])
    assert all(enc[p].endswith("sub0") for p in found["444"])


def test_broken_files_present_and_unreadable(small):
    root, record, images = small
    broken = {it["path"]: it["encoding"] for it in record["items"] if it["encoding"].startswith("broken:")}
    assert sorted(broken.values()) == ["broken:empty", "broken:text", "broken:truncated"]
    assert set(broken) == {r.path for r in read_manifest(root / "manifest.tsv")} - set(images)
    for path in broken:
        with pytest.raises((OSError, SyntaxError, ValueError)):
            Image.open(root / path).convert("RGB")
    assert (root / next(p for p, e in broken.items() if e == "broken:empty")).stat().st_size == 0
    # broken files are not all at the end of the manifest
    rows = [r.path for r in read_manifest(root / "manifest.tsv")]
    assert max(rows.index(p) for p in broken) - min(rows.index(p) for p in broken) > 0
    assert sorted(rows.index(p) for p in broken) != list(range(len(rows) - 3, len(rows)))


def test_cohort_is_deterministic(tmp_path):
    a = make_cohort(tmp_path / "a", 6, seed=5, broken=1)
    b = make_cohort(tmp_path / "b", 6, seed=5, broken=1)
    assert a == b
    assert (tmp_path / "a" / "manifest.tsv").read_bytes() == (tmp_path / "b" / "manifest.tsv").read_bytes()
    for it in a["items"]:
        assert (tmp_path / "a" / it["path"]).read_bytes() == (tmp_path / "b" / it["path"]).read_bytes()


# ---- the tiny checkpoint --------------------------------------------------------------------------


def _logits(model: torch.nn.Module, root: Path) -> tuple[torch.Tensor, list[dict]]:
    """[N, 1000] logits of the readable images of `root` through the eager FP32 reference path."""
    record = json.loads((root / "cohort.json").read_text())
    xs, items = [], []
    for it in record["items"]:
        if it["encoding"].startswith("broken:"):
            continue
        xs.append(reference_tensor((root / it["path"]).read_bytes(), tiny_spec()))  # [3, S, S] float32
        items.append(it)
    with torch.inference_mode():
        return model(torch.stack(xs)), items


def _margins(logits: torch.Tensor) -> list[float]:
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


@pytest.fixture(scope="module")
def trained(tiny_checkpoint) -> torch.nn.Module:
    return load_model(tiny_spec(), tiny_checkpoint)


@pytest.fixture(scope="module")
def small_logits(trained, small_cohort) -> torch.Tensor:
    return _logits(trained, small_cohort)[0]


@pytest.fixture(scope="module")
def random_head_logits(tiny_checkpoint, small_cohort) -> torch.Tensor:
    """The same backbone with timm's default head init."""
    model = load_model(tiny_spec(), tiny_checkpoint)
    torch.manual_seed(0)
    model.head.load_state_dict(create_model(tiny_spec()).head.state_dict())
    return _logits(model, small_cohort)[0]


def test_many_distinct_top1_classes(small_logits):
    assert small_logits.shape == (SMALL_COUNT - SMALL_BROKEN, 1000)
    assert len(set(small_logits.argmax(-1).tolist())) >= 15


def test_median_margin_on_small_cohort(small_logits):
    assert statistics.median(_margins(small_logits)) >= 1.0


def test_random_head_has_near_ties(small_logits, random_head_logits):
    trained_m = statistics.median(_margins(small_logits))
    random_m = statistics.median(_margins(random_head_logits))
    assert random_m * 5 <= trained_m, (random_m, trained_m)


def test_checkpoint_recognises_its_own_classes(trained, tmp_path):
    """On a cohort drawn from the templates the head was fit on (seed 0), top-1 is the template's class."""
    root = tmp_path / "seed0"
    make_cohort(root, 40, seed=0, broken=1)
    logits, items = _logits(trained, root)
    want = class_ids(100, 0)[[it["template"] for it in items]]
    acc = float((logits.argmax(-1).numpy() == want).mean())
    assert acc >= 0.8, acc
    assert statistics.median(_margins(logits)) >= 1.0
    assert len(set(logits.argmax(-1).tolist())) >= 15
    assert np.isin(logits.argmax(-1).numpy(), class_ids(100, 0)).mean() >= 0.95  # only the fitted classes win


def test_checkpoint_metadata_says_generated(tiny_checkpoint):
    from safetensors import safe_open

    with safe_open(str(tiny_checkpoint), "pt") as f:
        meta = f.metadata()
    assert "generated images" in json.loads(meta["made_from"])
    assert "no ImageNet data" in json.loads(meta["made_from"])
    assert json.loads(meta["model"]) == "eva02_tiny_patch14_224"
    assert json.loads(meta["model_kwargs"]) == {"depth": 4}
    recipe = json.loads(tiny_checkpoint.with_suffix(".json").read_text())
    assert recipe["made_from"] == json.loads(meta["made_from"])


# ---- determinism, the command line, progress ------------------------------------------------------


def test_cohort_record_is_byte_identical_for_the_same_seed(tmp_path):
    make_cohort(tmp_path / "a", 12, seed=3, broken=2)
    make_cohort(tmp_path / "b", 12, seed=3, broken=2)
    make_cohort(tmp_path / "c", 12, seed=4, broken=2)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert len(files) >= 14
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    assert (tmp_path / "a" / "cohort.json").read_bytes() != (tmp_path / "c" / "cohort.json").read_bytes()


def test_safetensors_bytes_sorts_the_metadata_and_round_trips():
    from safetensors.torch import load

    from evaluator.synthetic.cohort import safetensors_bytes

    tensors = {"b.weight": torch.randn(3, 5), "a.bias": torch.arange(7, dtype=torch.int64), "c": torch.ones(1)}
    meta = {k: f"value {i} é" for i, k in enumerate("zyxwvutsrqponm")}
    blob = safetensors_bytes(tensors, meta)
    n = int.from_bytes(blob[:8], "little")
    assert n % 8 == 0
    header = json.loads(blob[8:8 + n])
    assert list(header["__metadata__"]) == sorted(meta)
    back = load(blob)
    assert set(back) == set(tensors) and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert safetensors_bytes(tensors, dict(reversed(list(meta.items())))) == blob   # insertion order is irrelevant


def test_safetensors_bytes_reads_back_with_safe_open(tmp_path):
    from safetensors import safe_open

    from evaluator.synthetic.cohort import safetensors_bytes

    p = tmp_path / "m.safetensors"
    p.write_bytes(safetensors_bytes({"w": torch.zeros(2, 2)}, {"made_from": '"generated"', "seed": "0"}))
    with safe_open(str(p), "pt") as f:
        assert f.metadata() == {"made_from": '"generated"', "seed": "0"}
        assert torch.equal(f.get_tensor("w"), torch.zeros(2, 2))


@pytest.mark.abi   # slow: fits the tiny checkpoint twice, each in its own process
def test_tiny_checkpoint_is_byte_identical_for_the_same_seed(tmp_path):
    """Two processes (safetensors' hash-map order differs between processes), a small recipe."""
    import subprocess
    import sys

    from conftest import REPO

    code = ("import sys; from pathlib import Path; from evaluator.synthetic.cohort import make_tiny_checkpoint; "
            "make_tiny_checkpoint(Path(sys.argv[1]), seed=int(sys.argv[2]), classes=6, renders=2, steps=5)")
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path / f"{name}.safetensors"), str(seed)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
    a, b, c = ((tmp_path / f"{n}.safetensors").read_bytes() for n in "abc")
    assert a == b
    assert a != c
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def _cohort_cli(*args: str, env: dict | None = None):
    import os
    import subprocess
    import sys

    from conftest import REPO

    return subprocess.run([sys.executable, "-m", "evaluator.cohort", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})


@pytest.mark.abi
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "file").write_text("x")
    for args, words in [(["--out", str(tmp_path / "o"), "--count", "0"], "argument --count: must be a whole number in 1.."),
                        (["--out", str(tmp_path / "o"), "--count", "5", "--broken", "5"], "--broken must be in 0..4"),
                        (["--out", str(tmp_path / "file" / "sub"), "--count", "3"], "file")]:
        r = _cohort_cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("python -m evaluator.cohort: error: ") and words in last, last
    assert not (tmp_path / "o").exists()


@pytest.mark.abi
def test_cli_reports_progress_on_stderr_only(tmp_path):
    r = _cohort_cli("--out", str(tmp_path / "o"), "--count", "4", "--broken", "1", env={"ENGINE_PROGRESS": "lines"})
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""
    assert re.search(r"cohort: rendering: 4/4 images, in \d+ s, [\d.]+ images/s", r.stderr), r.stderr
    r = _cohort_cli("--out", str(tmp_path / "p"), "--count", "4", env={"ENGINE_PROGRESS": "off"})
    assert r.returncode == 0 and "rendering" not in r.stderr
    r = _cohort_cli("--out", str(tmp_path / "q"), "--count", "4", env={"ENGINE_PROGRESS": "sometimes"})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("python -m evaluator.cohort: error: "
                                                                              "ENGINE_PROGRESS must be one of")


def test_retrieval_corpus_and_tiny_clip_are_byte_identical_for_the_same_seed(tmp_path):
    from evaluator.synthetic.cir_corpus import make_corpus, write_tiny_clip

    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        make_corpus(tmp_path / name / "corpus", templates=3, per_template=2, seed=seed, requests=4)
        write_tiny_clip(tmp_path / name / "clip", seed=seed)

    def files(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    a, b, c = (files(tmp_path / n) for n in "abc")
    assert len(a) >= 10 and a == b
    assert a["clip/hf/model.safetensors"] != c["clip/hf/model.safetensors"]
    assert a["corpus/requests.jsonl"] != c["corpus/requests.jsonl"]

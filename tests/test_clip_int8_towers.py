"""INT8 CLIP towers (engine.clip.int8): torchao dynamic-INT8 candidates measured at index build under
CLIP_TOWERS=auto, under the towers' criterion (cosine and top-50 against FP32 eager on the gallery's
sample), recorded in meta.json's candidate table; refused when they disagree; rebuilt (never
compiled) by the query run; off with CLIP_TOWERS_INT8=0, one line where an index chose one."""
from __future__ import annotations

import sys

import pytest
import torch
from cir_helpers import build_args, clip_dirs

from engine import settings
from engine.clip import compiled as C
from engine.clip import int8, tune
from engine.clip.load import load_clip
from engine.clip.towers import ClipTowers

pytest.importorskip("torchao.quantization")

# eager only: FP32 beside int8, one static batch (no compile)
INT8 = tune.Preset(backends=("eager",), batches=(16,), precisions=("fp32", "int8"), sample=64, queries=16, rounds=1)


@pytest.fixture
def env(monkeypatch):
    settings.reload()
    yield monkeypatch
    settings.reload()


def _base():
    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    return ClipTowers(model, spec, "cpu", "fp32")


def _sample(base, n=48):
    """Gallery-like pixels: the corpus's renders are what a build samples; random ones suffice for rows."""
    g = torch.Generator().manual_seed(0)
    side = base.spec.image.input_size
    return torch.randint(0, 256, (n, side, side, 3), generator=g, dtype=torch.uint8)


def _plant_broken_int8(monkeypatch, tower_kind="image"):
    """int8.quantize for the `tower_kind` graph: the real recipe, then its first int8 Linear's output
    negated (a broken quantization the criterion must catch)."""
    real = int8.quantize

    def broken(graph, device="cpu"):
        graph = real(graph, device)
        if isinstance(graph, C.ImageGraph) == (tower_kind == "image"):
            first = next(m for m in graph.modules() if isinstance(m, torch.nn.Linear)
                         and getattr(getattr(m.weight, "qdata", None), "dtype", None) == torch.int8)
            first.register_forward_hook(lambda mod, inp, out: -out)
        return graph
    monkeypatch.setattr(int8, "quantize", broken)


def _row_holds(row) -> bool:
    return row["cos_min"] >= tune.COS_MIN and row["top50_equal"] is True


def test_index_build_records_int8_rows_and_refuses_a_broken_one(tmp_path, env, capsys):
    """CLIP_TOWERS=auto on the CPU: each tower's table holds its int8 row, measured against FP32 eager
    (status ok exactly when cosine and top-50 hold); a planted broken int8 image tower is refused and
    not chosen; the choice is a row that held."""
    from engine.retrieval.index import load_index
    from evaluator.cir import build as cir_build

    _plant_broken_int8(env, "image")
    env.setenv("CLIP_TOWERS", "auto")
    env.setitem(tune.PRESETS, "cpu", INT8)
    settings.reload()
    assert cir_build.main(build_args(tmp_path / "idx", "--model-dir", str(clip_dirs()["open_clip"]),
                                     "--device", "cpu")) == 0
    rec = load_index(tmp_path / "idx").meta["towers"]
    for tower in ("image", "text"):
        rows = {r["candidate"]: r for r in rec[tower]["table"]}
        row = rows[f"{tower}-eager-int8-b16"]
        assert row["precision"] == "int8" and row["per_s"] > 0 and 0 < row["cos_min"] <= 1.000001
        assert (row["status"] == "ok") == _row_holds(row), row
        ch = rec[tower]["choice"]
        chosen = rows[f"{tower}-{ch['backend']}-{ch['precision']}-b{ch['batch']}"]
        assert chosen["status"] == "ok"
    broken = {r["candidate"]: r for r in rec["image"]["table"]}["image-eager-int8-b16"]
    assert broken["status"].startswith("refused: cosine min") and broken["cos_min"] < tune.COS_MIN
    assert rec["image"]["choice"]["precision"] != "int8"


def test_tune_without_torchao_records_why_and_the_switch_measures_no_int8(tmp_path, env):
    base = _base()
    x = _sample(base)
    env.setitem(sys.modules, "torchao.quantization", None)            # torchao not importable
    _, rec = tune.tune(base, x, tmp_path / "towers-a", print, INT8)
    (row,) = [r for r in rec["image"]["table"] if r["precision"] == "int8"]
    assert row["status"].startswith("failed: RuntimeError: int8 towers unavailable: torchao is not importable")
    assert rec["image"]["choice"]["precision"] == "fp32"
    env.setenv("CLIP_TOWERS_INT8", "0")
    settings.reload()
    _, rec = tune.tune(base, x, tmp_path / "towers-b", print, INT8)
    assert [r["precision"] for r in rec["image"]["table"]] == ["fp32"]
    assert [r["precision"] for r in rec["text"]["table"]] == ["fp32"]


def _int8_record(base):
    choice = {"backend": "eager", "precision": "int8", "batch": 16, "fallback": False}
    return {"mode": "auto", "device": "cpu", "text_len": C.text_len_for(base.spec), "dir": "towers-none",
            "image": {"table": [], "choice": choice}, "text": {"table": [], "choice": choice}}


def test_a_recorded_int8_tower_is_rebuilt_at_query_time_and_off_in_one_line(tmp_path, env, monkeypatch):
    """load_recorded rebuilds an int8 choice from the FP32 weights (torchao int8 Linears, rows close to
    FP32); with CLIP_TOWERS_INT8=0 the eager towers answer, said in one line."""
    base = _base()
    towers = tune.load_recorded(base, tmp_path, _int8_record(base), print)
    assert isinstance(towers, C.CompiledTowers)
    assert int8.int8_linears(towers.image_fn.fn) > 0 and int8.int8_linears(towers.text_fn.fn) > 0
    x = _sample(base, 20)
    got, want = towers.encode_images(x), base.encode_images(x)
    assert got.shape == want.shape and float((got * want).sum(1).min()) > 0.99
    said: list[str] = []
    env.setenv("CLIP_TOWERS_INT8", "0")
    settings.reload()
    assert tune.load_recorded(base, tmp_path, _int8_record(base), said.append) is base
    assert len(said) == 1 and "CLIP_TOWERS_INT8=0" in said[0] and said[0].endswith("eager towers")

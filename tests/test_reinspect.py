"""Re-inspection: the per-request limit (one counter, never exceeded, larger requests clamped
with a stderr line), the views, a constructed case whose order the re-scoring changes, and
the run end to end with its report counts and the --corpus override."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cir_helpers import built_index, check_abi, corpus, read_rows, requests_of, run_args
from PIL import Image

from engine.retrieval.compose import make_method
from engine.retrieval.reinspect import (
    ReinspectBudget,
    ReinspectLimitError,
    Reinspector,
    candidate_views,
)
from evaluator.cir import run as cir_run
from evaluator.cir import task
from evaluator.cir.index import load_index
from evaluator.cir.jsonl import Request
from evaluator.cir.query import QueryPipeline
from evaluator.cir.task import MAX_REINSPECT as MAX_PER_REQUEST


def _jpeg(colours, w=96, h=64) -> bytes:
    """An image split into vertical bands of the given RGB colours."""
    im = Image.new("RGB", (w, h))
    for i, c in enumerate(colours):
        im.paste(c, (i * w // len(colours), 0, (i + 1) * w // len(colours), h))
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def test_the_budget_is_enforced_in_one_place():
    with pytest.raises(ValueError):
        ReinspectBudget(MAX_PER_REQUEST + 1, MAX_PER_REQUEST)
    b = ReinspectBudget(MAX_PER_REQUEST, MAX_PER_REQUEST)
    b.take("q1", 60)
    b.take("q1", 40)
    with pytest.raises(ReinspectLimitError, match="limit of 100"):
        b.take("q1", 1)
    b.take("q2", 7)
    assert (b.max_used, b.total, b.used) == (100, 107, {"q1": 100, "q2": 7})
    reads = []
    r = Reinspector(lambda row: reads.append(row) or _jpeg([(255, 0, 0)]), lambda px: torch.zeros(len(px), 4),
                    8, 1, ReinspectBudget(3))
    with pytest.raises(ReinspectLimitError):
        r.embed("q", [0, 1, 2, 3], torch.zeros(4, 4))
    assert reads == []                                             # refused before any image is read
    with pytest.raises(ValueError):
        task.check_method(make_method("slerp").__class__(reinspect=101))   # a Method past the limit is refused


def test_views_cover_what_the_centre_crop_cut():
    v = candidate_views(_jpeg([(255, 0, 0), (0, 255, 0), (0, 0, 255)], w=192), 16, 5)
    assert v.shape == (5, 16, 16, 3) and v.dtype == np.uint8
    mean = v.reshape(5, -1, 3).mean(1)
    assert mean[1, 0] > 150 and mean[2, 2] > 150                   # start = the red side, end = the blue side
    assert all(mean[0, c] > 50 for c in range(3))                  # squash sees all three bands
    assert mean[4, 1] > 150 and mean[3, 1] > 150                   # mirrored centre and the zoom: green


class _Index:
    def __init__(self, emb, ids, meta, d):
        self.emb, self.ids, self.meta, self.dir = emb, ids, meta, d

    def rows(self):
        return {str(i): r for r, i in enumerate(self.ids)}

    def extra(self, name):
        return None


class _Towers:
    """Text: always e0. Images: the one-hot of the dominant colour channel (red e0, green e2, blue e1)."""
    device, precision, trim_text = torch.device("cpu"), "fp32", True
    spec = SimpleNamespace(embed_dim=4, context_length=77, image=SimpleNamespace(input_size=16,
                                                                                 interpolation="bicubic"))

    def tokenize(self, texts):
        return torch.zeros(len(texts), 77, dtype=torch.long), [False] * len(texts)

    def encode_tokens(self, tokens):
        return F.one_hot(torch.zeros(len(tokens), dtype=torch.long), 4).float()

    def encode_images(self, px):
        dominant = torch.as_tensor(px).float().mean((1, 2)).argmax(1)           # 0 red, 1 green, 2 blue
        return F.one_hot(torch.tensor([0, 2, 1])[dominant], 4).float()


def test_reinspection_changes_the_order_on_a_constructed_case(tmp_path):
    # stored rows: A (cos 0.9 with the query) before B (0.8) before C (0); A's image is blue, B's red
    (tmp_path / "A.png").write_bytes(_jpeg([(0, 0, 255)]))
    (tmp_path / "B.png").write_bytes(_jpeg([(255, 0, 0)]))
    (tmp_path / "C.png").write_bytes(_jpeg([(0, 255, 0)]))
    (tmp_path / "records.jsonl").write_text("".join(json.dumps({"image_id": i, "path": f"{i}.png"}) + "\n"
                                                    for i in "ABC"))
    e = torch.eye(4)
    emb = torch.stack([F.normalize(0.9 * e[0] + 0.436 * e[3], dim=0), F.normalize(0.8 * e[0] + 0.6 * e[3], dim=0),
                       e[2]]).numpy().astype(np.float16)
    index = _Index(emb, ["A", "B", "C"], {"corpus": str(tmp_path), "unreadable": []}, tmp_path)
    reqs = [Request(1, "q1", None, "x", None), Request(2, "q2", None, "y", None)]
    answers = {}
    for name in ("text-only", "text-only+reinspect:n=2:crops=1"):
        pipe = QueryPipeline(index, _Towers(), make_method(name), print, Path("q.jsonl"), None, k=3)
        pipe.prepare(reqs)
        answers[name] = pipe.answer(reqs)
        rep = pipe.report()
    plain, re = answers["text-only"][0], answers["text-only+reinspect:n=2:crops=1"][0]
    assert [j for j, _ in plain] == [0, 1, 2]
    assert [j for j, _ in re] == [1, 0, 2]                          # B's views agree with the query, A's do not
    assert re[0][1] == pytest.approx(1.8 / np.sqrt(3.6), abs=2e-3) and re[2] == plain[2]   # C was not inspected
    assert rep["reinspected_per_request_max"] == 2 and rep["reinspected_total"] == 4


def test_run_never_exceeds_the_limit_and_reports_it(tmp_path, capsys):
    reqs = requests_of(corpus() / "requests.jsonl")
    out, rep = tmp_path / "re.jsonl", tmp_path / "re.json"
    assert cir_run.main(run_args(corpus() / "requests.jsonl", out, "--method", "slerp+reinspect:n=500",
                                 "--report", str(rep))) == 0
    assert "clamped to 100" in capsys.readouterr().err
    report = json.loads(rep.read_text())
    assert report["reinspected_per_request_max"] == 100 and report["reinspected_total"] == 100 * len(reqs)
    assert report["reinspect_limit"] == 100 and report["method"]["reinspect"] == 100
    rows = read_rows(out)
    check_abi(rows, reqs, load_index(built_index()).ids)
    plain = tmp_path / "plain.jsonl"
    assert cir_run.main(run_args(corpus() / "requests.jsonl", plain)) == 0
    assert any([h["image_id"] for h in a["results"]] != [h["image_id"] for h in b["results"]]
               for a, b in zip(rows, read_rows(plain)))            # re-scoring moved candidates


def test_corpus_override_and_a_missing_corpus(tmp_path, capsys):
    moved = tmp_path / "moved"
    shutil.copytree(corpus(), moved)
    out, rep = tmp_path / "a.jsonl", tmp_path / "a.json"
    args = run_args(corpus() / "requests.jsonl", out, "--method", "slerp+reinspect:n=10:crops=2",
                    "--report", str(rep))
    assert cir_run.main(args) == 0
    o = args.index("--output") + 1
    assert cir_run.main([*args[:o], str(tmp_path / "b.jsonl"), *args[o + 1:], "--corpus", str(moved)]) == 0
    assert read_rows(out) == read_rows(tmp_path / "b.jsonl")       # the same images, read from elsewhere
    assert str(moved) in json.loads(rep.read_text())["reinspection"]
    capsys.readouterr()
    assert cir_run.main([*args[:o], str(tmp_path / "c.jsonl"), *args[o + 1:], "--corpus", str(tmp_path / "none")]) == 0
    assert "re-inspection off" in capsys.readouterr().err          # answered without it, and said
    assert json.loads(rep.read_text())["reinspected_total"] == 0

"""Re-inspection: the per-request limit (one counter, never exceeded, larger requests clamped
with a stderr line), the views, the centre view through the gallery's decoder agreeing with the
stored row, a constructed case whose order the re-scoring changes, the rule that mixes
re-inspected and stored scores, and the run end to end with its report counts and --corpus."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cir_fakes import FakeIndex, OneHotTowers
from cir_helpers import built_index, check_abi, clip_dirs, corpus, read_rows, requests_of, run_args
from PIL import Image

from engine.retrieval.compose import Method, make_method
from engine.retrieval.index import load_index
from engine.retrieval.jsonl import Request
from engine.retrieval.options import OPTIONS
from engine.retrieval.query import QueryPipeline
from engine.retrieval.reinspect import (
    VIEWS,
    ReinspectBudget,
    ReinspectLimitError,
    Reinspector,
    ViewDecoding,
    view_groups,
    view_spec,
)
from evaluator.cir import run as cir_run
from evaluator.cir import task
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
                    OneHotTowers.spec.image, 1, ReinspectBudget(3))
    with pytest.raises(ReinspectLimitError):
        r.embed("q", [0, 1, 2, 3], torch.zeros(4, 4))
    with pytest.raises(ReinspectLimitError):                       # one request past the limit stops the batch
        r.embed_many([("a", [0]), ("b", [0, 1, 2, 3])], [torch.zeros(1, 4), torch.zeros(4, 4)])
    assert reads == []                                             # refused before any image is read
    with pytest.raises(ValueError):
        task.check_method(Method(options=(OPTIONS["reinspect"](n=101),)))   # a Method past the limit is refused


def _view(blob: bytes, view: str, size: int = 16) -> np.ndarray:
    """[S, S, 3] uint8: one view as the Reinspector makes it (the pil decoder, mirrored when asked)."""
    from engine.core.spec import Spec
    from engine.decoders import make_decoder

    spec = view_spec(Spec(model="fake", input_size=size), view)
    px = make_decoder("pil", spec, 1, isolate=False).decode([blob])[0][0]
    return px[:, ::-1] if view == "mirror" or view.endswith("-mirror") else px


def test_views_are_spec_variants_of_the_gallery_view():
    blob = _jpeg([(255, 0, 0), (0, 255, 0), (0, 0, 255)], w=192)   # red | green | blue bands
    mean = {v: _view(blob, v).reshape(-1, 3).mean(0) for v in ("centre", *VIEWS)}
    assert mean["centre"][1] > 200 and mean["mirror"][1] > 200      # the centre crop sees the green band
    assert all(mean["squash"][c] > 50 for c in range(3))            # squash sees all three bands
    assert mean["zoom80"][1] > 200
    asym = _jpeg([(255, 0, 0), (0, 0, 255)], w=64, h=64)            # red left half, blue right half
    assert (_view(asym, "mirror")[:, :4, 2] > 200).all() and (_view(asym, "centre")[:, :4, 0] > 200).all()
    # one decode per geometry: crops 1, 3 and 5 decode each image 1, 2 and 3 times
    assert [len(view_groups(VIEWS[:n])) for n in (1, 3, 5)] == [1, 3, 3]
    assert view_groups(VIEWS) == {"centre": [True], "squash": [False, True], "zoom80": [False, True]}


def test_the_centre_view_through_the_gallery_decoder_agrees_with_the_stored_row():
    """One image embedded by the index build and by re-inspection (the same decoder, the centre
    view): cosine > 0.999; another view of it is measurably different (the check can fail)."""
    from engine.clip.load import load_clip
    from engine.clip.towers import ClipTowers
    from engine.retrieval.jsonl import read_records

    index = load_index(built_index())
    assert index.meta["decoder"] in ("dali-cpu", "pil")             # dali-cpu where DALI is installed
    model, spec, _ = load_clip(clip_dirs()["open_clip"])
    towers = ClipTowers(model, spec, "cpu", "fp32")
    paths = {str(r.image_id): corpus() / r.path for r in read_records(corpus() / "records.jsonl", print)}
    rows = list(range(0, len(index.ids), 40))                      # 8 images
    stored = torch.from_numpy(np.asarray(index.emb)[rows].astype(np.float32))

    def reinspector(view):
        return Reinspector(lambda r: paths[str(index.ids[r])].read_bytes(), towers.encode_images, spec.image, 1,
                           ReinspectBudget(len(rows)), ViewDecoding(index.meta["decoder"], batch_size=4), views=(view,))

    r = reinspector("centre")
    centre = r.view_sums(rows)
    cos = [float(F.cosine_similarity(centre[row], stored[i], dim=0)) for i, row in enumerate(rows)]
    assert min(cos) > 0.999, cos
    assert r.decoded == len(rows)
    zoom = reinspector("zoom80").view_sums(rows)
    assert min(float(F.cosine_similarity(zoom[row], stored[i], dim=0)) for i, row in enumerate(rows)) < 0.999


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
    index = FakeIndex(emb, ["A", "B", "C"], {"corpus": str(tmp_path), "unreadable": []}, tmp_path)
    reqs = [Request(1, "q1", None, "x", None), Request(2, "q2", None, "y", None)]
    answers = {}
    for name in ("text-only", "text-only+reinspect:n=2:crops=1"):
        pipe = QueryPipeline(index, OneHotTowers(), make_method(name), print, Path("q.jsonl"), k=3)
        pipe.prepare(reqs)
        answers[name] = pipe.answer(reqs)
        rep = pipe.report()
    plain, re = answers["text-only"][0], answers["text-only+reinspect:n=2:crops=1"][0]
    assert [j for j, _ in plain] == [0, 1, 2]
    assert [j for j, _ in re] == [1, 0, 2]                          # B's views agree with the query, A's do not
    assert re[0][1] == pytest.approx(1.8 / np.sqrt(3.6), abs=2e-3) and re[2] == plain[2]   # C was not inspected
    assert rep["reinspected_per_request_max"] == 2 and rep["reinspected_total"] == 4
    assert rep["reinspect_decoded"] == 2                            # both requests' views decoded together, once

    # n = 1 < k: A alone is re-inspected and keeps rank 1 (new score 0.9 / sqrt(2)); B and C keep their
    # order below it, lowered by one offset so that B (stored 0.8) does not pass A
    pipe = QueryPipeline(index, OneHotTowers(), make_method("text-only+reinspect:n=1:crops=1"), print,
                         Path("q.jsonl"), k=3)
    pipe.prepare(reqs)
    block = pipe.answer(reqs)[0]
    a = 0.9 / np.sqrt(0.9 ** 2 + 0.436 ** 2 + 1)
    assert [j for j, _ in block] == [0, 1, 2]
    assert [s for _, s in block] == pytest.approx([a, a, a - 0.8], abs=2e-3)


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

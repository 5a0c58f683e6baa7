"""Composition methods: slerp against the scalar formula, endpoints, fallbacks, prompts, presets;
the published defaults; every name labelled with its source; the gap shift closing a planted gap;
scale-free alpha-QE changing a ranking that raw alpha-QE leaves alone."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cir_fakes import FakeIndex, OneHotTowers

from engine.retrieval import compose as compose_mod
from engine.retrieval.compose import METHODS, Method, compose, make_method, prompt_text, slerp, text_weight
from engine.retrieval.gap import gap_vector, shift
from engine.retrieval.rescore import alpha_qe


def _unit(n, d=16, seed=0):
    return F.normalize(torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64), dim=-1)


def test_slerp_matches_scalar_formula():
    a, b = _unit(6, seed=1), _unit(6, seed=2)
    t = torch.tensor([0.0, 0.1, 0.5, 0.8, 0.9, 1.0], dtype=torch.float64)
    got = slerp(a, b, t)
    for i in range(6):
        th = math.acos(float(a[i] @ b[i]))
        want = (math.sin((1 - t[i]) * th) * a[i] + math.sin(t[i] * th) * b[i]) / math.sin(th)
        torch.testing.assert_close(got[i], want / want.norm())
        # the result sits at fraction t of the arc from a to b
        assert math.isclose(math.acos(min(1.0, float(got[i] @ a[i]))), float(t[i]) * th, abs_tol=1e-6)
    torch.testing.assert_close(got[0], a[0])
    torch.testing.assert_close(got[-1], b[-1])


def test_slerp_degenerate_angles_fall_back_to_lerp():
    a = _unit(2)
    out = slerp(a, torch.stack([a[0], -a[1]]), torch.tensor([0.3, 0.3], dtype=torch.float64))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0], a[0])                     # identical rows: stays put
    torch.testing.assert_close(out[1], a[1])                     # antipodal: normalised lerp, finite


def test_compose_methods_and_missing_reference():
    img, txt = _unit(4, seed=3), _unit(4, seed=4)
    w = torch.full((4,), 0.5, dtype=torch.float64)
    has = torch.tensor([True, True, False, True])
    for name in METHODS:
        q = compose(make_method(name), img, has, txt, w)
        torch.testing.assert_close(q.norm(dim=-1), torch.ones(4, dtype=torch.float64))
        torch.testing.assert_close(q[2], txt[2])                 # no reference image: the text alone
    torch.testing.assert_close(compose(make_method("text-only"), img, has, txt, w), txt)
    s = compose(make_method("sum"), img, has, txt, w)
    torch.testing.assert_close(s[0], F.normalize(img[0] + txt[0], dim=-1))


def test_the_default_is_the_published_slerp_setting():
    """Slerp without training (Jang et al., ECCV 2024): text weight 0.8 with a shared concept, 0.9
    without, the bare caption, no add-ons; the dataclass, make_method and both CLIs agree."""
    from evaluator.cir import build as cir_build
    from evaluator.cir import run as cir_run

    m = make_method()
    assert (m.name, m.weight_concept, m.weight_plain, m.prompt, m.label) == ("slerp", 0.8, 0.9, "plain", "slerp")
    assert m == Method() == make_method("slerp", prompt="auto")
    assert prompt_text(m, "make it red", "a dog") == "make it red"   # the caption alone, concept or not
    assert prompt_text(m, "make it red", None) == "make it red"
    assert m.options == () and m.steps == ()                        # no add-ons
    assert cir_build.parse_args(["--corpus", "c", "--index-dir", "i"]).method == "slerp"
    assert cir_run.parse_args(["--index-dir", "i", "--queries", "q", "--output", "o"]).method is None  # index's
    # Pic2Word's own prompt; SEARLE's under its own name
    assert prompt_text(make_method("pic2word"), "is red", "a dog") == "a photo of * , is red"
    assert prompt_text(make_method("pic2word", prompt="searle"), "is red", None) == "a photo of * that is red"


def test_every_prompt_method_and_option_names_its_source():
    assert set(compose_mod.PROMPT_SOURCES) == set(compose_mod.PROMPTS)
    assert set(compose_mod.METHOD_SOURCES) == set(METHODS)
    from engine.retrieval.options import OPTIONS

    for label in (*compose_mod.PROMPT_SOURCES.values(), *compose_mod.METHOD_SOURCES.values(),
                  *(cls.source for cls in OPTIONS.values())):
        assert "published" in label or "this kit's variant" in label, label
    assert "this kit's variant" in compose_mod.PROMPT_SOURCES["pic2word-concept"]
    assert "this kit's variant" in OPTIONS["gap-centre"].source
    assert all(f"{n}: {cls.source}" in compose_mod.method_help() for n, cls in OPTIONS.items())
    with pytest.raises(ValueError, match="pseudo-word"):
        make_method("slerp", prompt="pic2word")                  # * means nothing without the mapping


def test_presets_weights_and_prompts():
    m = make_method()
    assert text_weight(m, "a dog") == 0.8 and text_weight(m, None) == 0.9
    assert make_method("sum").weight_plain == 0.5
    assert make_method("slerp", text_weight=0.7).weight_concept == 0.7
    magic = make_method(prompt="magiclens")
    assert prompt_text(magic, "make it red", "a dog") == "find a dog but make it red"   # MagicLens template
    assert prompt_text(magic, "make it red", None) == "make it red"
    custom = make_method(prompt="{shared_concept}, {modification}")
    assert prompt_text(custom, "red", "a dog") == "a dog, red"
    assert prompt_text(custom, "red", None) == "red"            # the template needs a concept it lacks
    assert Method.from_dict(m.to_dict()) == m


@pytest.mark.parametrize("bad", [dict(name="mean"), dict(weight_plain=1.5), dict(prompt="no placeholder")])
def test_invalid_methods_are_refused(bad):
    with pytest.raises(ValueError):
        Method(**bad)


def test_gap_shift_closes_a_planted_gap():
    """Two cones: the same content rows offset along e0 (images) and e1 (texts). The means come from
    held-out rows (as the gallery mean and the fixed captions do); the shift moves both cones onto
    each other: the distance between the means shrinks tenfold and paired rows match again."""
    g = torch.Generator().manual_seed(0)
    d, n = 32, 200
    content, held = (F.normalize(torch.randn(n, d, generator=g), dim=-1) for _ in range(2))
    off_i, off_t = 1.5 * torch.eye(d)[0], 1.5 * torch.eye(d)[1] + 1.0 * torch.eye(d)[2]
    img, txt = F.normalize(content + off_i, dim=-1), F.normalize(content + off_t, dim=-1)
    delta = gap_vector(F.normalize(held + off_i, dim=-1).mean(0), F.normalize(held + off_t, dim=-1).mean(0))
    img2, txt2 = shift(img, delta, toward_text=True), shift(txt, delta, toward_text=False)
    before, after = (img.mean(0) - txt.mean(0)).norm(), (img2.mean(0) - txt2.mean(0)).norm()
    assert after < 0.1 * before, (float(before), float(after))
    torch.testing.assert_close(img2.norm(dim=-1), torch.ones(n))
    match = lambda a, b: float(((b @ a.T).argmax(1) == torch.arange(n)).float().mean())  # noqa: E731
    assert match(img2, txt2) > 0.95 and match(img2, txt2) > match(img, txt), (match(img, txt), match(img2, txt2))
    torch.testing.assert_close(shift(img, delta, True, lam=0.0), img)   # lam = 0: nothing moves
    # the centring variant and the shift are distinct names; one gap correction at a time
    assert make_method("slerp+gap").to_dict()["gap_mode"] == "shift" and make_method("slerp+gap").option("gap").text \
        == "captions"
    assert make_method("slerp+gap-centre").to_dict()["gap_mode"] == "centre" and make_method("slerp+gap-centre").uses_bank
    assert make_method("slerp+gap:shift=0.5").label == "slerp+gap:shift=0.5"
    for bad in ("slerp+gap+gap-centre", "slerp+gap:text=requests", "slerp+gap:shift=3"):
        with pytest.raises(ValueError):
            make_method(bad)


def _aqe_case(tmp_path):
    """q = e0 (the text). p1 at cosine 0.45, a distractor d at 0.44, p2 at 0.35 but next to p1:
    cross-modal cosines, where raw alpha-QE weights (0.45^3 = 0.09) are too small to matter."""
    e = torch.eye(4)
    p1 = F.normalize(0.45 * e[0] + 0.893 * e[1], dim=0)
    d = F.normalize(0.44 * e[0] + 0.898 * e[3], dim=0)
    p2 = F.normalize(0.35 * e[0] + 0.937 * e[1] + 0.05 * e[2], dim=0)
    emb = torch.stack([p1, d, p2]).numpy().astype(np.float16)
    return e[0], torch.from_numpy(emb).float(), FakeIndex(emb, ["p1", "d", "p2"], {"unreadable": []}, tmp_path)


def test_scale_free_alpha_qe_changes_a_cross_modal_ranking(tmp_path):
    from engine.retrieval.jsonl import Request
    from engine.retrieval.query import QueryPipeline

    q, gallery, index = _aqe_case(tmp_path)
    order = lambda s: torch.argsort(s, descending=True, stable=True).tolist()  # noqa: E731
    assert order(gallery @ q) == [0, 1, 2]                           # p1, d, p2
    raw = alpha_qe(q[None], gallery[:1][None], (gallery[:1] @ q)[None], alpha=3.0)[0]
    assert order(gallery @ raw) == [0, 1, 2]                         # raw weights: a no-op here
    reqs = [Request(1, "q1", None, "x", None)]
    got = {}
    for name in ("text-only", "text-only+aqe:n=1"):
        pipe = QueryPipeline(index, OneHotTowers(), make_method(name), print, Path("q.jsonl"), k=3)
        pipe.prepare(reqs)
        got[name] = [j for j, _ in pipe.answer(reqs)[0]]
    assert got["text-only"] == [0, 1, 2] and got["text-only+aqe:n=1"] == [0, 2, 1]   # p2 passes d

"""Gallery-aware scoring, each tested for its mechanism on constructed embeddings: a planted hub,
a planted modality offset, a second positive next to the first; streamed twins vs references;
method names."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from engine.retrieval.compose import Method, make_method
from engine.retrieval.rescore import (
    ScorerParams,
    alpha_qe,
    bank_stats,
    bank_stats_reference,
    center,
    dba,
    row_state,
    score_cos,
)
from evaluator.cir import task

SCORERS = ("isoftmax", "qbnorm", "dual-softmax", "csls")


def _unit(*shape, seed=0):
    return F.normalize(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), dim=-1)


def _hub_case(m=40, n=60, d=64):
    """Gallery row 0 is a hub: every query is 0.7 hub + 0.5 its own target (rows 1..m)."""
    g = torch.Generator().manual_seed(0)
    gallery = _unit(n, d, seed=1)
    hub = _unit(d, seed=2)
    gallery[0] = hub
    targets = torch.arange(1, m + 1)
    q = F.normalize(0.7 * hub + 0.5 * gallery[targets] + 0.05 * torch.randn(m, d, generator=g), dim=-1)
    return q, gallery, targets


@pytest.mark.parametrize("scorer", SCORERS)
def test_planted_hub_is_demoted(scorer):
    q, gallery, targets = _hub_case()
    cos = q @ gallery.T
    assert (cos.argmax(1) == 0).all()                              # raw: the hub wins every query
    stats = bank_stats(scorer, q, gallery)                         # the bank: the call's own queries
    s = score_cos(scorer, cos, stats, row_state(scorer, cos, stats))
    top = s.argmax(1)
    assert (top != 0).float().mean() >= 0.9, scorer                # the hub lost its first place ...
    assert (top == targets).float().mean() >= 0.9, scorer          # ... to each query's own target
    assert torch.isfinite(s).all()


def test_qbnorm_only_normalises_rows_whose_top1_is_activated():
    q, gallery, targets = _hub_case()
    cos = q @ gallery.T
    # a bank whose queries all land on row 5: only row 5 is in the activation set, not the hub
    bank = F.normalize(gallery[5].expand(8, -1) + 0.01 * _unit(8, gallery.shape[1], seed=3), dim=-1)
    stats = bank_stats("qbnorm", bank, gallery)
    assert stats.active.nonzero().flatten().tolist() == [5]
    state = row_state("qbnorm", cos, stats)
    assert not state.normalised.any()                              # every query's top-1 is the hub
    torch.testing.assert_close(score_cos("qbnorm", cos, stats, state), cos)
    # the same bank under the plain inverted softmax changes the scores of every row
    iso = bank_stats("isoftmax", bank, gallery)
    assert not torch.allclose(score_cos("isoftmax", cos, iso, row_state("isoftmax", cos, iso)), cos)


def test_qbnorm_activation_skips_each_bank_querys_reference():
    q, gallery, _ = _hub_case(m=4)
    ex = torch.zeros(4, dtype=torch.int64)                         # every bank query's reference is the hub
    stats = bank_stats("qbnorm", q, gallery, exclude=ex)
    assert not stats.active[0] and stats.active.sum() >= 1


def test_dual_softmax_with_a_bank_that_lacks_the_query_stays_finite():
    gallery = _unit(10, 16, seed=4)
    bank = _unit(5, 16, seed=5)
    q = gallery[:3].clone()                                        # cos 1 with its row: exp(100) territory
    stats = bank_stats("dual-softmax", bank, gallery, has_queries=False)
    s = score_cos("dual-softmax", q @ gallery.T, stats, row_state("dual-softmax", q @ gallery.T, stats))
    assert torch.isfinite(s).all() and (s.argmax(1) == torch.arange(3)).all()


def _reused_reference_case(m=30, n=200, d=64):
    """Request 0's reference R (row refs[0]) is request 1's target (CIRR reuses images that way);
    each query sits far closer to its own reference than to anything else, and request 1 also
    sees a distractor D below R. Returns (q, gallery, refs, R, D)."""
    g = torch.Generator().manual_seed(20)
    gallery = _unit(n, d, seed=21)
    perm = torch.randperm(n, generator=g)
    refs, targets, big_r, big_d = perm[:m].clone(), perm[m:2 * m].clone(), int(perm[0]), int(perm[-1])
    targets[1] = big_r
    noise = 0.03 * torch.randn(m, d, generator=g)
    q = 0.6 * gallery[refs] + 0.45 * gallery[targets] + noise
    q[1] += 0.44 * gallery[big_d]
    return F.normalize(q, dim=-1), gallery, refs, big_r, big_d


@pytest.mark.parametrize("scorer", SCORERS)
@pytest.mark.parametrize("chunk", (0, 7))
def test_a_bank_querys_own_reference_is_not_pushed_down_for_other_requests(scorer, chunk):
    q, gallery, refs, big_r, big_d = _reused_reference_case()
    cos = q @ gallery.T
    assert cos[0, big_r] > 0.7 and cos[1, big_r] > cos[1, big_d]   # raw: R above D for request 1

    def margin(exclude):                                # R's lead over D for request 1
        # qbnorm: counted as a bank apart from the scored rows (has_queries=False), so one bank query's
        # top-1 activates R either way and the test sees R's log-sum-exp
        stats = bank_stats(scorer, q, gallery, ScorerParams(k=2), exclude=exclude, has_queries=scorer != "qbnorm",
                           chunk=chunk)
        s = score_cos(scorer, cos, stats, row_state(scorer, cos, stats, 2, refs))
        assert torch.isfinite(s[:, big_d]).all()
        return float(s[1, big_r] - s[1, big_d])

    # without the mask request 0's own term (cos > 0.7 to R) dominates R's bank statistic and buries R
    assert margin(None) < 0, scorer
    assert margin(refs) > 0, scorer                     # masked: R keeps its place for the request aiming at it


def test_qbnorm_differs_from_isoftmax_when_the_bank_holds_the_queries():
    """A row whose top-1 no other bank query shares keeps its raw cosines (leave-one-out): with the
    call's own requests as the bank, QB-Norm is no longer the plain inverted softmax."""
    q_hub, gallery, _ = _hub_case()
    lone = F.normalize(gallery[45:55] + 0.02 * _unit(10, gallery.shape[1], seed=30), dim=-1)
    q = torch.cat([q_hub, lone])                               # 40 rows on the hub + 10 rows alone
    cos = q @ gallery.T
    qb, iso = bank_stats("qbnorm", q, gallery), bank_stats("isoftmax", q, gallery)
    state = row_state("qbnorm", cos, qb)
    assert state.normalised[:40].all() and not state.normalised[40:].any()
    s_qb = score_cos("qbnorm", cos, qb, state)
    s_iso = score_cos("isoftmax", cos, iso, row_state("isoftmax", cos, iso))
    torch.testing.assert_close(s_qb[:40], s_iso[:40])
    torch.testing.assert_close(s_qb[40:], cos[40:])
    # a bank without the scored queries (has_queries=False): one other bank query activates a row
    lone_bank = bank_stats("qbnorm", lone, gallery, has_queries=False)
    assert row_state("qbnorm", cos[40:], lone_bank).normalised.all()


def test_a_gallery_text_banks_self_matches_do_not_seed_the_activation_set():
    gallery = _unit(50, 32, seed=31)
    rows = torch.arange(10, 20)
    bank = F.normalize(gallery[rows] + 0.02 * _unit(10, 32, seed=32), dim=-1)   # each aimed at its own row
    assert bank_stats("qbnorm", bank, gallery).active[rows].all()                # unmasked: seeded with them
    masked = bank_stats("qbnorm", bank, gallery, exclude=rows, has_queries=False)
    s = bank @ gallery.T
    s[torch.arange(10), rows] = float("-inf")
    assert masked.active.nonzero().flatten().tolist() == s.argmax(1).unique().tolist()   # each one's nearest other


@pytest.mark.parametrize("scorer,chunk", itertools.product(SCORERS, (1, 7, 256)))
def test_streamed_bank_stats_match_the_reference(scorer, chunk):
    bank, gallery = _unit(23, 32, seed=6), _unit(41, 32, seed=7)
    ex = torch.randint(-1, 41, (23,), generator=torch.Generator().manual_seed(8))
    got = bank_stats(scorer, bank, gallery, ScorerParams(k=5), exclude=ex, chunk=chunk)
    want = bank_stats_reference(scorer, bank, gallery, ScorerParams(k=5), exclude=ex)
    for name in ("lse", "knn"):
        if getattr(want, name) is not None:
            torch.testing.assert_close(getattr(got, name), getattr(want, name))
    if want.active is not None:
        assert torch.equal(got.active, want.active) and torch.equal(got.hits, want.hits)
    assert bank_stats(scorer, bank, gallery, ScorerParams(k=5), exclude=ex, chunk=0).size == 23   # chunk 0: the twin


def test_streamed_dba_matches_the_reference():
    gallery = _unit(37, 16, seed=9)
    for n, chunk in itertools.product((1, 3), (1, 5, 1024)):
        torch.testing.assert_close(dba(gallery, n, 3.0, chunk=chunk), dba(gallery, n, 3.0, chunk=0))


def test_planted_modality_offset_is_removed_by_gap_correction():
    n, d = 60, 64
    g = torch.Generator().manual_seed(10)
    image_cone = _unit(d, seed=11)
    images = F.normalize(image_cone + 0.5 * torch.randn(n, d, generator=g), dim=-1)
    offset = 4.0 * _unit(d, seed=12)                               # the text modality's constant shift
    texts = F.normalize(images + offset + 0.1 * torch.randn(n, d, generator=g), dim=-1)
    truth = torch.arange(n)
    raw = ((texts @ images.T).argmax(1) == truth).float().mean()
    fixed = ((center(texts, texts.mean(0)) @ center(images, images.mean(0)).T).argmax(1) == truth).float().mean()
    assert raw < 0.5 and fixed == 1.0, (raw, fixed)


def _two_positives():
    """q = e0; p1 near q; p2 near p1 but farther from q than a distractor d (rows 0, 1, 2)."""
    e = torch.eye(16)
    p1 = F.normalize(0.9 * e[0] + 0.44 * e[1], dim=0)
    d = F.normalize(0.55 * e[0] + 0.83 * e[3], dim=0)
    p2 = F.normalize(0.45 * e[0] + 0.85 * e[1] + 0.1 * e[2], dim=0)
    fill = [F.normalize(0.2 * e[0] + e[4 + i], dim=0) for i in range(8)]
    return e[0], torch.stack([p1, d, p2, *fill])


def test_alpha_qe_and_dba_pull_in_the_second_positive():
    q, gallery = _two_positives()
    order = lambda s: torch.argsort(s, descending=True, stable=True)[:3].tolist()  # noqa: E731
    assert order(gallery @ q) == [0, 1, 2]                         # raw: the distractor before p2
    vals, idx = (gallery @ q).topk(1)
    q2 = alpha_qe(q[None], gallery[idx][None], vals[None], alpha=3.0)[0]
    assert order(gallery @ q2) == [0, 2, 1]                        # alpha-QE: p2 (close to p1) moves up
    assert order(dba(gallery, 1, 3.0) @ q) == [0, 2, 1]            # DBA: the same, from the gallery side
    torch.testing.assert_close(alpha_qe(q[None], gallery[idx][None], vals[None], alpha=3.0).norm(dim=-1),
                               torch.ones(1))


def test_method_names_round_trip_and_defaults(capsys):
    m = make_method("slerp+gap+qbnorm+aqe+dba:n=5+reinspect")
    d = m.to_dict()
    assert (d["hubness"], d["beta"], d["bank"], d["aqe"], d["aqe_alpha"], d["dba"], d["reinspect"], d["crops"]) == \
        ("qbnorm", 20.0, "gallery", 3, 3.0, 5, 100, 3)   # the default bank never depends on the call's requests
    assert [o.name for o in m.options] == ["gap", "qbnorm", "aqe", "dba", "reinspect"]
    assert m.label == "slerp+gap+qbnorm+aqe+dba:n=5+reinspect"
    for name in ("slerp", "pic2word+csls:k=5:bank=requests", "sum+dual-softmax:temp=50",
                 "text-only+isoftmax:beta=30:bank=both+aqe:n=2:alpha=1"):
        assert make_method(name).label == name
        assert Method.from_dict(make_method(name).to_dict()) == make_method(name)
    assert make_method("slerp").uses_bank is False and make_method("slerp+csls").uses_bank is False
    assert make_method("slerp+csls:bank=requests").uses_bank is True and make_method("slerp+csls:bank=gallery") \
        == make_method("slerp+csls")
    assert task.method("slerp+reinspect:n=500").option("reinspect").n == 100     # clamped to the task's limit ...
    assert "clamped to 100" in capsys.readouterr().err                            # ... and said


@pytest.mark.parametrize("bad", ["slerp+qbnorm+csls", "slerp+hubs", "slerp+csls:k=0", "slerp+gap:text=x",
                                 "slerp+aqe:n=two", "slerp+reinspect:crops=9", "mean+gap", "slerp+csls:q=1"])
def test_invalid_method_names_are_refused(bad):
    with pytest.raises(ValueError):
        make_method(bad)

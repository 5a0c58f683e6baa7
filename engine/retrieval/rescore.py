"""Gallery-aware scoring: modality-gap centring, hubness-reducing scorers, query expansion, DBA.

All functions take unit rows (float32 torch, any device) and return new tensors.
Notation: q = queries [B, D], G = gallery [N, D], bank = other queries [M, D] that stand
for "what queries look like" (the call's own requests, or gallery-derived texts), and
s_xj = cos(x, G_j).

- Modality gap (`center`): CLIP's image and text embeddings sit in two separate cones;
  subtracting each modality's mean (image mean over the gallery, text mean over texts)
  and renormalising compares directions within the cones.
- Hubness: a "hub" gallery item is near many queries and crowds every list. Each scorer
  uses per-item statistics of the bank (`bank_stats`), so a hub pays for its popularity:
  `isoftmax`  beta * s_qj - log sum_b exp(beta * s_bj)   (inverted softmax, log form)
  `qbnorm`    the same, only in rows whose raw top-1 is in the activation set (items that
              are some bank query's top-1); other rows keep s_qj (QB-Norm's dynamic inverted
              softmax, k = 1). When the bank holds the scored queries themselves, a row's own
              bank entry does not activate its top-1 (leave-one-out: another bank query must),
              else every row would be normalised and qbnorm would equal isoftmax
  `dual-softmax` s_qj * exp(temp * s_qj - log sum_b exp(temp * s_bj)) (prior over queries)
  `csls`      2 s_qj - r_j - r_q, r_j = mean of the k largest s_bj, r_q = mean of q's k
              largest s_qj (constant in a row: it keeps the score's scale, not the order)
- `alpha_qe`: q' = normalise(q + sum_i max(s_qi, 0)^alpha g_i) over q's top n.
- `dba`: g'_j = normalise(g_j + sum_i max(s_ji, 0)^alpha g_i) over g_j's n nearest others.

Each bank query's own match is masked out of every statistic (`exclude`: a request's
reference image, a gallery-derived text's own gallery row): a composed query sits far
closer to its own reference (cosine ~0.49 with ViT-L/14) than to anything else (~0.25), and
under exp(100 * s) that one term would outweigh the whole bank and push every reference
image of the call down for every other request (CIRR reuses one request's reference as
another's target).

Fast path and twin: `bank_stats` and `dba` stream the bank / gallery in row chunks (the
full [M, N] matrix is 1 GB at M = 2,200, N = 125k); `chunk=0` runs the reference (one
matrix at once). Ties in the neighbour searches follow torch.topk (tested on tie-free data).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.presets.retrieval import RETRIEVAL

SCORERS = ("", "isoftmax", "qbnorm", "dual-softmax", "csls")


def center(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """normalise(x - mean): rows [*, D] minus their modality's mean [D]."""
    return F.normalize(x - mean.to(x), dim=-1)


def _masked(s: torch.Tensor, exclude: torch.Tensor | None) -> torch.Tensor:
    """A copy of s [B, N] with each row's excluded column (-1 = none) at -inf."""
    if exclude is None:
        return s
    s = s.clone()
    rows = torch.nonzero(exclude >= 0).squeeze(1)
    s[rows, exclude[rows]] = float("-inf")
    return s


@dataclass
class BankStats:
    scorer: str
    size: int                            # bank queries M
    has_queries: bool                    # the bank holds the queries being scored (dual-softmax)
    lse: torch.Tensor | None = None      # [N] log sum_b exp(scale * s_bj)  (isoftmax, qbnorm, dual-softmax)
    active: torch.Tensor | None = None   # [N] bool: some bank query's top-1 (qbnorm)
    hits: torch.Tensor | None = None     # [N] int64: how many bank queries have it as top-1 (qbnorm)
    knn: torch.Tensor | None = None      # [N] mean of the k largest s_bj (csls)


@dataclass(frozen=True)
class ScorerParams:
    """A scorer's settings: inverse temperature of isoftmax / qbnorm (`beta`), of dual-softmax
    (`temp`), and CSLS's neighbourhood size (`k`); a scorer reads its own."""
    beta: float = RETRIEVAL.beta
    temp: float = RETRIEVAL.temp
    k: int = RETRIEVAL.csls_k


def _scale(scorer: str, beta: float, temp: float) -> float:
    return temp if scorer == "dual-softmax" else beta


def bank_stats(scorer: str, bank: torch.Tensor, gallery: torch.Tensor, params: ScorerParams = ScorerParams(),
               exclude: torch.Tensor | None = None, has_queries: bool = True,
               chunk: int = RETRIEVAL.bank_chunk) -> BankStats:
    """Per-gallery-item statistics of the bank [M, D] for `scorer` (its settings in `params`);
    `exclude` [M] is each bank query's own match (its reference row; -1 = none), left out of every
    statistic: the log-sum-exp, the top-1 and the k nearest. chunk=0: the reference."""
    if scorer not in SCORERS[1:]:
        raise ValueError(f"scorer must be one of {SCORERS[1:]}, got {scorer!r}")
    m, n = bank.shape[0], gallery.shape[0]
    if m == 0:
        raise ValueError("the query bank is empty")
    if chunk <= 0:
        return bank_stats_reference(scorer, bank, gallery, params, exclude, has_queries)
    a = _scale(scorer, params.beta, params.temp)
    k = min(params.k, m)
    out = BankStats(scorer, m, has_queries)
    lse = torch.full((n,), float("-inf"), device=gallery.device)
    hits = torch.zeros(n, dtype=torch.int64, device=gallery.device)
    best = torch.empty(0, n, device=gallery.device)                    # [<=k, N] running top-k over the bank
    for lo in range(0, m, chunk):
        ex = None if exclude is None else exclude[lo:lo + chunk]
        s = _masked(bank[lo:lo + chunk] @ gallery.T, ex)                # [m', N], own matches at -inf
        if scorer == "csls":
            best = torch.cat([best, s]).topk(min(k, best.shape[0] + s.shape[0]), dim=0).values
            continue
        lse = torch.logaddexp(lse, torch.logsumexp(a * s, dim=0))
        if scorer == "qbnorm":
            hits.index_add_(0, s.argmax(dim=1), torch.ones(s.shape[0], dtype=torch.int64, device=s.device))
    return _finish(out, scorer, a, lse, hits, best)


def _finish(out: BankStats, scorer: str, a: float, lse: torch.Tensor, hits: torch.Tensor,
            best: torch.Tensor) -> BankStats:
    """Fill `out` from the reduced statistics. An item every bank query masked has no bank
    evidence: its log-sum-exp is floored at -a (one bank query at cosine -1, below any real
    sum) and its k-NN mean is taken over the finite entries (0 when none)."""
    if scorer == "csls":
        ok = torch.isfinite(best)
        out.knn = best.masked_fill(~ok, 0.0).sum(0) / ok.sum(0).clamp(min=1)
        return out
    out.lse = lse.clamp(min=-a)
    if scorer == "qbnorm":
        out.hits = hits
        out.active = hits > 0
    return out


def bank_stats_reference(scorer: str, bank: torch.Tensor, gallery: torch.Tensor,
                         params: ScorerParams = ScorerParams(), exclude: torch.Tensor | None = None,
                         has_queries: bool = True) -> BankStats:
    """`bank_stats` from the whole [M, N] similarity matrix at once (the twin of the streamed path)."""
    s = _masked(bank @ gallery.T, exclude)                              # [M, N], own matches at -inf
    out = BankStats(scorer, bank.shape[0], has_queries)
    a = _scale(scorer, params.beta, params.temp)
    best = s.topk(min(params.k, s.shape[0]), dim=0).values if scorer == "csls" else s[:0]
    hits = torch.bincount(s.argmax(dim=1), minlength=gallery.shape[0])
    return _finish(out, scorer, a, torch.logsumexp(a * s, dim=0), hits, best)


@dataclass
class RowState:
    """What a scorer decided per query row from its raw scores (kept for re-scoring candidates)."""
    normalised: torch.Tensor | None = None   # [B] bool (qbnorm: the row uses the inverted softmax)
    r_q: torch.Tensor | None = None          # [B] (csls)


def row_state(scorer: str, cos: torch.Tensor, stats: BankStats | None, k: int = RETRIEVAL.csls_k,
              exclude: torch.Tensor | None = None) -> RowState:
    """Per-row decisions from raw cosines cos [B, N] (the reference column excluded). qbnorm: a
    bank that holds the scored queries counts each row's own entry once, so its top-1 must be
    some other bank query's top-1 too (a row moved by query expansion is held to the same rule)."""
    if scorer == "qbnorm":
        need = 2 if stats.has_queries else 1
        return RowState(normalised=stats.hits[_masked(cos, exclude).argmax(dim=1)] >= need)
    if scorer == "csls":
        kk = max(1, min(k, cos.shape[1] - (exclude is not None)))
        return RowState(r_q=_masked(cos, exclude).topk(kk, dim=1).values.mean(1))
    return RowState()


def score_cos(scorer: str, cos: torch.Tensor, stats: BankStats | None, state: RowState,
              cols: torch.Tensor | None = None, beta: float = RETRIEVAL.beta,
              temp: float = RETRIEVAL.temp) -> torch.Tensor:
    """Scores [B, C] from cosines cos [B, C] of gallery columns `cols` [B, C] (None: all N, C = N)."""
    if scorer == "":
        return cos

    def at(v: torch.Tensor) -> torch.Tensor:         # a per-item statistic [N] at the scored columns
        return v.unsqueeze(0) if cols is None else v[cols]

    if scorer == "csls":
        return 2 * cos - at(stats.knn) - state.r_q.unsqueeze(1)
    a = _scale(scorer, beta, temp)
    lse = at(stats.lse)
    if scorer == "dual-softmax":
        if not stats.has_queries:                    # the softmax runs over the bank plus this query
            lse = torch.logaddexp(lse, a * cos)
        return cos * torch.exp((a * cos - lse).clamp(max=0.0))
    inv = a * cos - lse                              # log of the inverted softmax
    if scorer == "qbnorm":
        return torch.where(state.normalised.unsqueeze(1), inv, cos)
    return inv


def alpha_qe(q: torch.Tensor, neighbours: torch.Tensor, sims: torch.Tensor, alpha: float) -> torch.Tensor:
    """alpha-QE: q [B, D], its top-n gallery rows [B, n, D] and their cosines [B, n] -> [B, D]."""
    w = sims.clamp(min=0).pow(alpha).unsqueeze(-1)                      # [B, n, 1]
    return F.normalize(q + (w * neighbours).sum(1), dim=-1)


def dba(gallery: torch.Tensor, n: int, alpha: float, chunk: int = RETRIEVAL.dba_chunk) -> torch.Tensor:
    """Database-side augmentation of gallery [N, D] over each row's n nearest other rows.
    chunk=0: the reference (the whole [N, N] matrix at once)."""
    num = gallery.shape[0]
    n = min(n, num - 1)
    if n <= 0:
        return gallery.clone()
    step = num if chunk <= 0 else chunk
    out = torch.empty_like(gallery)
    for lo in range(0, num, step):
        s = gallery[lo:lo + step] @ gallery.T                           # [c, N]
        rows = torch.arange(lo, lo + s.shape[0], device=gallery.device)
        s[torch.arange(s.shape[0], device=s.device), rows] = float("-inf")   # not itself
        vals, idx = s.topk(n, dim=1)                                    # [c, n]
        w = vals.clamp(min=0).pow(alpha).unsqueeze(-1)                  # [c, n, 1]
        out[lo:lo + s.shape[0]] = F.normalize(gallery[lo:lo + step] + (w * gallery[idx]).sum(1), dim=-1)
    return out

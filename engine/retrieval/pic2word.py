"""Pic2Word-style image-to-word mapping, learned at build time on the gallery's own images.

Saito et al. 2023, "Pic2Word: Mapping Pictures to Words for Zero-shot Composed Image
Retrieval": a small MLP maps a CLIP image embedding to a pseudo-word token embedding; the
frozen text tower encodes "a photo of *" with `*` replaced by that token, and a
contrastive (InfoNCE, both directions, CLIP's logit scale) loss over the batch pulls the
text embedding towards its own image embedding and away from the batch's other images.
Training data here: the gallery's stored image embeddings only (no captions, labels or
other data), so no image is decoded again. At query time the request becomes a prompt
with the pseudo-word (engine.retrieval.compose PROMPTS `pic2word*`) and its text embedding is the query.

Deviations from Pic2Word, stated: (1) it trains on the evaluation gallery's images (an
image-only corpus, no labels; Pic2Word trains on CC3M images), since no other data is
allowed; (2) the mapping's input is the stored unit-normalised image embedding, where
Pic2Word feeds the raw one and normalises only inside the loss: the index keeps unit rows
only, and a row's norm carries no retrieval information (a constant scale is absorbed by
the first linear layer). As in Pic2Word, the loss normalises both sides, and the learning
rate warms up linearly, then follows a cosine decay (`lr_at`).

Mapping (`Im2Token`, Pic2Word's IM2TEXT shape): `layers` x (Linear, Dropout, ReLU) at
width `hidden`, then Linear to the token width.

Training (`train`): seeded (init, data order, dropout), `steps` (default: `epochs` passes
over the gallery), AdamW with a warm-up and cosine schedule, bf16 autocast on CUDA (fp32 on
CPU); a checkpoint every `ckpt_every` steps (mapping, optimiser, RNG state, loss log; temp
name + rename) in a folder the caller names, under a key (config,
embeddings digest, model digest): a killed training resumes from its last checkpoint and
ends with the same weights as an uninterrupted one; a changed key starts over (said on
stderr). A wall-clock budget (`time_budget_s`) stops early, recorded in the result.
"""
from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine.clip.inject import check_injectable, encode_with_slot, placeholder_id, slots_of
from engine.presets.retrieval import RETRIEVAL

TRAIN_PROMPT = "a photo of *"


_R = RETRIEVAL   # the defaults: the retrieval table's p2w_* fields (engine/presets/retrieval.py)


@dataclass(frozen=True)
class Pic2WordConfig:
    hidden: int = _R.p2w_hidden    # MLP width (Pic2Word's)
    layers: int = _R.p2w_layers    # hidden layers
    dropout: float = _R.p2w_dropout
    epochs: int = _R.p2w_epochs    # passes over the gallery when steps == 0
    steps: int = 0                 # optimiser steps; 0: epochs * (N // batch_size)
    batch_size: int = _R.p2w_batch_size   # InfoNCE negatives = batch_size - 1
    lr: float = _R.p2w_lr
    warmup: int = -1               # linear warm-up steps; -1: a tenth of the run (Pic2Word warms up too)
    weight_decay: float = _R.p2w_weight_decay
    seed: int = _R.p2w_seed
    ckpt_every: int = _R.p2w_ckpt_every   # steps between checkpoints
    time_budget_s: float = _R.p2w_time_budget   # stop early past this many seconds of training

    def total_steps(self, n: int) -> int:
        return self.steps or self.epochs * max(1, n // self.batch_size)

    def warmup_steps(self, total: int) -> int:
        return min(total, total // 10 if self.warmup < 0 else self.warmup)


def lr_at(step: int, total: int, warmup: int, base: float) -> float:
    """Learning rate of 0-based `step`: linear warm-up to `base` over `warmup` steps, then a
    cosine decay towards 0 at `total` (open_clip's cosine_lr, which Pic2Word trains with). A
    function of the step alone, so a resumed run follows the same schedule."""
    if step < warmup:
        return base * (step + 1) / warmup
    span = max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / span)) * base


class Im2Token(nn.Module):
    """Image embedding [B, D] -> pseudo-word token embedding [B, W]."""

    def __init__(self, embed_dim: int, token_width: int, hidden: int, layers: int, dropout: float):
        super().__init__()
        body, width = [], embed_dim
        for _ in range(layers):
            body += [nn.Linear(width, hidden), nn.Dropout(dropout), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*body)
        self.out = nn.Linear(width, token_width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(x))


def make_mapping(model, cfg: Pic2WordConfig) -> Im2Token:
    """A freshly (seeded) initialised mapping for `model`'s embedding and token widths."""
    check_injectable(model)
    torch.manual_seed(cfg.seed)
    embed_dim = model.text_projection.shape[1] if isinstance(model.text_projection, torch.Tensor) \
        else model.text_projection.out_features
    return Im2Token(embed_dim, model.token_embedding.weight.shape[1], cfg.hidden, cfg.layers, cfg.dropout)


def _autocast(towers, training: bool = False):
    """The towers' autocast; training uses bf16 instead of fp16 (no loss scaling needed)."""
    from engine.clip.towers import PRECISIONS

    dtype = PRECISIONS[towers.precision]
    if training and dtype is torch.float16:
        dtype = torch.bfloat16
    return torch.autocast(towers.device.type, dtype=dtype, enabled=dtype is not None)


def encode_prompts(towers, mapping: Im2Token, image: torch.Tensor, prompts: list[str],
                   batch_size: int = RETRIEVAL.text_batch) -> torch.Tensor:
    """[B, D] unit text embeddings of `prompts` (each with a `*`) with `*` replaced by
    mapping(image [B, D]); returns float32 rows on the towers' device."""
    star = placeholder_id(towers.tokenizer)
    mapping = mapping.to(towers.device).eval()
    out = []
    for lo in range(0, len(prompts), batch_size):
        tokens = towers.tokenize(prompts[lo:lo + batch_size])[0].to(towers.device)
        img = image[lo:lo + batch_size].to(towers.device).float()
        with torch.inference_mode(), _autocast(towers):
            feats = encode_with_slot(towers.model, tokens, slots_of(tokens, star), mapping(img),
                                     trim=towers.trim_text)
        out.append(F.normalize(feats.float(), dim=-1))
    return torch.cat(out) if out else torch.zeros(0, towers.spec.embed_dim, device=towers.device)


class Stopped(Exception):
    """Raised by the stop hook after N new steps, as a kill would (nothing saved past the last checkpoint)."""


@dataclass
class TrainResult:
    state: dict                     # the mapping's state dict (float32, CPU)
    steps: int
    total_steps: int
    final_loss: float               # mean loss of the run's last `loss_window` steps
    first_loss: float               # mean loss of the run's first `loss_window` steps (resumed ones included)
    curve: list = field(default_factory=list)   # [step, mean loss] every ~1/20 of the run
    resumed_from: int = 0
    stopped: str = ""               # "" or why training stopped before total_steps
    seconds: float = 0.0
    loss_window: int = 0            # steps averaged into first_loss / final_loss


def loss_window(n: int) -> int:
    """Steps averaged at each end of an n-step loss log: a tenth of the run, 1..20 (never
    the whole run, so a short run's first and last losses differ when the loss moves)."""
    return max(1, min(20, n // 10))


@functools.lru_cache(maxsize=2)
def _permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def _batch_rows(step: int, n: int, cfg: Pic2WordConfig) -> torch.Tensor:
    """Gallery rows of one step: epoch e's seeded permutation, sliced (no state to checkpoint);
    the last n % batch rows of a permutation sit that epoch out."""
    b = min(cfg.batch_size, n)
    per_epoch = max(1, n // b)
    epoch, i = divmod(step, per_epoch)
    return _permutation(n, cfg.seed, epoch)[i * b:(i + 1) * b]


def _save(path: Path, blob: dict) -> None:
    """The checkpoint through engine.io.write_atomic: a locked temp file of a unique name, then a rename."""
    import io

    from engine.io import write_atomic

    buf = io.BytesIO()
    torch.save(blob, buf)
    write_atomic(path, buf.getvalue())


def train(towers, emb: np.ndarray, cfg: Pic2WordConfig, ckpt_dir: Path, key: dict,
          stop_after: int = 0, log=print) -> TrainResult:
    """Fit the mapping on gallery embeddings emb [N, D] (unit rows); checkpoints in ckpt_dir."""
    model, dev = towers.model, towers.device
    check_injectable(model)
    for p in model.parameters():
        p.requires_grad_(False)                # CLIP stays frozen: only the mapping learns
    x_all = torch.from_numpy(np.asarray(emb, np.float32)).to(dev)     # [N, D]
    n = x_all.shape[0]
    total = cfg.total_steps(n)
    mapping = make_mapping(model, cfg).to(dev)
    opt = torch.optim.AdamW(mapping.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses: list[float] = []
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / "pic2word-state.pt"
    full_key = {**key, "config": asdict(cfg)}
    start = 0
    if path.is_file():
        blob = torch.load(path, map_location="cpu", weights_only=True)
        if blob.get("key") == full_key:
            mapping.load_state_dict(blob["mapping"])
            opt.load_state_dict(blob["opt"])
            torch.set_rng_state(blob["rng"])
            if dev.type == "cuda" and "rng_cuda" in blob:
                torch.cuda.set_rng_state(blob["rng_cuda"], dev)
            start, losses = int(blob["step"]), list(blob["losses"])
            log(f"pic2word: resuming from the checkpoint at step {start} of {total}")
        else:
            log(f"pic2word: the checkpoint in {ckpt_dir} was made under another config or gallery; "
                "training starts over")
    star = placeholder_id(towers.tokenizer)
    tokens = towers.tokenize([TRAIN_PROMPT])[0].to(dev)                # [1, ctx]
    slot = slots_of(tokens, star)
    scale = float(model.logit_scale.exp().clamp(max=100.0))            # CLIP's own temperature
    t0 = time.perf_counter()
    stopped = ""
    mapping.train()
    step = start
    from engine.progress import Progress

    bar = Progress(total - start, "pic2word: training", unit="steps")
    warmup = cfg.warmup_steps(total)
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, warmup, cfg.lr)
        rows = _batch_rows(step, n, cfg).to(dev)
        img = x_all[rows]                                              # [b, D] unit image rows
        with _autocast(towers, training=True):
            feats = encode_with_slot(model, tokens.expand(len(rows), -1), slot.expand(len(rows)), mapping(img),
                                     trim=towers.trim_text)
        txt = F.normalize(feats.float(), dim=-1)                       # [b, D]
        logits = scale * img @ txt.T                                   # [b, b]: image i vs text j
        target = torch.arange(len(rows), device=dev)
        loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        bar.update()
        if step % cfg.ckpt_every == 0 and step < total:
            blob = {"key": full_key, "step": step, "mapping": mapping.state_dict(), "opt": opt.state_dict(),
                    "rng": torch.get_rng_state(), "losses": losses}
            if dev.type == "cuda":
                blob["rng_cuda"] = torch.cuda.get_rng_state(dev)
            _save(path, blob)
        if stop_after and step - start >= stop_after:
            bar.close()
            raise Stopped(f"stopped after {step - start} steps (test hook)")
        if time.perf_counter() - t0 > cfg.time_budget_s:
            stopped = f"time budget of {cfg.time_budget_s:g} s reached at step {step} of {total}"
            log(f"pic2word: {stopped}")
            break
    bar.close()
    mapping.eval()
    every = max(1, math.ceil(len(losses) / 20))
    curve = [[min(i + every, len(losses)), round(float(np.mean(losses[i:i + every])), 5)]
             for i in range(0, len(losses), every)]
    state = {k: v.detach().float().cpu().contiguous() for k, v in mapping.state_dict().items()}
    w = loss_window(len(losses))
    return TrainResult(state, step, total, float(np.mean(losses[-w:])) if losses else float("nan"),
                       float(np.mean(losses[:w])) if losses else float("nan"), curve, start, stopped,
                       round(time.perf_counter() - t0, 3), w)


def load_mapping(state: dict, meta: dict) -> Im2Token:
    """The mapping from its stored state dict and the meta.json `pic2word` record."""
    m = meta["mapping"]
    mapping = Im2Token(m["embed_dim"], m["token_width"], m["hidden"], m["layers"], m["dropout"])
    mapping.load_state_dict(state)
    return mapping.eval()


def say(msg: str) -> None:
    print(f"[pic2word] {msg}", file=sys.stderr, flush=True)

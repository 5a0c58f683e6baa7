"""The Pic2Word mapping (Saito et al., CVPR 2023), a trained option: the build learns it on the
gallery (`scripts/build.sh --mapping pic2word`, engine.retrieval.pic2word) and stores it with a
bank of gallery-derived texts; the `pic2word` method reads it and encodes each request's prompt
with the reference image's pseudo-word. Implied by the `pic2word` base, never named after `+`.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict

from engine.presets.retrieval import RETRIEVAL
from engine.retrieval.options.base import Option

P2W_DIR = "pic2word"       # checkpoint folder under INDEX_DIR/.build


class Pic2WordMapping(Option):
    name = "pic2word"
    source = "published method (Saito et al., CVPR 2023), mapping trained on the gallery: this kit's variant"
    base = "pic2word"
    trained = True
    extra_files = ("pic2word", "text_bank")

    @classmethod
    def from_record(cls, flat: dict):
        return cls() if flat.get("name") == cls.base else None

    def missing(self, meta: dict, corpus) -> str | None:
        if not meta.get("pic2word"):
            return "the index has no Pic2Word mapping (scripts/build.sh --mapping pic2word trains one)"
        return None

    def reads(self, meta: dict) -> tuple[str, ...]:
        return ("pic2word",)

    def load(self, space) -> None:
        from safetensors.torch import load

        from engine.retrieval.pic2word import load_mapping

        data, meta = space.stored.get("pic2word"), space.meta.get("pic2word")
        if data is None or meta is None:
            raise space.Error("method pic2word: the index has no mapping; "
                             "build it with scripts/build.sh ... --mapping pic2word")
        space.info["pic2word"] = {k: meta.get(k) for k in ("steps", "final_loss", "seed", "stopped_early")}
        space.mapping = load_mapping(load(data), meta).to(space.towers.device)

    def encode_texts(self, space, batch, texts: list[str], ref_t):
        """[B, D] the prompts with the reference's pseudo-word; the bare modification where there is none."""
        import torch

        from engine.retrieval.pic2word import encode_prompts

        towers = space.towers
        has = (ref_t >= 0).tolist()
        out = torch.empty(len(batch), towers.spec.embed_dim, device=towers.device)
        if any(has):
            sel = [i for i, h in enumerate(has) if h]
            out[sel] = encode_prompts(towers, space.mapping, space.raw[ref_t[sel]], [texts[i] for i in sel])
        if not all(has):             # no image for the pseudo-word: the bare modification alone (text-only's prompt)
            sel = [i for i, h in enumerate(has) if not h]
            out[sel] = towers.encode_texts([batch[i].modification for i in sel])
        return out

    @classmethod
    def extras(cls, ctx) -> tuple[dict, dict]:
        """With `--mapping pic2word`: the mapping, trained (resumably) on the gallery rows, and the
        bank of gallery-derived texts (`--text-bank`). Raises engine.retrieval.pic2word.Stopped
        when the training's stop hook fires."""
        cfg, x = ctx.cfg, ctx.rows
        if cfg.mapping != cls.name:
            if cfg.bank_size():
                ctx.log("no text bank: gallery-derived texts need a mapping (--mapping pic2word)")
            return {}, {}
        import numpy as np
        import torch
        from safetensors.torch import save as save_safetensors

        from engine.retrieval import pic2word

        if len(x) < 2:
            raise ValueError("pic2word needs at least 2 gallery images (InfoNCE needs negatives)")
        emb, towers = ctx.emb, ctx.towers
        key = {"embeddings_sha256": hashlib.sha256(np.ascontiguousarray(emb, np.float16).tobytes()).hexdigest(),
               "model_digest": ctx.model_digest, "device": towers.device.type, "precision": towers.precision}
        ctx.log(f"pic2word: training the mapping on {len(x)} gallery embeddings "
                f"({cfg.p2w.total_steps(len(x))} steps, batch {min(cfg.p2w.batch_size, len(x))}, seed {cfg.p2w.seed})")
        res = pic2word.train(towers, emb, cfg.p2w, ctx.work_dir / P2W_DIR, key, cfg.p2w_stop_after, log=ctx.log)
        ctx.log(f"pic2word: {res.steps} steps in {res.seconds:.1f} s, loss {res.first_loss:.3f} -> "
                f"{res.final_loss:.3f} (means of the first and last {res.loss_window} of the run's {res.steps} steps)")
        files = {"pic2word": (".safetensors", save_safetensors(res.state))}
        shape = mapping_shape(towers, cfg.p2w)
        mapping = pic2word.load_mapping(res.state, {"mapping": shape})
        meta = {"pic2word": {"mapping": shape, "config": asdict(cfg.p2w),
                             "train_prompt": pic2word.TRAIN_PROMPT, "steps": res.steps,
                             "total_steps": res.total_steps, "final_loss": res.final_loss,
                             "first_loss": res.first_loss, "loss_window": res.loss_window,
                             "loss_curve": res.curve, "seed": cfg.p2w.seed,
                             "resumed_from_step": res.resumed_from, "stopped_early": res.stopped,
                             "train_s": res.seconds, "data": "gallery image embeddings only"}}
        n_bank = min(cfg.bank_size(), len(x))
        if n_bank:
            rows = np.sort(np.random.default_rng(cfg.p2w.seed).choice(len(x), n_bank, replace=False))
            bank = pic2word.encode_prompts(towers, mapping, torch.from_numpy(x[rows]),
                                           [pic2word.TRAIN_PROMPT] * n_bank)
            files["text_bank"] = (".f16.npy", ctx.npy(bank.cpu().numpy().astype(np.float16)))
            meta["text_bank"] = {"count": n_bank, "seed": cfg.p2w.seed,
                                 "source": f"pic2word {pic2word.TRAIN_PROMPT!r} of {n_bank} seeded gallery rows",
                                 "rows": rows.tolist()}   # each text's own gallery row: masked in bank statistics
        return meta, files


def no_text_bank(meta: dict) -> str:
    """Why an index (its meta.json) stores no gallery-derived texts: they are the mapping's
    pseudo-words of gallery rows, so only a build with a mapping writes them."""
    if meta.get("pic2word"):
        return "the index has a Pic2Word mapping but was built with --text-bank 0 (rebuild with --text-bank N)"
    return ("the index has none: they are written from a Pic2Word mapping (scripts/build.sh --mapping pic2word "
            f"trains one and stores {RETRIEVAL.text_bank_size} texts)")


def mapping_shape(towers, p2w) -> dict:
    """What engine.retrieval.pic2word.load_mapping needs to rebuild the mapping's modules."""
    return {"embed_dim": towers.spec.embed_dim, "token_width": towers.model.token_embedding.weight.shape[1],
            "hidden": p2w.hidden, "layers": p2w.layers, "dropout": p2w.dropout}

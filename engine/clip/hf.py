"""Hugging Face `CLIPModel` folders as open_clip `CLIP` towers, without `transformers`.

Two pure functions carry the whole conversion: `model_cfg_from_hf` (config.json ->
open_clip model_cfg) and `hf_to_open_clip` (state-dict key remapping, the only place
HF names appear). `open_clip_to_hf` is its inverse: the tests build HF-layout
checkpoints with it and check the round trip gives identical embeddings.

HF keeps q/k/v as three Linear layers; open_clip's nn.MultiheadAttention keeps one
`in_proj` [3W, W] (q, k, v stacked in that order). HF projections are nn.Linear
weights [D, W]; open_clip's are parameters [W, D] used as `x @ proj`: transposed.
"""
from __future__ import annotations

import re

import torch

# CLIPTextConfig / CLIPVisionConfig defaults, for old config.json files that omit fields
_TEXT_DEFAULTS = {"hidden_size": 512, "intermediate_size": 2048, "num_attention_heads": 8,
                  "num_hidden_layers": 12, "max_position_embeddings": 77, "vocab_size": 49408,
                  "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
_VISION_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_attention_heads": 12,
                    "num_hidden_layers": 12, "image_size": 224, "patch_size": 32,
                    "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
_ACTS = {"quick_gelu": True, "gelu": False}  # HF hidden_act -> open_clip quick_gelu

# whole-tensor renames (HF name, open_clip name, transpose?)
_TOP = [
    ("text_model.embeddings.token_embedding.weight", "token_embedding.weight", False),
    ("text_model.embeddings.position_embedding.weight", "positional_embedding", False),
    ("text_model.final_layer_norm.weight", "ln_final.weight", False),
    ("text_model.final_layer_norm.bias", "ln_final.bias", False),
    ("text_projection.weight", "text_projection", True),
    ("vision_model.embeddings.class_embedding", "visual.class_embedding", False),
    ("vision_model.embeddings.patch_embedding.weight", "visual.conv1.weight", False),
    ("vision_model.embeddings.position_embedding.weight", "visual.positional_embedding", False),
    ("vision_model.pre_layrnorm.weight", "visual.ln_pre.weight", False),   # sic: HF's spelling
    ("vision_model.pre_layrnorm.bias", "visual.ln_pre.bias", False),
    ("vision_model.post_layernorm.weight", "visual.ln_post.weight", False),
    ("vision_model.post_layernorm.bias", "visual.ln_post.bias", False),
    ("visual_projection.weight", "visual.proj", True),
    ("logit_scale", "logit_scale", False),
]
_TOWERS = [("text_model.encoder.layers.", "transformer.resblocks."),
           ("vision_model.encoder.layers.", "visual.transformer.resblocks.")]
_BLOCK = [("self_attn.out_proj.", "attn.out_proj."), ("layer_norm1.", "ln_1."), ("layer_norm2.", "ln_2."),
          ("mlp.fc1.", "mlp.c_fc."), ("mlp.fc2.", "mlp.c_proj.")]
_DROP = ("text_model.embeddings.position_ids", "vision_model.embeddings.position_ids")
_QKV = re.compile(r"^(?P<block>.*)self_attn\.(?P<p>[qkv])_proj\.(?P<kind>weight|bias)$")


def is_hf_clip_config(cfg: dict) -> bool:
    """True for a transformers CLIPModel config.json."""
    return cfg.get("model_type") == "clip" or ("text_config" in cfg and "vision_config" in cfg)


def model_cfg_from_hf(cfg: dict) -> dict:
    """open_clip `CLIP(**model_cfg)` kwargs for a HF CLIPModel config.json."""
    t = {**_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
    v = {**_VISION_DEFAULTS, **(cfg.get("vision_config") or {})}
    acts = {t["hidden_act"], v["hidden_act"]}
    if len(acts) != 1 or not acts <= set(_ACTS):
        raise ValueError(f"HF CLIP: hidden_act must be one of {sorted(_ACTS)} and equal in both towers, got {acts}")
    for name, tower in (("text", t), ("vision", v)):
        if abs(float(tower["layer_norm_eps"]) - 1e-5) > 1e-12:
            raise ValueError(f"HF CLIP: {name} layer_norm_eps {tower['layer_norm_eps']} != 1e-5 (open_clip's)")
        if tower["hidden_size"] % tower["num_attention_heads"]:
            raise ValueError(f"HF CLIP: {name} hidden_size is not a multiple of num_attention_heads")
    embed = cfg.get("projection_dim") or t.get("projection_dim") or 512
    return {
        "embed_dim": int(embed),
        "quick_gelu": _ACTS[acts.pop()],
        "vision_cfg": {"image_size": int(v["image_size"]), "layers": int(v["num_hidden_layers"]),
                       "width": int(v["hidden_size"]), "patch_size": int(v["patch_size"]),
                       "head_width": int(v["hidden_size"]) // int(v["num_attention_heads"]),
                       "mlp_ratio": v["intermediate_size"] / v["hidden_size"]},
        "text_cfg": {"context_length": int(t["max_position_embeddings"]), "vocab_size": int(t["vocab_size"]),
                     "width": int(t["hidden_size"]), "heads": int(t["num_attention_heads"]),
                     "layers": int(t["num_hidden_layers"]),
                     "mlp_ratio": t["intermediate_size"] / t["hidden_size"]},
    }


def hf_config_from_model_cfg(model_cfg: dict) -> dict:
    """The inverse of `model_cfg_from_hf` (plain ViT CLIP configs only): used to write test folders."""
    v, t = model_cfg["vision_cfg"], model_cfg["text_cfg"]
    act = "quick_gelu" if model_cfg.get("quick_gelu") else "gelu"
    vw, tw = v["width"], t.get("width", 512)
    return {
        "architectures": ["CLIPModel"], "model_type": "clip", "projection_dim": model_cfg["embed_dim"],
        "text_config": {"hidden_size": tw, "intermediate_size": int(tw * t.get("mlp_ratio", 4.0)),
                        "num_attention_heads": t.get("heads", 8), "num_hidden_layers": t.get("layers", 12),
                        "max_position_embeddings": t.get("context_length", 77),
                        "vocab_size": t.get("vocab_size", 49408), "hidden_act": act, "layer_norm_eps": 1e-5,
                        "projection_dim": model_cfg["embed_dim"], "eos_token_id": 2},
        "vision_config": {"hidden_size": vw, "intermediate_size": int(vw * v.get("mlp_ratio", 4.0)),
                          "num_attention_heads": vw // v.get("head_width", 64),
                          "num_hidden_layers": v["layers"], "image_size": v["image_size"],
                          "patch_size": v["patch_size"], "hidden_act": act, "layer_norm_eps": 1e-5},
    }


def hf_to_open_clip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename (and stack / transpose) HF CLIPModel tensors to open_clip CLIP keys.

    Keys it does not know pass through unchanged, so the loader's key check names them.
    """
    top = {hf: (oc, tr) for hf, oc, tr in _TOP}
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}  # (block prefix, weight|bias) -> {q, k, v}
    for k, v in sd.items():
        if k in _DROP:
            continue
        if k in top:
            name, transpose = top[k]
            out[name] = v.t().contiguous() if transpose else v
            continue
        m = _QKV.match(k)
        if m:
            qkv.setdefault((m["block"], m["kind"]), {})[m["p"]] = v
            continue
        out[_rename_block(k)] = v
    for (block, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise KeyError(f"HF CLIP: {block}self_attn has {sorted(parts)} {kind} projections, need q, k and v")
        out[_rename_block(block) + f"attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def _rename_block(k: str) -> str:
    for hf_prefix, oc_prefix in _TOWERS:
        if k.startswith(hf_prefix):
            rest = k[len(hf_prefix):]
            for a, b in _BLOCK:
                rest = rest.replace(a, b, 1) if a in rest else rest
            return oc_prefix + rest
    return k


def open_clip_to_hf(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_open_clip`, for plain ViT CLIP state dicts (test fixtures)."""
    top = {oc: (hf, tr) for hf, oc, tr in _TOP}
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k in top:
            name, transpose = top[k]
            out[name] = v.t().contiguous() if transpose else v
            continue
        for hf_prefix, oc_prefix in sorted(_TOWERS, key=lambda p: -len(p[1])):  # visual.* before plain
            if k.startswith(oc_prefix):
                rest = k[len(oc_prefix):]
                block, _, tail = rest.partition(".")
                if tail.startswith("attn.in_proj_"):
                    kind = tail.rsplit("_", 1)[1]
                    for p, part in zip("qkv", v.chunk(3)):
                        out[f"{hf_prefix}{block}.self_attn.{p}_proj.{kind}"] = part.contiguous()
                    break
                for a, b in _BLOCK:
                    tail = tail.replace(b, a, 1) if tail.startswith(b) else tail
                out[f"{hf_prefix}{block}.{tail}"] = v
                break
        else:
            raise KeyError(f"open_clip_to_hf: no HF name for {k!r}")
    return out

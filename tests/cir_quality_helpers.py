"""Shared pieces of the retrieval-quality tests: an index with a Pic2Word mapping, text bank
and DBA rows, built once per session through scripts/build.sh on the generated corpus."""
from __future__ import annotations

import functools

from cir_helpers import build_args, script, workspace

# small, fast training settings for the tiny CLIP (defaults are sized for ~125k images on a GPU)
P2W_ARGS = ("--mapping", "pic2word", "--p2w-steps", "120", "--p2w-batch-size", "64", "--p2w-lr", "1e-3",
            "--p2w-ckpt-every", "20", "--p2w-hidden", "128", "--dba", "3")


@functools.cache
def p2w_index():
    """The quality index (recorded method pic2word), built once; returns its folder."""
    d = workspace() / "index-p2w"
    r = script("build.sh", *build_args(d, *P2W_ARGS, "--method", "pic2word"))
    assert r.returncode == 0, r.stderr[-3000:]
    (workspace() / "build-p2w.stderr").write_text(r.stderr)
    return d

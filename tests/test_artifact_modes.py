"""An artifact is readable by whoever may read its folder: a build as root under a private umask
(or a backend that writes its weights 0600) must not lock out the non-root user that runs it."""
from __future__ import annotations

import os
import stat

from conftest import tiny_spec

from engine.io import share_tree_like_root


def _modes(root) -> dict[str, int]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def test_a_tree_gets_its_roots_read_access(tmp_path):
    root = tmp_path / "art"
    (root / "sub").mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(root / "sub", 0o700)
    (root / "weights.bin").write_bytes(b"w")
    os.chmod(root / "weights.bin", 0o600)
    (root / "sub" / "kernel.so").write_bytes(b"k")
    os.chmod(root / "sub" / "kernel.so", 0o700)
    outside = tmp_path / "outside"
    outside.write_bytes(b"o")
    os.chmod(outside, 0o600)
    (root / "link").symlink_to(outside)
    share_tree_like_root(root)
    modes = _modes(root)
    assert modes["sub"] == 0o755 and modes["weights.bin"] == 0o644 and modes["sub/kernel.so"] == 0o755
    assert stat.S_IMODE(outside.stat().st_mode) == 0o600       # a link's target is not the tree's


def test_an_artifact_built_under_umask_077_is_0644_files_and_0755_folders(tmp_path, tiny_checkpoint):
    from engine.tuning import build

    out = tmp_path / "artifact"
    old = os.umask(0o077)
    try:
        build(tiny_spec(), tiny_checkpoint, out, backend="eager", device="cpu")
    finally:
        os.umask(old)
    modes = _modes(out)
    assert "weights.safetensors" in modes and stat.S_IMODE(out.stat().st_mode) == 0o755
    for rel, mode in modes.items():
        want = 0o755 if (out / rel).is_dir() else 0o644
        assert mode == want, f"{rel}: {oct(mode)}"

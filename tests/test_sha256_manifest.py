""".provd.json manifests: write, verify (changed / missing / extra), package and re-verify."""

from __future__ import annotations

import json
import tarfile

import pytest

from evaluator.evidence import campaign, sha256_manifest


@pytest.fixture
def folder(tmp_path):
    """A small evidence folder with a manifest."""
    root = tmp_path / "evidence"
    (root / "runs" / "run-01").mkdir(parents=True)
    (root / "disclosure.json").write_text(json.dumps({"schema": "x"}))
    (root / "report.html").write_text("<html></html>")
    (root / "runs" / "run-01" / "predictions.i32").write_bytes(bytes(range(16)))
    sha256_manifest.write_manifest(root, {"sha": "a" * 40, "dirty": False},
                         {"disclosure.json": "disclosure", "report.html": "report"})
    return root


def verify_cli(root, capsys) -> tuple[int, str]:
    rc = campaign.main(["verify", str(root / sha256_manifest.MANIFEST_NAME)])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


def test_manifest_fields(folder):
    m = json.loads((folder / sha256_manifest.MANIFEST_NAME).read_text())
    assert m["integrity"] == "unauthenticated digest"
    assert m["git"] == {"sha": "a" * 40, "dirty": False}
    entries = {e["path"]: e for e in m["files"]}
    assert set(entries) == {"disclosure.json", "report.html", "runs/run-01/predictions.i32"}
    assert entries["runs/run-01/predictions.i32"]["bytes"] == 16
    assert entries["report.html"]["sha256"] == sha256_manifest.sha256_file(folder / "report.html")
    assert entries["disclosure.json"]["role"] == "disclosure"


def test_verify_passes_on_originals(folder, capsys):
    rc, text = verify_cli(folder, capsys)
    assert rc == 0 and "3 files" in text
    assert "signature" not in text.lower()
    assert "signature" not in (folder / sha256_manifest.MANIFEST_NAME).read_text().lower()


def test_tampered_byte_fails_naming_the_file(folder, capsys):
    path = folder / "runs" / "run-01" / "predictions.i32"
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF  # same size, different bytes
    path.write_bytes(bytes(data))
    rc, text = verify_cli(folder, capsys)
    assert rc == 1 and "runs/run-01/predictions.i32: changed" in text
    assert "signature" not in text.lower()


def test_missing_file_fails(folder, capsys):
    (folder / "report.html").unlink()
    rc, text = verify_cli(folder, capsys)
    assert rc == 1 and "report.html: missing" in text


def test_extra_file_fails(folder, capsys):
    (folder / "runs" / "notes.txt").write_text("added later")
    rc, text = verify_cli(folder, capsys)
    assert rc == 1 and "runs/notes.txt: extra file not in the manifest" in text


def test_path_escaping_the_folder_is_refused(folder):
    m = json.loads((folder / sha256_manifest.MANIFEST_NAME).read_text())
    m["files"].append({"path": "../outside", "sha256": "0" * 64, "bytes": 0})
    (folder / sha256_manifest.MANIFEST_NAME).write_text(json.dumps(m))
    result = sha256_manifest.verify(folder / sha256_manifest.MANIFEST_NAME)
    assert not result.ok and any("'../outside'" in p for p in result.problems)


def test_package_extract_elsewhere_verifies(folder, tmp_path, capsys):
    archive = tmp_path / "pack" / "evidence.tar.gz"
    archive.parent.mkdir()
    assert campaign.main(["package", str(folder), "--out", str(archive)]) == 0
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert f"evidence/{sha256_manifest.MANIFEST_NAME}" in names and all(n.startswith("evidence/") for n in names)
    elsewhere = sha256_manifest.extract(archive, tmp_path / "elsewhere")
    rc, text = verify_cli(elsewhere, capsys)
    assert rc == 0, text
    # Reproducible archive: packing again gives the same bytes.
    again = tmp_path / "pack" / "again.tar.gz"
    sha256_manifest.package(folder, again)
    assert again.read_bytes() == archive.read_bytes()


def test_package_refuses_a_folder_that_does_not_verify(folder, tmp_path, capsys):
    (folder / "extra.bin").write_bytes(b"x")
    assert campaign.main(["package", str(folder), "--out", str(tmp_path / "e.tar.gz")]) == 1
    assert not (tmp_path / "e.tar.gz").exists()
    assert "extra.bin" in capsys.readouterr().err


def test_package_refuses_archive_inside_folder(folder):
    with pytest.raises(ValueError, match="outside the folder"):
        sha256_manifest.package(folder, folder / "self.tar.gz")


def test_tree_digest_changes_with_any_file(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"2")
    before = sha256_manifest.tree_digest(tmp_path)
    assert set(before["files"]) == {"a", "sub/b"}
    (tmp_path / "sub" / "b").write_bytes(b"3")
    assert sha256_manifest.tree_digest(tmp_path)["sha256"] != before["sha256"]

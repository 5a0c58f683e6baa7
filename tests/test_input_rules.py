"""The input readers' limits at their boundaries (the manifest's size cap, path resolution):
cases the mutation run found no test for."""
from __future__ import annotations

import pytest

from evaluator.contest.manifest import ManifestError, read_manifest


def test_a_manifest_over_the_size_limit_is_refused_before_a_byte_is_read(tmp_path):
    """A sparse file one byte over 1 GiB: refused on its size alone, the limit named."""
    path = tmp_path / "huge.tsv"
    with open(path, "wb") as f:
        f.truncate((1 << 30) + 1)
    with pytest.raises(ManifestError) as e:
        read_manifest(path)
    assert f"has {(1 << 30) + 1} bytes, above the limit of {1 << 30} (the manifest limit)" in str(e.value)

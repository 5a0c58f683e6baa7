"""Memory benchmark: the peak RSS of a run follows the read-ahead byte budget, not the file size.

    python -m pytest tests/bench/test_bench_memory.py --benchmark-enable -s

64 rows naming one JPEG grown to 50 KB, 8, 32 and 63 MiB (APP15 padding: the same small image
to decode), through scripts/run with the null backend and the isolated DALI decoder. Prints one
JSON line per size with the report's `peak_rss_mib` (the run's process, the decoder child) and
checks that the peak grows by at most 3 budgets from the smallest file to the largest: the
batch handed to the decoder (one budget), the files read ahead (one budget plus one file per
read in flight), and the decoder's copy of its batch. Runs only with --benchmark-enable (four
runs of 64 rows, ~1-2 minutes on 2 cores).
"""
from __future__ import annotations

import json
import sys

import pytest
from test_decoder_memory import _null_artifact, run_rows_of_one_file

SIZES = (50_000, 8 << 20, 32 << 20, 63 << 20)
BUDGET = 256 << 20          # ENGINE_READAHEAD_BYTES's default, set explicitly


@pytest.mark.slow
def test_bench_peak_rss_is_flat_with_file_size(request, tmp_path):
    opt = request.config.getoption
    if opt("benchmark_disable", True) and not opt("benchmark_enable", False):
        pytest.skip("a benchmark: runs with --benchmark-enable")
    art = _null_artifact(tmp_path / "artifact")
    peaks = {}
    for size in SIZES:
        rep = run_rows_of_one_file(tmp_path, size, 64, art, ENGINE_READAHEAD_BYTES=str(BUDGET))
        assert rep["failed"] == 0
        peaks[size] = rep["peak_rss_mib"]
        print(json.dumps({"file_bytes": size, "rows": 64, "readahead_bytes": BUDGET,
                          "peak_rss_mib": peaks[size]}), file=sys.stderr)
    for who in ("process", "children"):
        grew = peaks[SIZES[-1]][who] - peaks[SIZES[0]][who]
        assert grew <= 3 * BUDGET / 2**20, (who, peaks)

"""The campaign's workloads, one module each, with the same functions (MLPerf's SUPPORTED_DATASETS):

    WORKLOAD                      the Workload record (id, roles, ABI, gate, rule, real inputs)
    prepare(args, tmp)            -> runs.Prepared: inputs, dataset record, judge, digests, copies, run
    aggregate_reasons(ok_runs)    why the valid runs together fail the gate ([] when they pass)
    requested_device(manifest)    the device the runs must execute on, or None
    disclosure_parts(facts, promoted)   quality, model, device, configuration and runs of the disclosure
"""
from __future__ import annotations

from types import ModuleType

from evaluator.evidence.runs import Workload
from evaluator.evidence.workloads import cir, eva02

MODULES: dict[str, ModuleType] = {m.WORKLOAD.workload_id: m for m in (eva02, cir)}
WORKLOADS: dict[str, Workload] = {name: m.WORKLOAD for name, m in MODULES.items()}

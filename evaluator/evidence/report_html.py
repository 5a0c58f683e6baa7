"""HTML report of a campaign, rendered from its disclosure JSON only.

One self-contained page: no JavaScript, no network, no external fonts or CSS. Inline
SVG draws the N run times and each run's stage breakdown (and the decode/inference
timeline when the timing report carries one). Rendering is deterministic: the same
JSON gives the same bytes.
"""

from __future__ import annotations

import json
from html import escape

# Stacked in this order. With a "pipeline" stage (the overlapped read/decode/inference wall),
# the bar is imports + artifact_load + pipeline + write: parts that do not overlap.
# setup/query: scripts/run.sh's summary (cir-retrieval: imports + model + index load, then queries).
STAGES = ("imports", "artifact_load", "setup", "read", "decode", "inference", "query", "write", "other")
PIPELINED = ("imports", "artifact_load", "pipeline", "write", "other")
COLORS = {"imports": "#8c6bb1", "artifact_load": "#6a51a3", "setup": "#9c755f", "read": "#edc948",
          "decode": "#f28e2b", "inference": "#4e79a7", "query": "#e15759", "pipeline": "#76b7b2",
          "write": "#59a14f", "other": "#bab0ac"}
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px;margin:0 0 6px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd;padding-bottom:3px}
table{border-collapse:collapse;font-size:13px;margin:4px 0} td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4} td.num{text-align:right;font-variant-numeric:tabular-nums}
code,pre{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px} pre{background:#f7f7f7;padding:8px;overflow:auto}
.badge{display:inline-block;padding:3px 10px;border-radius:4px;font-weight:600;color:#fff}
.promoted{background:#2e7d32} .not-promoted{background:#c62828} .not-promotable{background:#757575}
.notice{background:#fff8e1;border:1px solid #ffe082;padding:8px;font-size:13px} .muted{color:#666;font-size:12px}
svg text{font-family:system-ui,Helvetica,Arial,sans-serif}
"""


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}g}" if abs(v) < 1e-3 else f"{v:.{digits}f}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x, digits) for x in v)
    return str(v)


def _table(rows: list[tuple[str, object]]) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(_fmt(v))}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _grid(header: list[str], rows: list[list[object]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="{"num" if isinstance(c, (int, float)) else ""}">{escape(_fmt(c))}</td>'
                         for c in row) + "</tr>"
        for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def runs_svg(runs: list[dict], median: float | None) -> str:
    """Bar chart of the wall seconds of each valid run, median dashed."""
    if not runs:
        return '<p class="muted">No valid run: nothing to plot.</p>'
    w, h, left, right, bottom, top = 660, 240, 56, 110, 34, 16
    vmax = max(r["wall_s"] for r in runs) * 1.12
    bw = (w - left - right) / len(runs)
    y = lambda v: top + (h - top - bottom) * (1 - v / vmax)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
             f'aria-label="wall seconds per run">']
    for i in range(5):  # y grid at 0, 1/4 .. 4/4 of the range
        v = vmax * i / 4
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#eee"/>'
                     f'<text x="{left - 6}" y="{y(v) + 4:.1f}" font-size="11" text-anchor="end">{v:.3g}</text>')
    for i, r in enumerate(runs):
        x = left + i * bw + bw * 0.15
        parts.append(f'<rect x="{x:.1f}" y="{y(r["wall_s"]):.1f}" width="{bw * 0.7:.1f}" '
                     f'height="{y(0) - y(r["wall_s"]):.1f}" fill="#4e79a7"><title>run {r["index"]}: '
                     f'{r["wall_s"]:.4f} s</title></rect>'
                     f'<text x="{x + bw * 0.35:.1f}" y="{y(r["wall_s"]) - 4:.1f}" font-size="11" '
                     f'text-anchor="middle">{r["wall_s"]:.3f}</text>'
                     f'<text x="{x + bw * 0.35:.1f}" y="{h - bottom + 15}" font-size="11" '
                     f'text-anchor="middle">run {r["index"]}</text>')
    if median is not None:
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y(median):.1f}" y2="{y(median):.1f}" '
                     f'stroke="#c62828" stroke-dasharray="5,4"/><text x="{w - right + 4}" y="{y(median) + 4:.1f}" '
                     f'font-size="11" fill="#c62828">median {median:.3f} s</text>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{y(0):.1f}" stroke="#555"/>'
                 f'<line x1="{left}" x2="{w - right}" y1="{y(0):.1f}" y2="{y(0):.1f}" stroke="#555"/>'
                 f'<text x="14" y="{(top + y(0)) / 2:.0f}" font-size="11" transform="rotate(-90 14 '
                 f'{(top + y(0)) / 2:.0f})" text-anchor="middle">wall seconds</text></svg>')
    return "".join(parts)


def stage_parts(stages: dict | None) -> list[tuple[str, float]]:
    """(stage, seconds) in STAGES (or PIPELINED) order; 'other' = total minus the parts when positive."""
    stages = stages or {}
    order = PIPELINED if isinstance(stages.get("pipeline"), (int, float)) else STAGES
    parts = [(s, float(stages[s])) for s in order[:-1] if isinstance(stages.get(s), (int, float))]
    total = stages.get("total")
    if isinstance(total, (int, float)) and total - sum(v for _, v in parts) > 0:
        parts.append(("other", total - sum(v for _, v in parts)))
    return parts


def stages_svg(runs: list[dict]) -> str:
    """One stacked bar per run of the process's own stage times, with the outside wall time marked."""
    rows = [(r, stage_parts(r["timing_report"].get("stages"))) for r in runs]
    rows = [(r, p) for r, p in rows if p]
    if not rows:
        return '<p class="muted">No stage breakdown in the timing reports.</p>'
    w, left, bar, gap = 900, 70, 20, 10
    scale_max = max(max(sum(v for _, v in p), r["wall_s"]) for r, p in rows) * 1.05
    h = 30 + len(rows) * (bar + gap) + 30
    sx = lambda v: left + (w - left - 20) * v / scale_max  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" role="img" '
           f'aria-label="stage breakdown per run">']
    for i, (r, parts) in enumerate(rows):
        yy, x = 20 + i * (bar + gap), 0.0
        out.append(f'<text x="{left - 8}" y="{yy + 14}" font-size="11" text-anchor="end">run {r["index"]}</text>')
        st = r["timing_report"]["stages"]
        busy = ", ".join(f"{k} {st[k]:.3f} s" for k in ("read", "decode", "inference")
                         if isinstance(st.get(k), (int, float)))
        for stage, v in parts:
            note = f" (busy: {busy})" if stage == "pipeline" and busy else ""
            out.append(f'<rect x="{sx(x):.1f}" y="{yy}" width="{max(sx(x + v) - sx(x), 0.5):.1f}" height="{bar}" '
                       f'fill="{COLORS[stage]}"><title>{stage}: {v:.4f} s{note}</title></rect>')
            x += v
        total = r["timing_report"]["stages"].get("total")
        if isinstance(total, (int, float)):
            out.append(f'<line x1="{sx(total):.1f}" x2="{sx(total):.1f}" y1="{yy - 3}" y2="{yy + bar + 3}" '
                       f'stroke="#666" stroke-width="2" stroke-dasharray="3,2"><title>process total: '
                       f'{total:.4f} s</title></line>')
        out.append(f'<line x1="{sx(r["wall_s"]):.1f}" x2="{sx(r["wall_s"]):.1f}" y1="{yy - 3}" '
                   f'y2="{yy + bar + 3}" stroke="#000" stroke-width="2"><title>wall (outside): '
                   f'{r["wall_s"]:.4f} s</title></line>')
    ly = h - 14
    shown = [st for st in COLORS if any(st == name for _, p in rows for name, _ in p)]
    for j, stage in enumerate(shown):
        out.append(f'<rect x="{left + j * 95}" y="{ly - 9}" width="10" height="10" fill="{COLORS[stage]}"/>'
                   f'<text x="{left + j * 95 + 14}" y="{ly}" font-size="11">{stage}</text>')
    for k, (label, color, dash) in enumerate([("process total", "#666", "3,2"), ("wall (outside)", "#000", "")]):
        x = left + len(shown) * 95 + k * 120
        out.append(f'<line x1="{x}" x2="{x}" y1="{ly - 10}" y2="{ly + 2}" stroke="{color}" stroke-width="2" '
                   f'stroke-dasharray="{dash or "none"}"/><text x="{x + 6}" y="{ly}" font-size="11">{label}</text>')
    out.append("</svg>")
    overlap = any(sum(v for _, v in p) > (r["timing_report"]["stages"].get("total") or float("inf")) + 1e-9
                  for r, p in rows)
    note = ('<p class="muted">Decode and inference overlap (pipelined), so a stacked bar can extend past the '
            'process total; the timeline below shows the overlap.</p>') if overlap else ""
    return "".join(out) + note


def timeline_svg(run: dict) -> str:
    """Decode vs inference intervals of one run, relative to process start (two lanes)."""
    tl = [e for e in run["timing_report"].get("timeline") or []
          if isinstance(e, dict) and isinstance(e.get("start"), (int, float)) and isinstance(e.get("end"), (int, float))]
    if not tl:
        return ""
    lanes = sorted({str(e.get("stage")) for e in tl}, key=lambda st: (list(COLORS).index(st) if st in COLORS else 99, st))
    w, left, lane = 760, 80, 16
    end = max([float(e["end"]) for e in tl] + [run["wall_s"]])
    sx = lambda v: left + (w - left - 20) * v / end  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{len(lanes) * (lane + 4) + 36}" '
           f'role="img" aria-label="timeline of run {run["index"]}">']
    for k, stage in enumerate(lanes):
        y0 = 6 + k * (lane + 4)
        out.append(f'<text x="{left - 8}" y="{y0 + 12}" font-size="11" text-anchor="end">{escape(stage)}</text>')
        for e in (e for e in tl if str(e.get("stage")) == stage):
            s, t = float(e["start"]), float(e["end"])
            out.append(f'<rect x="{sx(s):.1f}" y="{y0}" width="{max(sx(t) - sx(s), 0.5):.1f}" height="{lane}" '
                       f'fill="{COLORS.get(stage, "#999")}" stroke="#fff" stroke-width="0.5"><title>'
                       f'{escape(stage)} batch {escape(str(e.get("batch")))}: {s:.3f}-{t:.3f} s</title></rect>')
    ya = len(lanes) * (lane + 4) + 14
    out.append(f'<line x1="{left}" x2="{w - 20}" y1="{ya}" y2="{ya}" stroke="#555"/>')
    for i in range(5):
        v = end * i / 4
        out.append(f'<text x="{sx(v):.1f}" y="{ya + 13}" font-size="10" text-anchor="middle">{v:.3g} s</text>')
    out.append("</svg>")
    return f'<div><span class="muted">run {run["index"]}</span><br>{"".join(out)}</div>'


def quality_rows(q: dict) -> list[tuple[str, object]]:
    """Result-table rows of the quality block: agreement (eva02) or raw retrieval quality (cir), every
    figure carrying the block's label (functional check / quality result / not a result)."""
    label = q.get("label") or ("quality result" if q["shown_as_quality"] else "not shown as quality")
    passed = "passed" if q["gate_passed"] else "failed"
    aggregate = _fmt(q.get("aggregate"))
    if q["metric"] == "agreement":
        gate = ((f"agreement aggregate ({label}) / gate", f"{aggregate} / {q['gate']:.0%} ({passed})")
                if "aggregate" in q else ("gate", f"{q['gate']:.0%} of the rows: {passed}; invalid attempt, "
                                                  "no aggregate"))
        return [(f"agreement ({label})", q["values"]), gate, ("gate counts", q.get("gate_rows"))]
    rows = [(f"{q['metric']} ({label})", q["values"]), (f"reward ({label})", q.get("rewards")),
            ("reward map", q.get("reward_mapping"))]
    if "aggregate" in q:
        rows.append((f"{q['metric']} median ({label}) / identical across runs",
                     f"{aggregate} / {_fmt(q.get('identical_across_runs'))}"))
    return rows + [("quality note", q.get("note") or q.get("raw_note")), ("gate", f"{passed}: {q['gate']}")]


def runs_grid(doc: dict) -> str:
    """One table row per valid run: outside wall, the process's own total, throughput, quality (labelled)."""
    def total(r: dict):
        t = (r["timing_report"].get("stages") or {}).get("total")
        return t if isinstance(t, (int, float)) else None

    # outside - total: what the process cannot time itself (exec before its clock, interpreter exit)
    walls = [[r["index"], r["wall_s"], total(r), r["wall_s"] - total(r) if total(r) is not None else None]
             for r in doc["runs"]]
    head = ["run", "wall s (outside)", "process total s", "outside - total s"]
    label = doc["quality"].get("label", "")
    if doc["quality"]["metric"] == "agreement":
        return _grid(head + ["images/s", "matches", "rows", f"agreement ({label})", "device", "backend"],
                     [w + [r["timing_report"].get("images_per_s"), r["quality"]["matches"], r["quality"]["rows"],
                           r["quality"]["agreement"], r["timing_report"].get("device"),
                           r["timing_report"].get("backend")]
                      for w, r in zip(walls, doc["runs"])])
    metric = doc["quality"]["metric"]
    return _grid(head + ["queries/s", "rows", f"{metric} ({label})", f"reward ({label})", "device", "precision"],
                 [w + [r["timing_report"].get("queries_per_s"), r["quality"]["rows"], r["quality"]["raw"],
                       r["quality"]["reward"], r["timing_report"].get("device"), r["timing_report"].get("precision")]
                  for w, r in zip(walls, doc["runs"])])


def timing_rows(doc: dict) -> list[tuple[str, object]]:
    """The wall-time rows: the statistics of a valid attempt; an invalid one shows its raw values only."""
    pm, att = doc["primary_metric"], doc["attempt"]
    if not att["valid"]:
        return [("attempt valid", f"no: {att.get('reason')}"),
                ("runs (completed / requested)", f"{pm['n']} / {att['runs_requested']}"),
                ("wall seconds: raw values of the runs that completed (invalid attempt)", pm["values"]),
                ("aggregate", "none: an invalid attempt has no aggregate")]
    return [("attempt valid", True),
            ("runs (valid / requested)", f"{pm['n']} / {att['runs_requested']}"),
            ("wall seconds (valid runs)", pm["values"]),
            ("median / min / max (s)", f"{_fmt(pm['median'])} / {_fmt(pm['min'])} / {_fmt(pm['max'])}"),
            ("range / sample stdev (s)", f"{_fmt(pm['range'])} / {_fmt(pm['stdev'])}"),
            ("CV (stdev / mean)", pm["cv"])]


def _json_cell(v) -> object:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else v


def conditions_rows(c: dict) -> list[tuple[str, object]]:
    """Power, sleep, thermal and background load, as measured (or 'not measured')."""
    power, thermal = c["power"], c["thermal"]
    return [("power source (measured)", power["source"]), ("power policy (measured)", _json_cell(power["policy"])),
            ("power (operator, --power)", power["operator"]), ("sleep", c["sleep"]),
            ("CPU thermal throttling", thermal["cpu_throttling"]),
            ("thermal zones before / after", f"{_json_cell(thermal['zones_before'])} / "
                                             f"{_json_cell(thermal['zones_after'])}"),
            ("GPU before / after", f"{_json_cell(thermal['gpu_before'])} / {_json_cell(thermal['gpu_after'])}"),
            ("background load", c["background_load"].get("judgement")),
            ("load average before / after", f"{_fmt(c['background_load'].get('loadavg_before'), 3)} / "
                                            f"{_fmt(c['background_load'].get('loadavg_after'), 3)}")]


def render(doc: dict) -> str:
    """The full HTML page of a disclosure dict."""
    promo, pm = doc["promotion"], doc["primary_metric"]
    valid = doc["attempt"]["valid"]
    badge = "promoted" if promo["promoted"] else promo["status"].split(":")[0]
    reasons = "".join(f"<li>{escape(r)}</li>" for r in promo["reasons"]) or "<li>none</li>"
    runs = doc["runs"]
    failed = doc["failed_runs"]
    timelines = "".join(timeline_svg(r) for r in runs)
    attachments = "".join(
        f"<h3>{escape(a['file'])}</h3>" + _grid(["benchmark", "median s"], [[b["name"], b["median_s"]]
                                                                           for b in a["benchmarks"]])
        for a in doc["attachments"])
    fp = json.dumps(doc["system"]["fingerprint"], indent=2, sort_keys=True)
    rules = _grid(["role", "rule"], [[k, v] for k, v in doc["role_rules"].items()])
    invalid = ('<p class="notice"><b>Invalid attempt</b>: ' + escape(str(doc["attempt"].get("reason"))) +
               ". No aggregate is shown: only the raw values of the runs that completed, labelled.</p>"
               if not valid else "")
    bundle = doc.get("bundle") or {}
    bundle_rows = ([("bundled files", f"{bundle['files']} files, {bundle['bytes']} bytes in {bundle['path']}"
                     if bundle["bundled"] else f"not bundled ({bundle['files']} files, {bundle['bytes']} bytes): "
                                               f"digests in {'campaign.provd.json'}, rebuild with: {bundle['rebuild']}")]
                   if bundle else [("bundled files", "none")])
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Campaign {escape(doc['workload']['id'])} ({escape(doc['profile'])})</title>
<style>{CSS}</style></head><body>
<h1>Evidence campaign: {escape(doc['workload']['id'])} &middot; profile {escape(doc['profile'])}</h1>
<p><span class="badge {escape(badge)}">{escape(promo['status'])}</span>
&nbsp;result role: <b>{escape(doc['result_role'])}</b> <span class="muted">({escape(doc['result_role_rule'])})</span></p>
<p class="notice">{escape(doc['notice'])}</p>
{invalid}
<h2>Promotion</h2><p>Reasons promotion failed:</p><ul>{reasons}</ul>
<h2>Result</h2>
{_table([
    ("workload / roles", f"{doc['workload']['id']} / {', '.join(doc['workload']['roles'])}"),
    ("mode / phase / scenario", f"{doc['mode']} / {doc['phase']} / {doc['scenario']}"),
    ("config note", doc.get("config_note")),
    *timing_rows(doc),
    *quality_rows(doc["quality"]),
])}
<h2>Wall seconds per run{'' if valid else ' (invalid attempt: raw values)'}</h2>{runs_svg(runs, pm.get('median'))}
<h2>Stage breakdown (process's own timing report)</h2>{stages_svg(runs)}
{('<h2>Timeline: decode vs inference (seconds since process start)</h2>' + timelines) if timelines else ''}
<h2>Runs</h2>{runs_grid(doc)}
<h2>Failed runs (never part of the metric values)</h2>
{_grid(["run", "reason", "exit", "timed out"], [[f["index"], f["reason"], f["exit_code"], f["timed_out"]]
                                               for f in failed]) if failed else '<p>none</p>'}
<h2>Dataset and model</h2>
{_table([("dataset mode / split / version",
          f"{doc['dataset'].get('mode')} / {doc['dataset'].get('split')} / {doc['dataset'].get('version')}"),
         ("dataset mode basis", doc["dataset"].get("mode_basis")),
         ("rows", doc["dataset"].get("rows"))]
        + [(f"dataset {k}", _json_cell(v)) for k, v in doc["dataset"].items()
           if k in ("gallery_images", "clip", "preparation", "coverage", "generated_markers", "generated_model")]
        + [(f"sha256 {k}", v) for k, v in doc["digests"]["before"].items()]
        + [(f"model {k}", v) for k, v in doc["model"].items()]
        + [(f"device {k}", v) for k, v in doc["device"].items()]
        + [(f"configuration {k}", v) for k, v in doc["configuration"].items()]
        + [(f"scheduling {k}", _json_cell(v)) for k, v in doc["scheduling"].items()])}
<h2>Evidence</h2>
{_table([("evidence sha256", doc["evidence"].get("sha256")), ("it covers", doc["evidence"].get("covers")),
         *bundle_rows])}
<h2>Conditions</h2>{_table(conditions_rows(doc["conditions"]))}
<h2>System and source</h2>
{_table([("fingerprint sha256 (before / after)",
          f"{doc['system']['fingerprint_sha256']} / {doc['system']['fingerprint_after_sha256']}"),
         ("git SHA / dirty", f"{doc['source']['git_sha']} / {_fmt(doc['source']['dirty'])}"),
         ("started / finished (UTC)", f"{doc['time']['started_utc']} / {doc['time']['finished_utc']}")])}
<details><summary>Comparison fingerprint</summary><pre>{escape(fp)}</pre></details>
{('<h2>Attached benchmarks</h2>' + attachments) if attachments else ''}
<h2>Role rules</h2>{rules}
<p class="muted">Rendered from disclosure.json ({escape(doc['schema'])}); the JSON is authoritative.</p>
</body></html>
"""

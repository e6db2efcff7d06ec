"""The advisor's report as JSON (stable schema, docs/advisor.md), Markdown, or one self-contained
HTML page whose charts are inline SVG (no scripts, nothing fetched)."""

from __future__ import annotations

import html
import json

from .advise import Report

SCHEMA_VERSION = 1
VERDICT_COLOURS = {"recommended": "#1a7f37", "viable": "#0969da", "excluded": "#8c959f"}


def to_json(report: Report) -> str:
    return json.dumps({"schema_version": SCHEMA_VERSION, **report.to_dict()}, indent=2, default=str)


def _fmt(value, digits: int = 1, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{unit}"
    return f"{value:,}{unit}" if isinstance(value, int) else f"{value}{unit}"


def _pair(sim: dict, key: str) -> str:
    """A simulated latency's median and 99th percentile, with the calibrated range on the median."""
    if not sim:
        return "n/a"
    low, high = sim["range"]
    p50, p99 = sim[key]["p50"], sim[key]["p99"]
    if p50 is None:
        return "n/a"
    # A latency is the inverse of a rate: measured / estimated rates of [low, high] put it in [1/high, 1/low].
    return f"{p50:,.1f} ({p50 / high:,.1f}-{p50 / low:,.1f}) / {p99:,.1f}"


def _goodput(sim: dict) -> str:
    if not sim:
        return "n/a"
    g, (low, high) = sim["goodput_requests_per_s"], sim["range"]
    return f"{g:,.2f} ({g * low:,.2f}-{g * high:,.2f})"


def _header(report: Report) -> list[str]:
    m, h, w = report.model, report.hardware, report.workload
    active = f", {m['params_active'] / 1e9:.1f}B active" if m["moe"] else ""
    return [
        f"Model: **{m['id']}** ({m['architecture'] or 'unknown architecture'}, {m['params_total'] / 1e9:.1f}B "
        f"parameters{active}, {m['kv_layout']}, {m['checkpoint_format']} checkpoint)",
        f"Hardware: **{h['gpus']} x {h['name']}** ({h['memory_gib']:g} GiB, {h['bandwidth_gbs']:g} GB/s, "
        f"{_fmt(h['bf16_tflops'], 0)} dense BF16 TFLOPS each)",
        f"Workload: {w['kind']}, {w['prompt_tokens']} prompt + {w['output_tokens']} output tokens, prefix reuse "
        f"{w['prefix_reuse']:.0%}, concurrency {w['concurrency']}"
        + (f", {w['request_rate']:g} req/s" if w["request_rate"] else "")
        + f"; SLO TTFT <= {w['slo_ttft_ms']:g} ms, TPOT <= {w['slo_tpot_ms']:g} ms",
    ]


def to_markdown(report: Report) -> str:
    lines = ["# servegate advise", "", *(f"- {line}" for line in _header(report)), "", f"**{report.summary}**", "",
             *(f"- {note}" for note in report.notes), *([""] if report.notes else [])]
    if report.alternatives:
        lines += ["What would meet the SLO, estimated the same way:", "",
                  "| change | best runtime | goodput req/s | TTFT ms | TPOT ms |", "|---|---|---|---|---|",
                  *(f"| `{a['change']}` | {a['runtime'] or 'none'} | {_fmt(a['goodput_requests_per_s'], 2)} | "
                    f"{_fmt(a['ttft_ms'])} | {_fmt(a['tpot_ms'])} |" for a in report.alternatives), ""]
    lines += ["| rank | runtime | verdict | score | max seqs | weights GiB/device | KV bytes/token | "
             "TTFT ms p50 (range) / p99 | TPOT ms p50 (range) / p99 | goodput req/s (range) | "
             "roofline TTFT / TPOT ms | measured |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for rank, c in enumerate(report.candidates, 1):
        e, mem, sim = c.estimates, c.memory, c.estimates.get("simulated") or {}
        measured = _fmt(c.measured.get("request_goodput"), 2) if c.measured else ""
        lines.append(f"| {rank} | {c.name} {c.version} | {c.verdict} | {c.score:.1f} | {mem['max_sequences']} | "
                     f"{mem['weights_gib']:.1f} | {mem['kv_bytes_per_token']:,.0f} | {_pair(sim, 'ttft_ms')} | "
                     f"{_pair(sim, 'tpot_ms')} | {_goodput(sim)} | {_fmt(e.get('ttft_ms'))} / "
                     f"{_fmt(e.get('tpot_ms'))} | {measured} |")
    for c in report.candidates:
        lines += ["", f"## {c.name}: {c.verdict}", ""]
        for r in c.reasons:
            cell = r["cell"]
            cite = f" _(matrix {cell['path']}: {cell['status']}; {cell['source']}, checked {cell['checked']})_" \
                if cell else ""
            kind = f"{r['kind']} {r['score']:+g}" if r["kind"] == "score" else r["kind"]
            lines.append(f"- [{kind}] `{r['rule']}`: {r['reason']}{cite}")
        if c.estimates.get("replicas_needed", 1) > 1:
            lines.append(f"- {report.workload['request_rate']:g} req/s is beyond one deployment's "
                         f"{c.estimates['capacity_requests_per_s']:.2f} req/s: it needs "
                         f"{c.estimates['replicas_needed']} replicas of this one")
        if c.measured and c.measured.get("off_by"):
            lines.append(f"- measured goodput {c.measured['request_goodput']:.2f} req/s: the estimate was off by "
                         f"{c.measured['off_by']:.0%}" + (" (more than 30%: trust the measurement)"
                                                          if abs(c.measured["off_by"]) > 0.3 else ""))
        for key in ("servegate_command", "runtime_command"):
            if key in c.launch:
                lines.append(f"- {key.replace('_', ' ')}: `{c.launch[key]}`")
        if c.launch.get("gateway_backend"):
            lines.append(f"- gateway backend (servegate.yaml): `{json.dumps(c.launch['gateway_backend'])}`")
        if c.launch.get("note"):
            lines.append(f"- launch: {c.launch['note']}")
    a = report.assumptions
    lines += ["", "## Assumptions", "",
              f"- Roofline derates: bandwidth x{a['bandwidth']}"
              f"{' (measured on this machine)' if report.hardware.get('measured') else ''}, "
              f"prefill compute x{a['prefill_compute']}, decode "
              f"compute x{a['decode_compute']} (override with --derate-*).",
              f"- Reserved memory: {a['reserved']}.",
              "- TTFT, TPOT and goodput are each runtime's scheduler simulated over this workload (advisor/perf); "
              "the ranges are the calibration's 10th-90th percentile of measured / estimated in the estimate's "
              "regimes (`servegate advise --calibration`). The roofline columns are the single-formula bound "
              "`--calibrate` corrects. Confirm with `--measure`."]
    return "\n".join(lines) + "\n"


def _bars(title: str, rows: list[tuple[str, list[tuple[float, str, str]]]], unit: str) -> str:
    """A horizontal (stacked) bar chart as inline SVG: rows of (label, [(value, colour, part)])."""
    width, label_w, bar_h, gap = 760, 210, 22, 8
    top = max((sum(v for v, _, _ in parts) for _, parts in rows), default=0) or 1
    height = 40 + len(rows) * (bar_h + gap) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="{html.escape(title)}"><text x="0" y="20" font-size="15" font-weight="bold">'
           f'{html.escape(title)}</text>']
    for i, (label, parts) in enumerate(rows):
        y, x = 36 + i * (bar_h + gap), float(label_w)
        out.append(f'<text x="0" y="{y + 16}" font-size="13">{html.escape(label)}</text>')
        for value, colour, part in parts:
            w = (width - label_w - 90) * value / top
            out.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="{bar_h}" fill="{colour}">'
                       f'<title>{html.escape(part)}: {value:,.2f} {unit}</title></rect>')
            x += w
        total = sum(v for v, _, _ in parts)
        out.append(f'<text x="{x + 6:.1f}" y="{y + 16}" font-size="12">{total:,.1f} {unit}</text>')
    legend = {part: colour for _, parts in rows for _, colour, part in parts}
    for j, (part, colour) in enumerate(legend.items()):
        lx = label_w + j * 150
        out.append(f'<rect x="{lx}" y="{height - 20}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{lx + 16}" y="{height - 10}" font-size="12">{html.escape(part)}</text>')
    return "".join(out) + "</svg>"


def to_html(report: Report) -> str:
    memory = [(c.name, [(c.memory["weights_gib"], "#6e40c9", "weights"), (c.memory["reserved_gib"], "#bf8700",
                                                                           "reserved"),
                        (c.memory["kv_budget_gib"], "#1a7f37", "KV cache budget")]) for c in report.candidates]
    viable = [c for c in report.candidates if c.verdict != "excluded"]
    goodput = [(c.name, [((c.estimates.get("simulated") or c.estimates).get("goodput_requests_per_s") or 0.0,
                          VERDICT_COLOURS[c.verdict], "estimated goodput")]) for c in viable]
    measured = [(c.name, [(c.measured.get("request_goodput") or 0.0, "#cf222e", "measured goodput")])
                for c in viable if c.measured]
    charts = [_bars("Memory per device (GiB)", memory, "GiB")]
    if goodput:
        charts.append(_bars("Estimated goodput within the SLO (requests/s)", goodput, "req/s"))
    if measured:
        charts.append(_bars("Measured goodput (servegate bench, requests/s)", measured, "req/s"))
    rows = "".join(
        f"<tr><td>{i}</td><td>{html.escape(c.name)} {html.escape(c.version)}</td>"
        f'<td style="color:{VERDICT_COLOURS[c.verdict]};font-weight:bold">{c.verdict}</td><td>{c.score:.1f}</td>'
        f"<td>{c.memory['max_sequences']}</td><td>{_pair(c.estimates.get('simulated') or {}, 'ttft_ms')}</td>"
        f"<td>{_pair(c.estimates.get('simulated') or {}, 'tpot_ms')}</td>"
        f"<td>{_goodput(c.estimates.get('simulated') or {})}</td>"
        "<td><ul>" + "".join(
            f"<li><b>{r['kind']}</b> <code>{html.escape(r['rule'])}</code>: {html.escape(r['reason'])}"
            + (f" <small>({html.escape(str(r['cell']['path']))}: {html.escape(r['cell']['status'])}; "
               f"{html.escape(r['cell']['source'])})</small>"
               if r["cell"] else "") + "</li>" for r in c.reasons) + "</ul>"
        + "".join(f"<code>{html.escape(c.launch[k])}</code><br>" for k in ("servegate_command", "runtime_command")
                  if k in c.launch) + "</td></tr>"
        for i, c in enumerate(report.candidates, 1))
    header = "".join(f"<li>{html.escape(line).replace('**', '')}</li>" for line in _header(report))
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>servegate advise</title>
<style>body{{font-family:system-ui,sans-serif;margin:24px;color:#1f2328}}table{{border-collapse:collapse}}
td,th{{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top;font-size:13px}}svg{{display:block;margin:16px 0}}
code{{font-size:12px}}</style></head><body><h1>servegate advise</h1><ul>{header}</ul>
<p><b>{html.escape(report.summary)}</b></p>{''.join(charts)}
<table><tr><th>#</th><th>runtime</th><th>verdict</th><th>score</th><th>max seqs</th><th>TTFT ms p50 (range) / p99</th>
<th>TPOT ms p50 (range) / p99</th><th>goodput req/s (range)</th><th>why, and how to start it</th></tr>{rows}</table>
</body></html>
"""

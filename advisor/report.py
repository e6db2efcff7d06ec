"""The advisor's report as JSON (stable schema, docs/advisor.md), Markdown, or one self-contained
HTML page whose charts are inline SVG (no scripts, nothing fetched)."""

from __future__ import annotations

import html
import json
import re

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


RANKING = ("rank", "runtime", "verdict", "score", "max seqs", "weights GiB/device", "KV bytes/token",
           "TTFT ms p50 (range) / p99", "TPOT ms p50 (range) / p99", "goodput req/s (range)",
           "roofline TTFT / TPOT ms", "measured")
ALTERNATIVES = ("change", "best runtime", "goodput req/s", "TTFT ms", "TPOT ms")


def _ranking(report: Report) -> list[list[str]]:
    rows = []
    for rank, c in enumerate(report.candidates, 1):
        e, mem, sim = c.estimates, c.memory, c.estimates.get("simulated") or {}
        rows.append([str(rank), f"{c.name} {c.version}", c.verdict, f"{c.score:.1f}", str(mem["max_sequences"]),
                     f"{mem['weights_gib']:.1f}", f"{mem['kv_bytes_per_token']:,.0f}", _pair(sim, "ttft_ms"),
                     _pair(sim, "tpot_ms"), _goodput(sim), f"{_fmt(e.get('ttft_ms'))} / {_fmt(e.get('tpot_ms'))}",
                     _fmt(c.measured.get("request_goodput"), 2) if c.measured else ""])
    return rows


def _alternatives(report: Report) -> list[list[str]]:
    return [[f"`{a['change']}`", a["runtime"] or "none", _fmt(a["goodput_requests_per_s"], 2), _fmt(a["ttft_ms"]),
             _fmt(a["tpot_ms"])] for a in report.alternatives]


def _details(report: Report, c) -> list[str]:
    """Why a candidate stands where it does (each rule with the matrix cell it cites, and the code
    line that decides that cell), and how to start it. `code` in backticks."""
    lines = []
    for r in c.reasons:
        cell = r["cell"]
        cite = (f" _(matrix {cell['path']}: {cell['status']}; {cell['source']}, checked {cell['checked']}"
                + (f"; code: {cell['line']}" if cell.get("line") else "") + ")_") if cell else ""
        kind = f"{r['kind']} {r['score']:+g}" if r["kind"] == "score" else r["kind"]
        lines.append(f"[{kind}] `{r['rule']}`: {r['reason']}{cite}")
    if c.estimates.get("replicas_needed", 1) > 1:
        lines.append(f"{report.workload['request_rate']:g} req/s is beyond one deployment's "
                     f"{c.estimates['capacity_requests_per_s']:.2f} req/s: it needs "
                     f"{c.estimates['replicas_needed']} replicas of this one")
    if c.measured and c.measured.get("off_by"):
        lines.append(f"measured goodput {c.measured['request_goodput']:.2f} req/s: the estimate was off by "
                     f"{c.measured['off_by']:.0%}" + (" (more than 30%: trust the measurement)"
                                                      if abs(c.measured["off_by"]) > 0.3 else ""))
    for key in ("servegate_command", "runtime_command"):
        if key in c.launch:
            lines.append(f"{key.replace('_', ' ')}: `{c.launch[key]}`")
    if c.launch.get("gateway_backend"):
        lines.append(f"gateway backend (servegate.yaml): `{json.dumps(c.launch['gateway_backend'])}`")
    lines += [f"launch: {c.launch[key]}" for key in ("note", "context_note", "lora_note") if c.launch.get(key)]
    return lines


def _assumptions(report: Report) -> list[str]:
    a = report.assumptions
    return [f"Roofline derates: bandwidth x{a['bandwidth']}"
            f"{' (measured on this machine)' if report.hardware.get('measured') else ''}, "
            f"prefill compute x{a['prefill_compute']}, decode "
            f"compute x{a['decode_compute']} (override with --derate-*).",
            f"Reserved memory: {a['reserved']}.",
            *([f"Calibration: {a['calibration']}."] if a.get("calibration") else []),
            "TTFT, TPOT and goodput are each runtime's scheduler simulated over this workload (advisor/perf); "
            "the ranges are the calibration's 10th-90th percentile of measured / estimated in the estimate's "
            "regimes (`servegate advise --calibration`). The roofline columns are the single-formula bound "
            "`--calibrate` corrects. Runtimes rank by score: the rules' points plus goodput scaled to the best "
            "(3 points) and features; goodput ranges that overlap are a tie. Confirm with `--measure`."]


def to_markdown(report: Report) -> str:
    def table(columns, rows):
        return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
                *("| " + " | ".join(row) + " |" for row in rows)]

    lines = ["# servegate advise", "", *(f"- {line}" for line in _header(report)), "", f"**{report.summary}**", "",
             *(f"- {note}" for note in report.notes), *([""] if report.notes else [])]
    if report.alternatives:
        lines += ["What would meet the SLO, estimated the same way:", "",
                  *table(ALTERNATIVES, _alternatives(report)), ""]
    lines += table(RANKING, _ranking(report))
    for c in report.candidates:
        lines += ["", f"## {c.name}: {c.verdict}", "", *(f"- {line}" for line in _details(report, c))]
    lines += ["", "## Assumptions", "", *(f"- {line}" for line in _assumptions(report))]
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


def _curves(report: Report, viable: list) -> str:
    """Goodput against the offered rate per runtime, as inline SVG: the diagonal is every request
    within the SLO, the dashed vertical the rate asked for."""
    series = [(c, (c.estimates.get("simulated") or {}).get("goodput_curve")) for c in viable]
    series = [(c, points) for c, points in series if points]
    if not series:
        return ""
    width, height, left, bottom, top_pad = 760, 320, 60, 40, 30
    rate = report.workload["request_rate"] or 0.0
    x_max = max([rate, *(x for _, points in series for x, _ in points)]) or 1.0
    scale = 1.1 * max([*(y for _, points in series for _, y in points), 0.0]) or 1.0

    def at(x: float, y: float) -> str:
        return (f"{left + (width - left - 180) * x / x_max:.1f},"
                f"{height - bottom - (height - bottom - top_pad) * y / scale:.1f}")

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           'aria-label="Goodput against the offered rate"><text x="0" y="18" font-size="15" font-weight="bold">'
           'Goodput within the SLO against the offered rate (requests/s, simulated)</text>',
           f'<polyline points="{at(0, 0)} {at(min(x_max, scale), min(x_max, scale))}" fill="none" stroke="#8c959f" '
           'stroke-dasharray="2,3"><title>every request within the SLO</title></polyline>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - 180}" y2="{height - bottom}" stroke="#1f2328"/>',
           f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{height - bottom}" stroke="#1f2328"/>',
           f'<text x="{width - 180}" y="{height - 12}" font-size="12" text-anchor="end">'
           f'offered {x_max:,.2f} req/s</text>',
           f'<text x="4" y="{top_pad + 10}" font-size="12">{scale:,.2f}</text>']
    if rate:
        (x0, y0), (_, y1) = at(rate, 0).split(","), at(rate, scale).split(",")
        out.append(f'<line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="#cf222e" stroke-dasharray="6,4">'
                   f'<title>asked: {rate:g} req/s</title></line>')
    palette = ("#1a7f37", "#0969da", "#bf8700", "#8250df", "#cf222e", "#1b7c83", "#953800", "#57606a")
    for i, (c, points) in enumerate(series):
        colour = palette[i % len(palette)]
        out.append(f'<polyline points="{" ".join(at(x, y) for x, y in points)}" fill="none" stroke="{colour}" '
                   f'stroke-width="2"><title>{html.escape(c.name)}</title></polyline>')
        out.append(f'<rect x="{width - 170}" y="{top_pad + i * 18}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="{width - 152}" y="{top_pad + 10 + i * 18}" font-size="12">{i + 1}. '
                   f'{html.escape(c.name)}</text>')
    out.append(f'<text x="{width - 170}" y="{top_pad + 14 + len(series) * 18}" font-size="11" fill="#57606a">'
               'dotted: all within the SLO</text>')
    return "".join(out) + "</svg>"


def _html_text(text: str) -> str:
    """Escaped text with `code` spans and _emphasis_ as the Markdown shows them."""
    escaped = html.escape(text)
    escaped = re.sub(r"`([^`]+)`", r"<code>\1</code>", escaped)
    return re.sub(r"(?<![\w/])_\((.+?)\)_", r"<small>(\1)</small>", escaped)


def _html_table(columns, rows, colour_column: int | None = None) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(
        f'<td style="color:{VERDICT_COLOURS[v]};font-weight:bold">{v}</td>' if i == colour_column and
        (v := cell) in VERDICT_COLOURS else f"<td>{_html_text(cell)}</td>" for i, cell in enumerate(row)) + "</tr>"
        for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def to_html(report: Report) -> str:
    """The Markdown report's content, in the same order, with charts: memory per device, goodput
    with its calibrated range in the table's order, and goodput against the offered rate."""
    memory = [(f"{i}. {c.name}", [(c.memory["weights_gib"], "#6e40c9", "weights"),
                                  (c.memory["reserved_gib"], "#bf8700", "reserved"),
                                  (c.memory["kv_budget_gib"], "#1a7f37", "KV cache budget")])
              for i, c in enumerate(report.candidates, 1)]
    viable = [c for c in report.candidates if c.verdict != "excluded"]
    goodput = []
    for i, c in enumerate(report.candidates, 1):
        sim = c.estimates.get("simulated") or {}
        if c.verdict == "excluded" or not sim:
            continue
        g, (low, high) = sim["goodput_requests_per_s"], sim["range"]
        goodput.append((f"{i}. {c.name}", [(g * low, VERDICT_COLOURS[c.verdict], "estimate, low end"),
                                          (g * (1 - low), "#a5d6ff", "to the estimate"),
                                          (g * (high - 1), "#ddf4ff", "to the high end")]))
    measured = [(c.name, [(c.measured.get("request_goodput") or 0.0, "#cf222e", "measured goodput")])
                for c in viable if c.measured]
    charts = [_bars("Memory per device (GiB)", memory, "GiB")]
    if goodput:
        charts.append(_bars("Estimated goodput within the SLO and its range (req/s, in the ranking's order)",
                            goodput, "req/s"))
    charts.append(_curves(report, viable))
    if measured:
        charts.append(_bars("Measured goodput (servegate bench, requests/s)", measured, "req/s"))
    header = "".join(f"<li>{_html_text(line.replace('**', ''))}</li>" for line in _header(report))
    notes = "".join(f"<li>{_html_text(note)}</li>" for note in report.notes)
    alternatives = (f"<h2>What would meet the SLO, estimated the same way</h2>"
                    f"{_html_table(ALTERNATIVES, _alternatives(report))}" if report.alternatives else "")
    details = "".join(f"<h2>{html.escape(c.name)}: {c.verdict}</h2><ul>"
                      + "".join(f"<li>{_html_text(line)}</li>" for line in _details(report, c)) + "</ul>"
                      for c in report.candidates)
    assumptions = "".join(f"<li>{_html_text(line)}</li>" for line in _assumptions(report))
    return f"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>servegate advise</title>
<style>body{{font-family:system-ui,sans-serif;margin:24px;color:#1f2328;max-width:1200px}}table{{border-collapse:collapse}}
td,th{{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top;font-size:13px}}svg{{display:block;margin:16px 0}}
code{{font-size:12px;word-break:break-all}}small{{color:#57606a}}</style></head><body><h1>servegate advise</h1>
<ul>{header}</ul><p><b>{_html_text(report.summary)}</b></p>{f"<ul>{notes}</ul>" if notes else ""}{alternatives}
{_html_table(RANKING, _ranking(report), colour_column=2)}{''.join(charts)}{details}
<h2>Assumptions</h2><ul>{assumptions}</ul></body></html>
"""

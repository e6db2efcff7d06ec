"""The deployment search's report: the frontier as an inline SVG scatter (tokens/s/GPU against
tokens/s/user, every option grey, the frontier in its runtime's colour), and the chosen options
with their launch commands, as Markdown or one self-contained HTML page."""

from __future__ import annotations

import html
import json

COLOURS = {"vllm": "#0969da", "sglang": "#1a7f37", "tensorrt-llm": "#8250df", "lmdeploy": "#bf8700",
           "llama-cpp": "#cf222e", "tgi": "#57606a", "builtin": "#1b7c83"}


def scatter(result: dict, width: int = 760, height: int = 420) -> str:
    options = result["options"]
    if not options:
        return ""
    pad = 60
    max_x = max(o["tokens_per_s_per_user"] for o in options) or 1
    max_y = max(o["tokens_per_s_per_gpu"] for o in options) or 1

    def xy(o: dict) -> tuple[float, float]:
        return (pad + (width - 2 * pad) * o["tokens_per_s_per_user"] / max_x,
                height - pad - (height - 2 * pad) * o["tokens_per_s_per_gpu"] / max_y)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
           f'aria-label="Pareto frontier"><text x="0" y="18" font-size="15" font-weight="bold">Pareto frontier: '
           f'output tokens/s per GPU against tokens/s per user</text>',
           f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#444"/>',
           f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#444"/>',
           f'<text x="{width / 2 - 60}" y="{height - 20}" font-size="12">tokens/s per user (max {max_x:,.0f})</text>',
           f'<text x="4" y="{pad - 10}" font-size="12">tokens/s per GPU (max {max_y:,.0f})</text>']
    for o in options:
        if not o["pareto"]:
            x, y = xy(o)
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2" fill="#d0d7de"/>')
    frontier = sorted((o for o in options if o["pareto"]), key=lambda o: o["tokens_per_s_per_user"])
    points = " ".join(f"{xy(o)[0]:.1f},{xy(o)[1]:.1f}" for o in frontier)
    out.append(f'<polyline points="{points}" fill="none" stroke="#24292f" stroke-width="1"/>')
    for o in frontier:
        x, y = xy(o)
        colour = COLOURS.get(o["runtime"], "#24292f")
        ring = ' stroke="#000" stroke-width="2"' if o["meets_slo"] else ""
        out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{colour}"{ring}><title>'
                   f'{html.escape(o["runtime"])} {html.escape(o["deployment"])}, {o["gpus"]} GPUs, concurrency '
                   f'{o["concurrency"]}: {o["tokens_per_s_per_gpu"]:,.0f} tok/s/GPU, '
                   f'{o["tokens_per_s_per_user"]:,.1f} tok/s/user</title></circle>')
    for i, (runtime, colour) in enumerate((r, c) for r, c in COLOURS.items()
                                          if any(o["runtime"] == r for o in frontier)):
        out.append(f'<rect x="{width - 150}" y="{pad + i * 18}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{width - 134}" y="{pad + 9 + i * 18}" font-size="12">{html.escape(runtime)}</text>')
    return "".join(out) + "</svg>"


def _row(o: dict) -> list[str]:
    f = o["figures"]
    cost = f"{o['dollars_per_million_tokens']:.3f}" if o["dollars_per_million_tokens"] else "-"
    return [o["runtime"], o["deployment"], str(o["gpus"]), str(o["concurrency"]), f"{o['tokens_per_s_per_gpu']:,.0f}",
            f"{o['tokens_per_s_per_user']:,.1f}", f"{f['ttft_ms']['p90'] or 0:,.0f}",
            f"{f['tpot_ms']['p90'] or 0:,.1f}",
            "yes" if o["meets_slo"] else "no", cost]


HEAD = ["runtime", "deployment", "GPUs", "concurrency", "tok/s/GPU", "tok/s/user", "TTFT p90 ms", "TPOT p90 ms",
        "meets SLO", "$/M tokens"]


def to_markdown(result: dict, title: str) -> str:
    lines = [f"# servegate advise --search: {title}", "", f"{result['searched']} options simulated.", ""]
    for name, key in (("Cheapest within the SLOs", "cheapest"),):
        o = result[key]
        lines += [f"**{name}**: " + (f"{o['runtime']} {o['deployment']} on {o['gpus']} GPUs at concurrency "
                                     f"{o['concurrency']}" if o else "none meets the SLOs"), ""]
        if o:
            lines += [f"    {line}" for line in o["launch"]] + [""]
    if result["fewest_gpus"]:
        f = result["fewest_gpus"]
        lines += [f"**Fewest GPUs for the target rate**: {f['gpus']} ({f['copies']} x {f['option']['runtime']} "
                  f"{f['option']['deployment']})", ""]
    lines += ["## Pareto frontier", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(_row(o)) + " |" for o in sorted(result["frontier"],
                                                               key=lambda o: -o["tokens_per_s_per_user"])]
    return "\n".join(lines) + "\n"


def to_html(result: dict, title: str) -> str:
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _row(o)) + "</tr>"
                   for o in sorted(result["frontier"], key=lambda o: -o["tokens_per_s_per_user"]))
    chosen = ""
    for name, o in (("Cheapest within the SLOs", result["cheapest"]),
                    ("Fewest GPUs for the target rate", (result["fewest_gpus"] or {}).get("option"))):
        if o:
            chosen += (f"<h2>{name}</h2><p>{html.escape(o['runtime'])} {html.escape(o['deployment'])}, "
                       f"{o['gpus']} GPUs, concurrency {o['concurrency']}</p>"
                       + "".join(f"<pre>{html.escape(line)}</pre>" for line in o["launch"]))
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>servegate advise --search"
            f"</title><style>body{{font-family:system-ui,sans-serif;margin:24px}}td,th{{border:1px solid #d0d7de;"
            f"padding:3px 6px;font-size:13px}}table{{border-collapse:collapse}}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p>{result['searched']} options simulated; ringed points meet the SLOs."
            f"</p>{scatter(result)}{chosen}<h2>Frontier</h2><table><tr>"
            + "".join(f"<th>{h}</th>" for h in HEAD) + f"</tr>{rows}</table></body></html>\n")


def to_json(result: dict) -> str:
    return json.dumps(result, indent=2, default=str)

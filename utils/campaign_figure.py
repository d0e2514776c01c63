"""docs/figures/campaign.svg and the status table of docs/lab-notes/campaign.md: the training campaign's held-out slot-0
accuracy per drafter, against its training tokens in total and against the campaign's CPU-hours, with the drafters it
started from (the ones shipped before it) and the steps shipped now marked, read from docs/results/campaign
(`examples/campaign_curve.py` appends the points, `shipped.json` holds the starting ones and the shipped steps). A run ``DRAFTER-from-step-N`` continued the committed
weights of campaign step N after a machine lost its checkpoints: its line starts at the last evaluation before N."""

from __future__ import annotations

import json
import re
from html import escape
from pathlib import Path

COLOURS = {"specblock": "#2f6fd6", "eagle3": "#2e9d55"}
NAMES = {"specblock": "SpecBlock", "eagle3": "EAGLE-3"}
PANEL_W, H, LEFT, TOP, GAP, RIGHT, BOTTOM = 300, 300, 56, 20, 60, 210, 50


def _runs(folder: Path) -> dict[str, dict[str, list[dict]]]:
    """drafter -> run name -> its points, in step order."""
    runs: dict[str, dict[str, list[dict]]] = {}
    for drafter in COLOURS:
        path = folder / f"{drafter}.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else []:
            point = json.loads(line)
            runs.setdefault(drafter, {}).setdefault(point["run"], []).append(point)
    return runs


def _continued_from(run: str) -> int | None:
    """N for a run ``DRAFTER-from-step-N`` (it continued the weights committed at campaign step N), else None."""
    match = re.search(r"-from-step-(\d+)$", run)
    return int(match.group(1)) if match else None


def _start(drafter_runs: dict[str, list[dict]], run: str) -> dict | None:
    """The point a run starts from: None for the drafter shipped before; for ``...-from-step-N`` the last evaluation
    of the earlier runs at or before campaign step N."""
    step = _continued_from(run)
    if step is None:
        return None
    earlier = [p for name, points in drafter_runs.items() if name != run for p in points
               if p["step"] <= step and not p.get("abandoned")]  # fmt: skip
    return max(earlier, key=lambda p: p["step"], default=None)


def campaign_status(folder: Path) -> str:
    """One row per drafter shipped before and per campaign run: its campaign tokens and CPU-hours from the first to the
    last evaluation, and held-out slot-0 / estimated chain at the first, best and last one (the drafter's best in
    bold); every evaluation is in the JSON lines and the figure."""
    shipped, runs = json.loads((folder / "shipped.json").read_text()), _runs(folder)
    lines = ["| run | evaluations | campaign tokens | CPU-hours | held-out slot-0: first / best / last | "
             "est. chain at those three |", "|---|---|---|---|---|---|"]  # fmt: skip
    for drafter, drafter_runs in runs.items():
        start = shipped[drafter]
        lines.append(f"| {NAMES[drafter]} shipped before (start) | 1 | 0 | 0 | {start['eval_acc_slot0']:.1%} | "
                     f"{start['eval_accept_length']:.3f} |")  # fmt: skip
        best = max(p["eval_acc_slot0"] for points in drafter_runs.values() for p in points)
        for run, points in drafter_runs.items():
            peak = max((p.get("learning_rate") or 0 for p in points), default=0)
            label = f"{NAMES[drafter]} `{run}`" + (f", peak lr {peak:.0e}".replace("e-0", "e-") if peak else "")
            if points[0].get("abandoned"):
                label += " (given up)"
            top = max(points, key=lambda p: p["eval_acc_slot0"])
            hours = [p.get("train_cpu_seconds") for p in (points[0], points[-1])]
            peak_cell = f"{top['eval_acc_slot0']:.1%}"
            peak_cell = (f"**{peak_cell}**" if top["eval_acc_slot0"] == best else peak_cell) + f" (step {top['step']})"
            slot0 = [f"{points[0]['eval_acc_slot0']:.1%}", peak_cell, f"{points[-1]['eval_acc_slot0']:.1%}"]
            cells = [
                str(len(points)),
                f"{points[0]['campaign_tokens'] / 1e6:.2f}M - {points[-1]['campaign_tokens'] / 1e6:.2f}M",
                " - ".join(f"{h / 3600:.2f}" for h in hours) if all(hours) else "-",
                " / ".join(slot0),
                " / ".join(f"{p['eval_accept_length']:.3f}" for p in (points[0], top, points[-1])),
            ]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def campaign_aims(folder: Path) -> str:
    """SpecBlock's distance to the campaign's aims: where it stands, the log-linear fits of `extrapolation.json`, and
    the CPU-hours the missing tokens take at the campaign's mean rate so far."""
    fits = json.loads((folder / "extrapolation.json").read_text())
    points = [p for run in _runs(folder)["specblock"].values() for p in run if not p.get("abandoned")]
    best, last = max(points, key=lambda p: p["eval_acc_slot0"]), max(points, key=lambda p: p["tokens"])
    tokens_per_cpu_hour = last["campaign_tokens"] / (last["train_cpu_seconds"] / 3600)

    def more_hours(tokens: float) -> str:
        return f"{max(tokens - last['tokens'], 0) / tokens_per_cpu_hour:,.0f}"

    slot0_tokens = fits["tokens_to_reach"]["45%"]
    now = f"{best['eval_acc_slot0']:.1%} (step {best['step']}, {best['tokens'] / 1e6:.2f}M tokens, as its run read it)"
    # committed weights read again in float32 (runs evaluate in the precision they train in): float32-readings/step-N
    readings = {int(path.stem[5:]): path for path in folder.glob("float32-readings/step-*.json")}
    if readings:
        newest = max(readings)
        accuracy = json.loads(readings[newest].read_text())["eval_acc_slot0"]
        now += f"; {accuracy:.1%} read in float32 (step {newest})"
    lines = [
        "| aim | now | gain per doubling of training tokens (points fitted) | training tokens in all to reach it | "
        "CPU-hours more |",
        "|---|---|---|---|---|",
        f"| held-out slot-0 45% | {now} | {fits['specblock_points_per_doubling']} points "
        f"({fits['specblock_points']}) | {slot0_tokens / 1e6:.1f}M | {more_hours(slot0_tokens)} |",
    ]
    tau = next(value for key, value in fits.items() if key.startswith("tau_at_"))
    for setting, fit in tau["fits"].items():
        now = fit["points"][-1]
        lines.append(
            f"| tau {tau['aim']} at 16 nodes, {setting} | {now['tau']:.2f} (step {now['step']}) | "
            f"{fit['tau_per_doubling']:.3f} ({len(fit['points'])}) | {fit['tokens_to_reach'] / 1e6:.0f}M | "
            f"{more_hours(fit['tokens_to_reach'])} |"
        )
    return "\n".join(lines) + (
        f"\n\nCPU-hours at the campaign's mean rate so far, {tokens_per_cpu_hour / 1e6:.2f}M SpecBlock tokens per "
        "CPU-hour (bfloat16 where the CPU has it natively, float32 elsewhere; one thread, a core often shared with "
        "other work)."
    )


def _diamond(x: float, y: float, r: float = 6.0) -> str:
    """An SVG path: a diamond of half-width `r` centred on (x, y)."""
    return f"M{x:.1f},{y - r:.1f} L{x + r:.1f},{y:.1f} L{x:.1f},{y + r:.1f} L{x - r:.1f},{y:.1f} Z"


def _ticks(top: float) -> list[float]:
    step = next(s for s in (0.1, 0.2, 0.25, 0.5, 1, 2, 5, 10, 20) if top / s <= 6)
    return [i * step for i in range(int(top / step + 1e-9) + 1)]


def campaign_svg(folder: Path) -> str:
    shipped = json.loads((folder / "shipped.json").read_text())
    runs = _runs(folder)
    points = [p for drafter in runs.values() for run in drafter.values() for p in run]
    accuracies = [p["eval_acc_slot0"] for p in points] + [shipped[d]["eval_acc_slot0"] for d in COLOURS]
    y_low, y_high = int(min(accuracies) * 100) - 1, int(max(accuracies) * 100) + 2
    tokens_max = max([p["tokens"] for p in points] + [shipped[d]["tokens"] for d in COLOURS]) / 1e6
    hours_max = max([p.get("train_cpu_seconds") or p["train_seconds"] for p in points] + [1.0]) / 3600
    shipped_now = {  # the evaluation at or just before the campaign step each drafter ships now
        drafter: max((p for run in runs[drafter].values() for p in run
                      if p["step"] <= step and not p.get("abandoned")), key=lambda p: p["step"])
        for drafter, step in shipped.get("shipped_now", {}).items()
    }  # fmt: skip
    panels = [  # (title, x of a point, x of a shipped drafter, axis maximum, left edge)
        ("training tokens (millions)", lambda p: p["tokens"] / 1e6, lambda d: shipped[d]["tokens"] / 1e6,
         tokens_max * 1.05, LEFT),
        ("campaign CPU-hours", lambda p: (p.get("train_cpu_seconds") or p["train_seconds"]) / 3600, lambda d: 0.0,
         hours_max * 1.05, LEFT + PANEL_W + GAP),
    ]  # fmt: skip
    width = LEFT + 2 * PANEL_W + GAP + RIGHT
    plot_h = H - TOP - BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{H}" viewBox="0 0 {width} {H}" '
        'font-family="DejaVu Sans, sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="#ffffff"/>',
    ]

    def y_of(accuracy: float) -> float:
        return TOP + plot_h - (accuracy * 100 - y_low) / (y_high - y_low) * plot_h

    for title, x_point, x_shipped, x_max, left in panels:
        def x_of(value: float, left: float = left, x_max: float = x_max) -> float:
            return left + value / x_max * PANEL_W

        for tick in range(y_low, y_high + 1):
            y = y_of(tick / 100)
            parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + PANEL_W}" y2="{y:.1f}" stroke="#e4e4e4"/>')
            parts.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" fill="#333333">{tick}</text>')
        for tick in _ticks(x_max):
            parts.append(f'<text x="{x_of(tick):.1f}" y="{TOP + plot_h + 16}" text-anchor="middle" '
                         f'fill="#333333">{tick:g}</text>')  # fmt: skip
        parts.append(f'<text x="{left + PANEL_W / 2:.0f}" y="{H - 12}" text-anchor="middle" fill="#333333">'
                     f"{title}</text>")  # fmt: skip
        for drafter, drafter_runs in runs.items():
            for run, run_points in drafter_runs.items():
                earlier = _start(drafter_runs, run)
                start = ((x_of(x_shipped(drafter)), y_of(shipped[drafter]["eval_acc_slot0"])) if earlier is None
                         else (x_of(x_point(earlier)), y_of(earlier["eval_acc_slot0"])))  # fmt: skip
                xy = [start] + [(x_of(x_point(p)), y_of(p["eval_acc_slot0"])) for p in run_points]
                dash = ' stroke-dasharray="4 3" opacity="0.6"' if run_points[0].get("abandoned") else ""
                line = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
                parts.append(f'<polyline points="{line}" fill="none" stroke="{COLOURS[drafter]}" stroke-width="2"'
                             f"{dash}/>")  # fmt: skip
                parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{COLOURS[drafter]}"/>' for x, y in xy[1:]]
        for drafter in COLOURS:
            x, y = x_of(x_shipped(drafter)), y_of(shipped[drafter]["eval_acc_slot0"])
            parts.append(f'<rect x="{x - 5:.1f}" y="{y - 5:.1f}" width="10" height="10" fill="none" '
                         f'stroke="{COLOURS[drafter]}" stroke-width="2"/>')  # fmt: skip
        for drafter, point in shipped_now.items():
            x, y = x_of(x_point(point)), y_of(point["eval_acc_slot0"])
            parts.append(f'<path d="{_diamond(x, y)}" fill="{COLOURS[drafter]}" stroke="#222222"/>')
    parts.append(f'<text x="16" y="{TOP + plot_h / 2:.0f}" transform="rotate(-90 16 {TOP + plot_h / 2:.0f})" '
                 'text-anchor="middle" fill="#333333">held-out slot-0 accuracy (%)</text>')  # fmt: skip
    legend_x = LEFT + 2 * PANEL_W + GAP + 16
    entries = [(f"{NAMES[d]} campaign", COLOURS[d], "line") for d in COLOURS]
    entries += [(f"{NAMES[d]} at the start", COLOURS[d], "box") for d in COLOURS]
    entries += [(f"{NAMES[d]} shipped now", COLOURS[d], "diamond") for d in shipped_now]
    entries += [("a run given up (dashed)", "#888888", "dash")]
    for k, (label, colour, kind) in enumerate(entries):
        ly = TOP + 14 + 18 * k
        if kind == "box":
            parts.append(f'<rect x="{legend_x + 7}" y="{ly - 9}" width="10" height="10" fill="none" '
                         f'stroke="{colour}" stroke-width="2"/>')  # fmt: skip
        elif kind == "diamond":
            parts.append(f'<path d="{_diamond(legend_x + 12, ly - 4)}" fill="{colour}" stroke="#222222"/>')
        else:
            dash = ' stroke-dasharray="4 3"' if kind == "dash" else ""
            parts.append(f'<line x1="{legend_x}" y1="{ly - 4}" x2="{legend_x + 24}" y2="{ly - 4}" stroke="{colour}" '
                         f'stroke-width="2"{dash}/>')  # fmt: skip
        parts.append(f'<text x="{legend_x + 30}" y="{ly}" fill="#333333">{escape(label)}</text>')
    return "\n".join(parts + ["</svg>"]) + "\n"

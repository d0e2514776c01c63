"""docs/figures/target-cost.svg: what verifying a tree of n nodes costs the target, in plain steps, per dtype and
batch size, read from a `examples/target_cost_curve.py` results file."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

COLOURS = ("#2f6fd6", "#2e9d55", "#d6882f", "#9a4fd6", "#d64f4f", "#4fb8d6")
W, H, LEFT, TOP, RIGHT, BOTTOM = 560, 320, 60, 20, 170, 50


def cost_svg(path: Path) -> str:
    data = json.loads(path.read_text())
    curves = {name: {int(n): c for n, c in curve["relative"].items()} for name, curve in data["curves"].items()}
    x_max = max(max(c) for c in curves.values())
    y_max = max(max(c.values()) for c in curves.values())
    y_top = float(int(y_max) + 1)
    plot_w, plot_h = W - LEFT - RIGHT, H - TOP - BOTTOM

    def xy(n: float, cost: float) -> tuple[float, float]:
        return LEFT + n / x_max * plot_w, TOP + plot_h - cost / y_top * plot_h

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        'font-family="DejaVu Sans, sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="#ffffff"/>',
    ]
    for tick in range(int(y_top) + 1):
        x0, y = xy(0, tick)
        parts.append(f'<line x1="{x0:.0f}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" stroke="#e4e4e4"/>')
        parts.append(f'<text x="{x0 - 6:.0f}" y="{y + 4:.1f}" text-anchor="end" fill="#333333">{tick}</text>')
    for n in [n for n in sorted(next(iter(curves.values()))) if n in (0, 4, 8, 16, 24, 32, 48, 64)]:
        x, y = xy(n, 0)
        parts.append(f'<text x="{x:.1f}" y="{y + 16:.0f}" text-anchor="middle" fill="#333333">{n}</text>')
    batches = list(dict.fromkeys(name.split()[-1] for name in curves))  # "B=1", ...: one colour per batch size
    for k, (name, curve) in enumerate(curves.items()):
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(n, c) for n, c in sorted(curve.items())))
        colour = COLOURS[batches.index(name.split()[-1]) % len(COLOURS)]
        dash = "" if name.startswith("bfloat16") else ' stroke-dasharray="5 3"'
        parts.append(f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
        ly = TOP + 14 + 18 * k
        parts.append(f'<line x1="{W - RIGHT + 14}" y1="{ly - 4}" x2="{W - RIGHT + 38}" y2="{ly - 4}" '
                     f'stroke="{colour}" stroke-width="2"{dash}/>')  # fmt: skip
        parts.append(f'<text x="{W - RIGHT + 44}" y="{ly}" fill="#333333">{escape(name)}</text>')
    parts.append(f'<text x="{LEFT + plot_w / 2:.0f}" y="{H - 12}" text-anchor="middle" fill="#333333">'
                 "drafted nodes verified in one forward</text>")  # fmt: skip
    parts.append(f'<text x="16" y="{TOP + plot_h / 2:.0f}" transform="rotate(-90 16 {TOP + plot_h / 2:.0f})" '
                 'text-anchor="middle" fill="#333333">cost in plain steps</text>')  # fmt: skip
    return "\n".join(parts + ["</svg>"]) + "\n"

"""docs/figures/tree.svg: one drafted tree and what one verifying target forward commits from it."""

from __future__ import annotations

from html import escape

# (token, parent index or None for a child of the root, state): "accepted" drafted and kept, "rejected" drafted and
# dropped, "target" the target's own next token after the accepted path (always committed).
NODES = [
    (" Paris", None, "accepted"),
    (",", 0, "accepted"),
    (" and", 1, "rejected"),
    (" which", 1, "rejected"),
    (" the", 1, "target"),
    (".", 0, "rejected"),
    (" a", None, "rejected"),
    (" city", 6, "rejected"),
]
ROOT_TEXT = "The capital of France is"
DOT = "\u00b7"  # a token's leading space, made visible
COLOURS = {"accepted": "#2e9d55", "rejected": "#9a9a9a", "target": "#2f6fd6", "root": "#444444"}
BOX_W, BOX_H, COL_W, ROW_H, LEFT, TOP = 86, 28, 130, 40, 290, 30


def _layout() -> tuple[list[int], list[float]]:
    """Depth and row (y slot) of every node: leaves in depth-first order, a parent centred on its children."""
    children: dict[int | None, list[int]] = {}
    for i, (_, parent, _) in enumerate(NODES):
        children.setdefault(parent, []).append(i)
    depth, row, next_row = [0] * len(NODES), [0.0] * len(NODES), [0]

    def place(node: int, level: int) -> float:
        depth[node] = level
        kids = children.get(node, [])
        if kids:
            row[node] = sum(place(kid, level + 1) for kid in kids) / len(kids)
        else:
            row[node], next_row[0] = next_row[0], next_row[0] + 1
        return row[node]

    for top in children[None]:
        place(top, 1)
    return depth, row


def _box(x: float, y: float, text: str, state: str, width: int = BOX_W) -> str:
    """A token (leading spaces shown as a middle dot) in a box coloured by its state."""
    colour = COLOURS[state]
    fill = "#ffffff" if state == "rejected" else colour
    ink = "#555555" if state == "rejected" else "#ffffff"
    dash = ' stroke-dasharray="4 3"' if state == "rejected" else ""
    return (
        f'<rect x="{x:.0f}" y="{y - BOX_H / 2:.0f}" width="{width}" height="{BOX_H}" rx="6" fill="{fill}" '
        f'stroke="{colour}" stroke-width="2"{dash}/>\n'
        f'<text x="{x + width / 2:.0f}" y="{y + 5:.0f}" text-anchor="middle" fill="{ink}">'
        f"{escape(text if state == 'root' else text.replace(' ', DOT))}</text>"
    )


def tree_svg() -> str:
    depth, row = _layout()
    rows = max(row) + 1
    height = TOP + rows * ROW_H + 90
    width = LEFT + max(depth) * COL_W + 40
    root_y = TOP + sum(row[i] for i, n in enumerate(NODES) if n[1] is None) / 2 * ROW_H + ROW_H / 2
    ys = [TOP + r * ROW_H + ROW_H / 2 for r in row]
    xs = [LEFT + (d - 1) * COL_W for d in depth]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height:.0f}" '
        f'viewBox="0 0 {width} {height:.0f}" font-family="DejaVu Sans Mono, monospace" font-size="13">',
        '<rect width="100%" height="100%" fill="#ffffff"/>',
    ]
    for i, (_, parent, state) in enumerate(NODES):
        x0, y0 = (LEFT - 40, root_y) if parent is None else (xs[parent] + BOX_W, ys[parent])
        colour = COLOURS["accepted" if state != "rejected" else "rejected"]
        parts.append(f'<line x1="{x0:.0f}" y1="{y0:.0f}" x2="{xs[i]:.0f}" y2="{ys[i]:.0f}" stroke="{colour}" '
                     f'stroke-width="{2.5 if state != "rejected" else 1.2}"/>')  # fmt: skip
    parts.append(_box(10, root_y, ROOT_TEXT, "root", width=LEFT - 50))
    parts += [_box(xs[i], ys[i], token, state) for i, (token, _, state) in enumerate(NODES)]
    drafted = sum(state != "target" for _, _, state in NODES)
    committed = sum(state != "rejected" for _, _, state in NODES)
    legend_y = TOP + rows * ROW_H + 30
    legend = [("accepted", "drafted, accepted"), ("rejected", "drafted, rejected"), ("target", "the target's token")]
    for k, (state, label) in enumerate(legend):
        x = 10 + k * 200
        parts.append(f'<rect x="{x}" y="{legend_y - 10}" width="14" height="14" rx="3" fill="{COLOURS[state]}"/>')
        parts.append(f'<text x="{x + 20}" y="{legend_y + 2}" fill="#333333">{label}</text>')
    parts.append(
        f'<text x="10" y="{legend_y + 32}" fill="#333333">{drafted} drafted tokens, one target forward with a tree '
        f"attention mask: {committed} tokens committed</text>"
    )
    return "\n".join(parts + ["</svg>"]) + "\n"


def mask_svg() -> str:
    """docs/figures/tree-mask.svg: the tree attention mask of the same tree (who sees whom in the verifying forward)."""
    drafted = [i for i, (_, _, state) in enumerate(NODES) if state != "target"]
    row_of = {old: row + 1 for row, old in enumerate(drafted)}  # row 0: the last text token, the tree's root
    tokens = [ROOT_TEXT.split()[-1]] + [NODES[i][0] for i in drafted]
    parents = [None] + [0 if NODES[i][1] is None else row_of[NODES[i][1]] for i in drafted]
    cell, left, top = 26, 110, 110
    n = len(tokens)
    width, height = max(left + (n + 1) * cell + 20, 600), top + n * cell + 50
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        'font-family="DejaVu Sans Mono, monospace" font-size="12">',
        '<rect width="100%" height="100%" fill="#ffffff"/>',
    ]
    labels = ["text"] + [t.replace(" ", DOT) for t in tokens]  # columns: the text before the root, then the rows
    for j, label in enumerate(labels):
        x = left + j * cell + cell / 2
        parts.append(f'<text x="{x:.0f}" y="{top - 8}" transform="rotate(-60 {x:.0f} {top - 8})" '
                     f'fill="#333333">{escape(label)}</text>')  # fmt: skip
    for i, token in enumerate(tokens):
        y = top + i * cell
        parts.append(f'<text x="{left - 8}" y="{y + cell / 2 + 4:.0f}" text-anchor="end" fill="#333333">'
                     f"{escape(token.replace(' ', DOT))}</text>")  # fmt: skip
        ancestors, node = {i}, i
        while parents[node] is not None:
            node = parents[node]
            ancestors.add(node)
        for j in range(n + 1):
            visible = j == 0 or (j - 1) in ancestors
            fill = COLOURS["accepted"] if visible else "#f1f1f1"
            parts.append(f'<rect x="{left + j * cell}" y="{y}" width="{cell - 2}" height="{cell - 2}" fill="{fill}"/>')
    parts.append(f'<text x="10" y="{height - 15}" fill="#333333">row: a token of the verified forward; green: '
                 "the positions it attends to</text>")  # fmt: skip
    return "\n".join(parts + ["</svg>"]) + "\n"

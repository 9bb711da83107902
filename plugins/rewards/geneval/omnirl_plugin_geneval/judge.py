"""GenEval's decision rules (Ghosh et al. 2023, evaluate_images.py) on a list of detections.

Each ``include`` requirement: at least ``count`` detections of its class; with a colour, at least ``count`` of
them classified as that colour; with ``position: (relation, i)``, every detection of the class stands in
``relation`` to every detection matched for ``include[i]``. Each ``exclude``: fewer than ``count``.
``strict``: 1 when every requirement holds (GenEval's score), else 0; ``fraction``: the share that hold (a
denser signal for RL, as the flow_grpo GenEval reward reports next to the strict one).

Relative position of box A to box B (GenEval's ``relative_position``): the centre offset o = c_A - c_B, shrunk
towards 0 by t * (size_A + size_B) per axis (t = 0.1) and clipped at 0; none when both shrunk offsets are
~0, else with d = shrunk / |o|: "left of" d_x < -0.5, "right of" d_x > 0.5, "above" d_y < -0.5, "below" d_y > 0.5.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omnirl_plugin_geneval.parse import Task

POSITION_THRESHOLD = 0.1


@dataclass(frozen=True)
class Detection:
    cls: str
    box: tuple[float, float, float, float]
    """x0, y0, x1, y1 in pixels."""
    score: float


def relations(a: Detection, b: Detection, threshold: float = POSITION_THRESHOLD) -> set[str]:
    """Where A is relative to B (image y grows downwards)."""
    out: set[str] = set()
    offset, shrunk = [], []
    for axis in (0, 1):
        ca, cb = (a.box[axis] + a.box[axis + 2]) / 2, (b.box[axis] + b.box[axis + 2]) / 2
        size = abs(a.box[axis + 2] - a.box[axis]) + abs(b.box[axis + 2] - b.box[axis])
        o = ca - cb
        offset.append(o)
        shrunk.append(math.copysign(max(abs(o) - threshold * size, 0.0), o))
    if all(abs(s) < 1e-3 for s in shrunk):
        return out
    norm = math.hypot(*offset)
    dx, dy = shrunk[0] / norm, shrunk[1] / norm
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def judge(task: Task, detections: Sequence[Detection],
          colors_of: Callable[[str, list[Detection]], list[str]] | None = None) -> tuple[bool, float]:
    """(every requirement holds, share of the checks that hold) for one image's detections.

    As GenEval: a requirement looks at the ``count`` most confident detections of its class; its colour and
    position checks run only when the checks before them held (a check that cannot run counts as failed);
    a requirement that failed leaves nothing for a later position to refer to."""
    by_class: dict[str, list[Detection]] = {}
    for d in sorted(detections, key=lambda d: -d.score):
        by_class.setdefault(d.cls, []).append(d)
    checks: list[bool] = []
    matched: list[list[Detection] | None] = []
    for want in task.include:
        found = by_class.get(want.cls, [])[:want.count]
        ok = len(found) >= want.count
        checks.append(ok)
        if want.color is not None:
            if ok:
                colors = colors_of(want.cls, found) if colors_of is not None else []
                ok = colors.count(want.color) >= want.count
            checks.append(ok)
        if want.position is not None:
            if ok:
                relation, target = want.position
                others = matched[target] if target < len(matched) else None
                ok = others is not None and all(relation in relations(d, o) for d in found for o in others)
            checks.append(ok)
        matched.append(found if ok else None)
    for want in task.exclude:
        checks.append(len(by_class.get(want.cls, [])) < want.count)
    return all(checks), sum(checks) / len(checks)

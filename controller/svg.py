"""Small inline SVG charts for the status page (pure; no script, no external asset).

Each function returns one ``<svg>`` element; every text it holds is HTML-escaped.
"""

from __future__ import annotations

from html import escape
from typing import Sequence

BLUE, GREY, RED, AMBER = "#3b7dd8", "#e3e6ec", "#b3261e", "#d29a00"


def bar(value: float | None, total: float | None, *, width: int = 140, label: str = "") -> str:
    """A progress bar: ``value`` of ``total`` filled (empty when either is unknown)."""
    share = 0.0
    if value is not None and total:
        share = min(1.0, max(0.0, value / total))
    return (f'<svg class="bar" width="{width}" height="10" viewBox="0 0 {width} 10" role="img" '
            f'aria-label="{_e(label)}"><title>{_e(label)}</title>'
            f'<rect width="{width}" height="10" rx="2" fill="{GREY}"/>'
            f'<rect width="{share * width:.1f}" height="10" rx="2" fill="{BLUE}"/></svg>')


def sparkline(points: Sequence[tuple[float, float]], *, start: float, end: float,
              width: int = 360, height: int = 48, element_id: str = "") -> str:
    """Values over time, ``(t, value)`` oldest first, on ``[start, end]``; the area under the
    line filled, the peak labelled."""
    if not points or end <= start:
        return (f'<svg id="{_e(element_id)}" width="{width}" height="{height}" role="img" '
                f'aria-label="no data yet"><text x="4" y="{height / 2 + 4:.0f}" '
                f'fill="#5b6475" font-size="12">no data yet</text></svg>')
    peak = max(value for _, value in points) or 1.0
    top = 12  # room for the label

    def xy(t: float, value: float) -> str:
        x = (t - start) / (end - start) * width
        y = height - (value / peak) * (height - top)
        return f"{x:.1f},{y:.1f}"

    line = " ".join(xy(t, value) for t, value in points)
    first_x, last_x = xy(*points[0]).split(",")[0], xy(*points[-1]).split(",")[0]
    area = f"{first_x},{height} {line} {last_x},{height}"
    label = f"peak {peak:.2f}/s"
    return (f'<svg id="{_e(element_id)}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(label)}">'
            f'<line x1="0" y1="{height - 0.5}" x2="{width}" y2="{height - 0.5}" '
            f'stroke="{GREY}"/>'
            f'<polygon points="{area}" fill="{BLUE}" fill-opacity="0.15"/>'
            f'<polyline points="{line}" fill="none" stroke="{BLUE}" stroke-width="1.5"/>'
            f'<text x="{width - 2}" y="10" text-anchor="end" fill="#5b6475" font-size="10">'
            f'{_e(label)}</text></svg>')


def step_timeline(steps: Sequence[tuple[float, int, str, bool]], marks: Sequence[float], *,
                  start: float, end: float, capacity: int, start_label: str = "",
                  end_label: str = "", width: int = 640, height: int = 70,
                  element_id: str = "") -> str:
    """A count over time as steps, e.g. an epoch's members: each ``(t, count, label,
    highlighted)`` holds until the next (the last until ``end``); highlighted ones in red
    (paused epochs). ``marks`` (e.g. failures) are red ticks. The y axis runs from 0 to
    ``capacity`` whole units; the time axis is labelled at both ends."""
    if not steps or end <= start:
        return (f'<svg id="{_e(element_id)}" width="{width}" height="24" role="img" '
                f'aria-label="no epochs yet"><text x="4" y="16" fill="#5b6475" '
                f'font-size="12">no epochs yet</text></svg>')
    left, top, bottom = 28, 14, height - 16
    capacity = max(capacity, max(count for _, count, _, _ in steps), 1)

    def x(t: float) -> float:
        return left + (min(max(t, start), end) - start) / (end - start) * (width - left - 2)

    def y(count: int) -> float:
        return bottom - count / capacity * (bottom - top)

    parts = [f'<line x1="{left}" y1="{bottom}" x2="{width - 2}" y2="{bottom}" stroke="{GREY}"/>',
             f'<text x="{left - 4}" y="{y(capacity) + 4:.1f}" text-anchor="end" '
             f'font-size="10" fill="#5b6475">{capacity}</text>',
             f'<text x="{left - 4}" y="{bottom + 4}" text-anchor="end" font-size="10" '
             f'fill="#5b6475">0</text>',
             f'<text x="{left}" y="{height - 2}" font-size="10" fill="#5b6475">'
             f'{_e(start_label)}</text>',
             f'<text x="{width - 2}" y="{height - 2}" text-anchor="end" font-size="10" '
             f'fill="#5b6475">{_e(end_label)}</text>']
    ends = [t for t, _, _, _ in steps[1:]] + [end]
    for (t, count, label, highlighted), until in zip(steps, ends):
        x0, x1 = x(t), x(until)
        colour = RED if highlighted else BLUE
        parts.append(f'<rect class="epoch" x="{x0:.1f}" y="{y(count):.1f}" '
                     f'width="{max(x1 - x0, 1):.1f}" height="{bottom - y(count):.1f}" '
                     f'fill="{colour}" fill-opacity="0.25" stroke="{colour}">'
                     f'<title>{_e(label)}</title></rect>')
        if x1 - x0 > 24:
            parts.append(f'<text x="{x0 + 3:.1f}" y="{y(count) - 3:.1f}" font-size="10" '
                         f'fill="#1d2330">{_e(label.split(":")[0])}</text>')
    for t in marks:
        if start <= t <= end:
            parts.append(f'<line class="failure" x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" '
                         f'y2="{bottom}" stroke="{RED}" stroke-dasharray="3 2"/>')
    return (f'<svg id="{_e(element_id)}" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="epochs over time">'
            + "".join(parts) + "</svg>")


def _e(value: object) -> str:
    return escape(str(value), quote=True)

"""``omnirl report RUN_DIR``: one self-contained HTML page about a run (no network: charts are inline SVG,
pictures PNG data URLs, speech WAV data URLs in ``<audio controls>`` players). Curves of the reward (with its
spread), the held-out evaluation, KL, clip fraction, loss and the time split of a step; the sample grids over time
(speech: a player beside each sample's text); the evaluations' tables and grids (speech: per sample, its scores
and a player), with what a reward displays beside its score (asr-error's CER) named as such."""

from __future__ import annotations

import base64
import html
import json
import math
import statistics
from pathlib import Path
from typing import Any, TypeVar

from omnirl_core.errors import UsageError

COLORS = ["#2f6fd0", "#d0542f", "#2e9e5b", "#8e44ad", "#c79a14", "#16a3b8", "#7f7f7f"]
MAX_GRIDS = 16
"""Sample grids shown (evenly spaced over the run, the first and the last always)."""
LISTED = 4
"""Samples shown of each step's text or speech listing (the first ones: the first prompt's group)."""
MAX_EVAL_CLIPS = 16
"""Speech samples shown with a player per evaluated model (the first ones, in prompt order)."""
T = TypeVar("T")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000 or magnitude < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4g}"


def _ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    if integer:
        step = max(step, 1)
    for m in (1, 2, 5, 10):
        if raw <= m * step:
            step *= m
            break
    first = math.ceil(lo / step) * step
    out = []
    value = first
    while value <= hi + 1e-12 * abs(hi):
        out.append(round(value, 12))
        value += step
    return out


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], *, bands: dict[str, list[tuple[float, float,
               float]]] | None = None, stacked: bool = False, width: int = 560, height: int = 260,
               ylabel: str = "") -> str:
    """An SVG chart: one polyline per series (``stacked``: areas stacked in order), optional shaded bands
    (x, low, high) under a series of the same name, axes with ticks and a legend."""
    series = {k: [(x, y) for x, y in v if _finite(x) and _finite(y)] for k, v in series.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return ""
    bands = bands or {}
    if stacked:
        xs = sorted({x for v in series.values() for x, _ in v})
        tops: dict[float, float] = dict.fromkeys(xs, 0.0)
        layers = {}
        for name, points in series.items():
            values = dict(points)
            layer = []
            for x in xs:
                low = tops[x]
                tops[x] = low + values.get(x, 0.0)
                layer.append((x, low, tops[x]))
            layers[name] = layer
        ys = [0.0, *tops.values()]
    else:
        ys = [y for v in series.values() for _, y in v]
        ys += [b for v in bands.values() for _, a, b in v] + [a for v in bands.values() for _, a, _ in v]
    xs_all = [x for v in series.values() for x, _ in v]
    x0, x1 = min(xs_all), max(xs_all)
    if x1 <= x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.05 or (abs(y0) * 0.05 or 0.5)
    y0, y1 = y0 - pad, y1 + pad
    ml, mr, mt, mb = 64, 12, 28, 54
    pw, ph = width - ml - mr, height - mt - mb

    def px(x: float) -> float:
        return ml + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return mt + (y1 - y) / (y1 - y0) * ph

    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} '
           f'{height}" role="img" aria-label="{html.escape(title)}">'),
           f'<text x="{ml}" y="18" font-size="13" font-weight="bold">{html.escape(title)}</text>',
           f'<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="#fbfbfd" stroke="#999"/>']
    for t in _ticks(y0, y1):
        y = py(t)
        out.append(f'<line x1="{ml}" x2="{ml + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#e3e3e8"/>'
                   f'<text x="{ml - 4}" y="{y + 4:.1f}" font-size="10" text-anchor="end">{_fmt(t)}</text>')
    for t in _ticks(x0, x1, 6, integer=True):
        x = px(t)
        out.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{mt + ph}" y2="{mt + ph + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{mt + ph + 15}" font-size="10" text-anchor="middle">{_fmt(t)}</text>')
    out.append(f'<text x="{ml + pw / 2}" y="{mt + ph + 30}" font-size="10" text-anchor="middle">step</text>')
    if ylabel:
        out.append(f'<text x="12" y="{mt + ph / 2}" font-size="10" text-anchor="middle" '
                   f'transform="rotate(-90 12 {mt + ph / 2})">{html.escape(ylabel)}</text>')
    for i, (name, points) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        if stacked:
            layer = layers[name]
            upper = " ".join(f"{px(x):.1f},{py(hi):.1f}" for x, _, hi in layer)
            lower = " ".join(f"{px(x):.1f},{py(lo):.1f}" for x, lo, _ in reversed(layer))
            out.append(f'<polygon points="{upper} {lower}" fill="{color}" fill-opacity="0.55" stroke="{color}"/>')
            continue
        band = bands.get(name)
        if band:
            upper = " ".join(f"{px(x):.1f},{py(hi):.1f}" for x, _, hi in band if _finite(hi))
            lower = " ".join(f"{px(x):.1f},{py(lo):.1f}" for x, lo, _ in reversed(band) if _finite(lo))
            out.append(f'<polygon points="{upper} {lower}" fill="{color}" fill-opacity="0.15" stroke="none"/>')
        if len(points) == 1:
            x, y = points[0]
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{color}"/>')
        else:
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"/>')
            if len(points) <= 30:
                out += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.2" fill="{color}"/>' for x, y in points]
    lx: float = ml
    for i, name in enumerate(series):
        color = COLORS[i % len(COLORS)]
        out.append(f'<rect x="{lx}" y="{height - 14}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="{height - 5}" font-size="10">{html.escape(name)}</text>')
        lx += 24 + 6.2 * len(name)
    out.append("</svg>")
    return "".join(out)


def _column(records: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in records if _finite(r.get(key))]


def _moving_average(points: list[tuple[float, float]], k: int) -> list[tuple[float, float]]:
    out = []
    for i, (x, _) in enumerate(points):
        window = [y for _, y in points[max(0, i - k + 1): i + 1]]
        out.append((x, statistics.fmean(window)))
    return out


def _data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def _player(path: Path) -> str:
    """An ``<audio controls>`` player of a WAV file, embedded as a data URL (the page stays self-contained); a
    missing file is said so in its place."""
    if not path.is_file():
        return f"<em>{html.escape(path.name)} missing</em>"
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<audio controls preload="metadata" src="data:audio/wav;base64,{data}"></audio>'


def _read_listing(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL listing; a torn or unreadable one gives what it holds up to the damage."""
    out = []
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                out.append(json.loads(line))
    except (OSError, json.JSONDecodeError):
        pass
    return out


def _spaced(items: list[T], count: int) -> list[T]:
    if len(items) <= count:
        return items
    picks = {round(i * (len(items) - 1) / (count - 1)) for i in range(count)}
    return [items[i] for i in sorted(picks)]


def _learning(records: list[dict[str, Any]]) -> str:
    values = [r["reward/mean"] for r in records if _finite(r.get("reward/mean"))]
    if len(values) < 4:
        return ""
    k = min(10, len(values) // 2)
    first, last = values[:k], values[-k:]
    se = math.sqrt(statistics.variance(first) / k + statistics.variance(last) / k) if k > 1 else float("nan")
    diff = statistics.fmean(last) - statistics.fmean(first)
    z = diff / se if se and math.isfinite(se) else float("nan")
    return (f"reward/mean, first {k} steps {statistics.fmean(first):.4f}, last {k} steps "
            f"{statistics.fmean(last):.4f}: {diff:+.4f} ({z:+.1f} standard errors)")


def _table(rows: list[list[str]], header: list[str]) -> str:
    return _html_table([[html.escape(c) for c in row] for row in rows], header)


def _html_table(rows: list[list[str]], header: list[str]) -> str:
    """A table of cells that are HTML already (escaped text, players)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _score(value: object) -> str:
    return f"{value:.3f}" if _finite(value) else "-"


def _speech_table(lines: list[dict[str, Any]], folder: Path, metrics: list[str]) -> str:
    """Speech samples: the text spoken, the seconds, each score and a player of its WAV (``audio``: relative to
    ``folder``)."""
    rows = [[html.escape(str(x.get("text") or x.get("prompt", ""))), _score(x.get("seconds")),
             *(_score(x.get(m)) for m in metrics), _player(folder / str(x["audio"]))] for x in lines]
    return _html_table(rows, ["text", "seconds", *metrics, "audio"])


def _displayed_label(metric: str, displayed: dict[str, Any]) -> str:
    """A metric's row label; a displayed one says what it is of the score: ``asr-error/cer = 1 - asr-error (lower
    is better)``."""
    d = displayed.get(metric)
    if not isinstance(d, dict) or not all(_finite(d.get(k)) for k in ("scale", "offset")):
        return metric
    reward, scale, offset = str(d.get("reward", "score")), float(d["scale"]), float(d["offset"])
    term = reward if scale == 1 else f"-{reward}" if scale == -1 else f"{scale:g} x {reward}"
    if offset and scale == -1:
        formula = f"{offset:g} - {reward}"
    elif offset:
        formula = f"{term} {'+' if offset > 0 else '-'} {abs(offset):g}"
    else:
        formula = term
    return f"{metric} = {formula} ({'lower' if scale < 0 else 'higher'} is better)"


def _evaluations(run_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    out = []
    for path in sorted((run_dir / "eval").glob("*/results.json")):
        try:
            out.append((path.parent, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def _eval_section(run_dir: Path) -> str:
    parts = []
    for directory, data in _evaluations(run_dir):
        models: dict[str, dict[str, Any]] = data.get("models", {})
        rows = []
        compare = data.get("compare") or {}
        metrics = next(iter(models.values()), {}).get("summary", {}).keys() if models else []
        displayed = data.get("displayed") or {}
        for metric in metrics:
            row = [_displayed_label(metric, displayed)]
            for label in models:
                s = models[label]["summary"].get(metric, {})
                row.append(f"{s.get('mean', float('nan')):.4f} ± {s.get('se', float('nan')):.4f}")
            if compare:
                c = compare.get(metric, {})
                row.append(f"{c.get('diff', float('nan')):+.4f} ± {c.get('se', float('nan')):.4f} "
                           f"(z {c.get('z', float('nan')):+.1f})")
            rows.append(row)
        header = ["metric", *models, *(["trained - base"] if compare else [])]
        what = (f"{data.get('prompts', '')}; {data.get('samples_per_prompt', '?')} sample(s) per prompt, seed "
                f"{data.get('seed', '?')}, {data.get('sampler', '?')} sampler, {data.get('num_steps', '?')} steps, "
                f"CFG {data.get('guidance_scale', '?')}{' (during training)' if data.get('during_training') else ''}")
        grids = "".join(f'<figure><img alt="{html.escape(label)} samples" src="{_data_url(directory / m["grid"])}">'
                        f"<figcaption>{html.escape(label)}</figcaption></figure>"
                        for label, m in models.items() if (m.get("grid") or "").endswith(".png")
                        and (directory / m["grid"]).is_file())
        for label, m in models.items():  # speech: each sample's scores beside a player
            clips = [x for x in m.get("samples", []) if "audio" in x][:MAX_EVAL_CLIPS]
            if clips:
                grids += (f"<figure><figcaption>{html.escape(label)}: the first {len(clips)} of "
                          f"{len(m['samples'])} samples</figcaption>{_speech_table(clips, directory, list(metrics))}"
                          "</figure>")
        parts.append(f"<h3>{html.escape(directory.name)}</h3><p>{html.escape(what)}</p>"
                     f"{_table(rows, header)}<div class=grids>{grids}</div>")
    return "".join(parts)


def build_report(run_dir: Path) -> str:
    """The report page of ``run_dir`` as HTML text."""
    from omnirl_core.rundir.rundir import RunDir

    rd = RunDir(run_dir)
    config = rd.saved_config()
    if config is None:
        raise UsageError(f"'{run_dir}' is not an omnirl run directory (no config.yaml).",
                         hint="Pass the --output-dir of a training run.")
    records = rd.read_metrics()
    rewards = [e.get("name", "?") for e in config.get("rewards", [])]
    charts = []
    mean = _column(records, "reward/mean")
    if mean:
        band = [(r["step"], r["reward/mean"] - r.get("reward/std", 0.0), r["reward/mean"] + r.get("reward/std", 0.0))
                for r in records if _finite(r.get("reward/mean")) and _finite(r.get("reward/std", 0.0))]
        series = {"reward/mean": mean,
                  "moving average": _moving_average(mean, max(1, len(mean) // 10))}
        charts.append(line_chart("Reward (mean over the step's samples, band: ± std)", series,
                                 bands={"reward/mean": band}, ylabel="reward"))
    if len(rewards) > 1:
        charts.append(line_chart("Each reward", {f"reward/{n}": _column(records, f"reward/{n}") for n in rewards}))
    evals = _column(records, "eval/reward/mean")
    if evals:
        band = [(r["step"], r["eval/reward/mean"] - r.get("eval/reward/se", 0.0),
                 r["eval/reward/mean"] + r.get("eval/reward/se", 0.0))
                for r in records if _finite(r.get("eval/reward/mean"))]
        series = {"eval/reward/mean": evals}
        if len(rewards) > 1:
            series.update({f"eval/reward/{n}": _column(records, f"eval/reward/{n}") for n in rewards})
        charts.append(line_chart("Held-out evaluation (ODE sampler, fixed seeds; band: ± standard error)", series,
                                 bands={"eval/reward/mean": band}, ylabel="reward"))
    for key, title in (("kl", "KL to the reference"), ("clip_frac", "Clip fraction"), ("loss", "Loss"),
                       ("logprob/abs_delta_max", "Largest trainer vs rollout log-prob gap")):
        chart = line_chart(title, {key: _column(records, key)})
        if chart:
            charts.append(chart)
    timing = {k: _column(records, f"time/{k}_s") for k in ("rollout", "reward", "train", "sync", "eval")}
    timing = {f"{k} s": v for k, v in timing.items() if v and any(y > 0 for _, y in v)}
    if timing:
        charts.append(line_chart("Time split of a step (stacked, seconds)", timing, stacked=True, ylabel="seconds"))
    grids = sorted(rd.samples.glob("step-*.png")) if rd.samples.is_dir() else []
    by_step = {r["step"]: r for r in records}
    figures = []
    for path in _spaced(grids, MAX_GRIDS):
        step = int(path.stem.removeprefix("step-"))
        r = by_step.get(step, {})
        caption = f"step {step}" + (f", reward/mean {r['reward/mean']:.4f}" if _finite(r.get("reward/mean")) else "")
        figures.append(f'<figure><img alt="samples at step {step}" src="{_data_url(path)}">'
                       f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    texts = sorted(rd.samples.glob("step-*.jsonl")) if rd.samples.is_dir() else []
    for path in _spaced(texts, MAX_GRIDS):
        lines = _read_listing(path)[:LISTED]
        if lines and all("audio" in x for x in lines):  # speech: samples/step-N/NNN.wav, a player each
            table = _speech_table(lines, rd.samples, ["reward"])
        else:
            table = _table([[x.get("prompt", ""), str(x.get("output", ""))[:200], _score(x.get("reward"))]
                            for x in lines], ["prompt", "output", "reward"])
        figures.append(f"<figure><figcaption>{html.escape(path.stem)}</figcaption>{table}</figure>")
    total_s = sum(r.get("time/step_s", 0.0) for r in records if _finite(r.get("time/step_s")))
    model = config.get("model", {})
    facts = [
        ["model", f"{model.get('name')} (preset {model.get('preset') or '-'}, path {model.get('path') or '-'})"],
        ["algorithm", str(config.get("algorithm", {}).get("name"))],
        ["rewards", ", ".join(f"{e.get('name')} x{e.get('weight')}" for e in config.get("rewards", []))],
        ["prompts", str(config.get("data", {}).get("prompts") or "the reward's suggested prompts")],
        ["steps", f"{len(records)} of {config.get('run', {}).get('steps')}"],
        ["samples per step", (f"{config.get('rollout', {}).get('prompts_per_step')} prompts x "
                             f"{config.get('rollout', {}).get('group_size')}")],
        ["step time", f"{total_s:.1f} s in all, {total_s / max(len(records), 1):.2f} s per step"],
    ]
    learning = _learning(records)
    if learning:
        facts.append(["learning", learning])
    body = [
        f"<h1>omnirl run: {html.escape(run_dir.resolve().name)}</h1>",
        _table(facts, ["", ""]),
        "<h2>Curves</h2>",
        "<div class=charts>" + "".join(charts) + "</div>" if charts else "<p>No metrics rows yet.</p>",
        "<h2>Sample grids over time</h2>",
        "<div class=grids>" + "".join(figures) + "</div>" if figures else "<p>No sample grids.</p>",
    ]
    evaluation = _eval_section(run_dir)
    if evaluation:
        body += ["<h2>Evaluations</h2>", evaluation]
    style = ("body{font-family:sans-serif;margin:24px;color:#222}table{border-collapse:collapse;margin:8px 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:left}"
             ".charts{display:flex;flex-wrap:wrap;gap:12px}.grids{display:flex;flex-wrap:wrap;gap:12px}"
             "figure{margin:0}figure img{image-rendering:pixelated;max-width:460px;border:1px solid #ddd}"
             "figcaption{font-size:12px;color:#555}")
    return (f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>omnirl report: "
            f"{html.escape(run_dir.resolve().name)}</title><style>{style}</style></head><body>"
            + "".join(body) + "</body></html>\n")


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    from omnirl_core.rundir.checkpoint import write_atomic

    out = out or run_dir / "report.html"
    write_atomic(out, build_report(run_dir))
    return out

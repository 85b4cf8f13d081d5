"""Human-readable views of a spec: a text table and a picture."""

from __future__ import annotations

import io

import numpy as np

from .spec import Spec


def _weight(spec: Spec):
    from actdesign.designer.weights import from_dict

    return from_dict(spec.objective["weight"])


def describe(spec: Spec, origin: str | None = None) -> str:
    """A header with the fit's facts, then one row per code: its interval, level and mass."""
    act = spec.resolve_activation()
    weight = _weight(spec)
    borders = np.array(spec.borders)
    levels = np.array(spec.levels)
    edges = np.concatenate([[-np.inf], borders, [np.inf]])
    mass = np.diff(weight.cdf(edges))
    title = f"{origin}: " if origin else ""
    formula = "" if act.name is None else f" = {act.formula}"
    grid = f"; grid {spec.objective['grid']} cells" if "grid" in spec.objective else ""
    lines = [f"{title}{spec.kind} table, {spec.bits} bit(s), {act.label}{formula}",
             f"weight: {weight.describe()}{grid}"]
    err = spec.error
    if spec.pwl is not None:
        (alpha, beta), (gamma, delta) = spec.pwl["left"], spec.pwl["right"]
        lines.append(f"h~(x) = {alpha:g} + {beta:g}*x + sum a_i max(x - c_i, 0); asymptotes "
                     f"{alpha:g} + {beta:g}x (left), {gamma:g} + {delta:g}x (right)")
        lines.append(f"a = {', '.join(f'{v:.10g}' for v in spec.pwl['a'])}")
        if "objective" in err:
            lines.append(f"objective ∫ (h - h~)² w = {err['objective']:.8e}; "
                         f"max |h - h~| = {err.get('max_abs', float('nan')):.4e}")
    if "E" in err:
        parts = [f"E = {err['E']:.6e}"]
        if "relative" in err:
            parts.append(f"relative {err['relative']:.4e}")
        if "grid_E" in err and err["grid_E"] > 0:
            gain = (err["grid_E"] - err["E"]) / err["grid_E"]
            parts.append(f"the refined optimum is {100 * gain:.3f}% better than the grid's "
                         f"{err['grid_E']:.6e}")
        if "stationarity" in err:
            parts.append(f"stationarity {err['stationarity']:.1e}")
        lines.append("; ".join(parts))
    distinct = np.unique(levels).size
    if distinct < levels.size:
        lines.append(f"{distinct} distinct levels: more bits than this derivative needs")
    lines.append("")
    lines.append(f"{'code':>5}  {'from':>13}  {'to':>13}  {'level':>13}  {'mass':>9}")
    for k in range(levels.size):
        lines.append(f"{k:5d}  {edges[k]:13.6g}  {edges[k + 1]:13.6g}  {levels[k]:13.8g}  "
                     f"{mass[k]:9.4%}")
    return "\n".join(lines)


def plot(spec: Spec, path) -> None:
    """f' with the step function on top, the error f' - q below, the weight shaded."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    act = spec.resolve_activation()
    weight = _weight(spec)
    borders = np.array(spec.borders)
    levels = np.array(spec.levels)
    lo, hi = weight.candidate_range
    if hasattr(weight, "std"):  # a normal weight: show where inputs actually fall
        lo, hi = weight.mean - 4 * weight.std, weight.mean + 4 * weight.std
    inner = borders[(borders > lo) & (borders < hi)]
    span = hi - lo
    x = np.union1d(np.linspace(lo, hi, 4001), np.concatenate([inner, inner + 1e-9 * span]))
    g = act.df(x)
    q = levels[np.searchsorted(borders, x, side="right")]
    if spec.pwl is not None:
        _plot_pwl(spec, act, x, g, q, inner, path)
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.plot(x, g, color="black", lw=1.5, label="f'(x)")
    top.step(x, q, where="post", color="tab:red", lw=1.2,
             label=f"{spec.bits}-bit table q(x)")
    for b in inner:
        top.axvline(b, color="tab:red", lw=0.4, alpha=0.4)
    shade = top.twinx()
    shade.fill_between(x, weight.pdf(x), color="tab:blue", alpha=0.12, lw=0)
    shade.set_yticks([])
    shade.set_ylim(bottom=0)
    top.set_ylabel("derivative")
    top.set_title(f"{act.label}: {spec.bits}-bit derivative table, "
                  f"E = {spec.error.get('E', float('nan')):.3e} ({weight.describe()})",
                  fontsize=9)
    top.legend(loc="best", fontsize=8)
    bottom.plot(x, g - q, color="tab:purple", lw=1)
    bottom.axhline(0, color="gray", lw=0.5)
    bottom.set_ylabel("f'(x) - q(x)")
    bottom.set_xlabel("x")
    save_figure(fig, path)


def _plot_pwl(spec: Spec, act, x, g, q, inner, path) -> None:
    """h and h~ on top; h' and the step h~' below."""
    from matplotlib import pyplot as plt

    alpha, beta = spec.pwl["left"]
    c, a = np.array(spec.pwl["c"]), np.array(spec.pwl["a"])
    approx = alpha + beta * x + np.maximum(x[:, None] - c, 0.0) @ a
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    top.plot(x, act.f(x), color="black", lw=1.5, label="h(x)")
    top.plot(x, approx, color="tab:red", lw=1.2, label=f"h~(x), {c.size} kinks")
    top.set_title(f"{act.label}: {spec.bits}-bit piecewise-linear fit, objective "
                  f"{spec.error.get('objective', float('nan')):.3e}", fontsize=9)
    bottom.plot(x, g, color="black", lw=1.5, label="h'(x)")
    bottom.step(x, q, where="post", color="tab:red", lw=1.2, label="h~'(x) (the levels)")
    for ax in (top, bottom):
        for b in inner:
            ax.axvline(b, color="tab:red", lw=0.4, alpha=0.4)
        ax.legend(loc="best", fontsize=8)
    bottom.set_xlabel("x")
    save_figure(fig, path)


def save_figure(fig, path) -> None:
    """A matplotlib figure as a PNG marked as ours (so --force is not needed to redraw it),
    written atomically; the figure is closed."""
    from matplotlib import pyplot as plt

    from .files import PNG_SOFTWARE, write_atomic

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": PNG_SOFTWARE})
    plt.close(fig)
    write_atomic(path, buf.getvalue())

"""Weights w(x) for the designer's objectives: where the inputs of an activation fall.

Every weight is normalised to a probability density, so an objective is an expectation over
inputs. Each one knows three ranges:
- `integration_range`: finite, and holds all the mass a float64 integral can see;
- `candidate_range`: where borders are worth placing (all but a negligible tail);
- `breakpoints`: points inside the integration range where the density jumps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from actdesign.errors import ActdesignError

_SQRT_2PI = math.sqrt(2.0 * math.pi)
NORMAL_CANDIDATE_SIGMAS = 6.0  # borders beyond mean ± 6 std change E by < 1e-9 relative
NORMAL_INTEGRATION_SIGMAS = 40.0  # the normal pdf underflows float64 beyond ~38.5 std
MAX_HISTOGRAM_BINS = 4096
# Weights must stay where float64 resolves the designer's grid: up to 2^20 cells over 12
# std (or the domain) are >= 1e-5 std wide, so a scale >= 1e-9 |centre| keeps each cell
# thousands of float64 spacings wide; 1e12 keeps squares and integrals far from overflow.
MAX_LOCATION = 1e12
MIN_SCALE = 1e-12
MIN_RELATIVE_SCALE = 1e-9


def _check_scale(what: str, centre: float, scale: float) -> None:
    if not (abs(centre) <= MAX_LOCATION and MIN_SCALE <= scale <= 2 * MAX_LOCATION
            and scale >= MIN_RELATIVE_SCALE * abs(centre)):
        raise ActdesignError(f"{what} is out of range: need |location| <= {MAX_LOCATION:g} "
                             f"and a width in [{MIN_SCALE:g}, {2 * MAX_LOCATION:g}] and >= "
                             f"{MIN_RELATIVE_SCALE:g} x |location|")


@dataclass(frozen=True)
class Normal:
    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self):
        if not (math.isfinite(self.mean) and math.isfinite(self.std) and self.std > 0):
            raise ActdesignError(f"normal weight needs a finite mean and a std > 0, got "
                                 f"mean={self.mean}, std={self.std}")
        _check_scale(f"normal weight (mean={self.mean:g}, std={self.std:g})", self.mean,
                     self.std)

    def pdf(self, x):
        z = (np.asarray(x, dtype=float) - self.mean) / self.std
        return np.exp(-0.5 * z * z) / (self.std * _SQRT_2PI)

    def cdf(self, x):
        from scipy.special import ndtr

        return ndtr((np.asarray(x, dtype=float) - self.mean) / self.std)

    @property
    def integration_range(self):
        s = NORMAL_INTEGRATION_SIGMAS * self.std
        return (self.mean - s, self.mean + s)

    @property
    def candidate_range(self):
        s = NORMAL_CANDIDATE_SIGMAS * self.std
        return (self.mean - s, self.mean + s)

    @property
    def breakpoints(self):
        return np.empty(0)

    def to_dict(self):
        return {"type": "normal", "mean": self.mean, "std": self.std}

    def describe(self):
        return f"normal(mean={self.mean:g}, std={self.std:g})"


@dataclass(frozen=True)
class Uniform:
    low: float
    high: float

    def __post_init__(self):
        if not (math.isfinite(self.low) and math.isfinite(self.high) and self.low < self.high):
            raise ActdesignError(f"bad domain [{self.low}, {self.high}]: need finite L < R")
        _check_scale(f"domain [{self.low:g}, {self.high:g}]", max(abs(self.low), abs(self.high)),
                     self.high - self.low)

    def pdf(self, x):
        x = np.asarray(x, dtype=float)
        inside = (x >= self.low) & (x <= self.high)
        return np.where(inside, 1.0 / (self.high - self.low), 0.0)

    def cdf(self, x):
        return np.clip((np.asarray(x, dtype=float) - self.low) / (self.high - self.low), 0, 1)

    @property
    def integration_range(self):
        return (self.low, self.high)

    candidate_range = integration_range

    @property
    def breakpoints(self):
        return np.empty(0)

    def to_dict(self):
        return {"type": "uniform", "domain": [self.low, self.high]}

    def describe(self):
        return f"uniform on [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True)
class Flat(Uniform):
    """The unweighted objective on [low, high]: density 1 there, not normalised."""

    def pdf(self, x):
        x = np.asarray(x, dtype=float)
        return np.where((x >= self.low) & (x <= self.high), 1.0, 0.0)

    def to_dict(self):
        return {"type": "flat", "domain": [self.low, self.high]}

    def describe(self):
        return f"unweighted on [{self.low:g}, {self.high:g}]"


@dataclass(frozen=True, eq=False)
class Histogram:
    """A density from recorded values, given as counts over ascending bin edges.

    The density is the histogram's frequency polygon: linear between bin centres, flat from
    the outer centres to the outer edges, scaled to integrate to 1. It is continuous inside
    the edges, so the designer's Newton refinement sees no jumps in the density (a step
    histogram stalls it at bin edges); each bin's mass is preserved up to the slopes' tilt.
    """

    edges: np.ndarray
    counts: np.ndarray
    source: str | None = None

    def __post_init__(self):
        edges = np.asarray(self.edges, dtype=float)
        counts = np.asarray(self.counts, dtype=float)
        if edges.ndim != 1 or counts.ndim != 1 or edges.size != counts.size + 1:
            raise ActdesignError("a histogram needs 1-D edges with one more entry than counts")
        if counts.size == 0 or counts.size > MAX_HISTOGRAM_BINS:
            raise ActdesignError(f"a histogram needs 1..{MAX_HISTOGRAM_BINS} bins")
        if not (np.all(np.isfinite(edges)) and np.all(np.isfinite(counts))):
            raise ActdesignError("histogram edges and counts must be finite")
        if np.any(np.diff(edges) <= 0):
            raise ActdesignError("histogram edges must be strictly ascending")
        _check_scale(f"histogram on [{edges[0]:g}, {edges[-1]:g}]",
                     max(abs(edges[0]), abs(edges[-1])), edges[-1] - edges[0])
        if np.any(counts < 0) or counts.sum() <= 0:
            raise ActdesignError("histogram counts must be >= 0 with a positive total")
        object.__setattr__(self, "edges", edges)
        object.__setattr__(self, "counts", counts)
        # The polygon's nodes and values, and its cumulative mass at each node.
        height = counts / np.diff(edges)
        nodes = np.concatenate([[edges[0]], 0.5 * (edges[:-1] + edges[1:]), [edges[-1]]])
        values = np.concatenate([[height[0]], height, [height[-1]]])
        mass = np.concatenate([[0.0], np.cumsum(0.5 * (values[1:] + values[:-1])
                                                 * np.diff(nodes))])
        object.__setattr__(self, "_nodes", nodes)
        object.__setattr__(self, "_values", values / mass[-1])
        object.__setattr__(self, "_mass", mass / mass[-1])

    def pdf(self, x):
        x = np.asarray(x, dtype=float)
        inside = (x >= self.edges[0]) & (x <= self.edges[-1])
        return np.where(inside, np.interp(x, self._nodes, self._values), 0.0)

    def cdf(self, x):
        x = np.clip(np.asarray(x, dtype=float), self.edges[0], self.edges[-1])
        k = np.clip(np.searchsorted(self._nodes, x, side="right") - 1, 0, self._nodes.size - 2)
        x0, dx = self._nodes[k], np.diff(self._nodes)[k]
        v0, dv = self._values[k], np.diff(self._values)[k]
        u = x - x0
        return self._mass[k] + v0 * u + 0.5 * dv / dx * u * u

    @property
    def integration_range(self):
        return (float(self.edges[0]), float(self.edges[-1]))

    @property
    def candidate_range(self):
        """The range between the 1e-9 and 1 - 1e-9 quantiles: lone outliers waste no grid."""
        lo = float(np.interp(1e-9, self._mass, self._nodes))
        hi = float(np.interp(1 - 1e-9, self._mass, self._nodes))
        return (lo, hi) if hi > lo else self.integration_range

    @property
    def breakpoints(self):
        """The polygon's corners: quadrature pieces end there."""
        return self._nodes[1:-1]

    def to_dict(self):
        d = {"type": "empirical", "edges": self.edges.tolist(), "counts": self.counts.tolist()}
        if self.source:
            d["source"] = self.source
        return d

    def describe(self):
        src = f" from {self.source}" if self.source else ""
        return f"empirical{src} ({self.counts.size}-bin frequency polygon, " \
               f"[{self.edges[0]:g}, {self.edges[-1]:g}])"

    @classmethod
    def from_values(cls, values, source=None):
        """Bins: Freedman-Diaconis width over the central 99.9%, plus two bins for the tails."""
        v = np.asarray(values, dtype=float).ravel()
        if v.size < 2:
            raise ActdesignError("empirical weight needs at least 2 values")
        if not np.all(np.isfinite(v)):
            raise ActdesignError("empirical values contain NaN or infinity")
        lo_q, q25, q75, hi_q = np.quantile(v, [0.0005, 0.25, 0.75, 0.9995])
        vmin, vmax = float(v.min()), float(v.max())
        if vmax <= vmin:
            raise ActdesignError("empirical values are all equal; a density needs a spread")
        if hi_q <= lo_q:
            lo_q, hi_q = vmin, vmax
        width = 2 * (q75 - q25) / np.cbrt(v.size)
        bins = int(np.clip((hi_q - lo_q) / width if width > 0 else 1024, 32, 1024))
        inner = np.linspace(lo_q, hi_q, bins + 1)
        edges = np.unique(np.concatenate([[vmin], inner, [vmax]]))
        counts, _ = np.histogram(v, bins=edges)
        return cls(edges, counts.astype(float), source)


def load_empirical(path: str | Path) -> Histogram:
    """Raw values from a .npy file, or a histogram (arrays `edges` and `counts`) from .npz.

    Files are read with allow_pickle=False: a data file can never run code.
    """
    import io
    import zipfile

    from actdesign.files import MAX_DATA_BYTES, read_data

    path = Path(path)
    raw = read_data(path, "empirical", MAX_DATA_BYTES)
    try:
        if raw.startswith(b"PK"):  # an .npz: a compressed member may unpack without limit
            with zipfile.ZipFile(io.BytesIO(raw)) as archive:
                if sum(i.file_size for i in archive.infolist()) > MAX_DATA_BYTES:
                    raise ActdesignError(f"empirical file {str(path)!r} unpacks to more than "
                                         f"{MAX_DATA_BYTES // 2**20} MiB")
        data = np.load(io.BytesIO(raw), allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise ActdesignError(f"cannot read empirical file {str(path)!r}: "
                             f"{str(exc).splitlines()[0]}") from None
    if isinstance(data, np.lib.npyio.NpzFile):
        with data:
            if not {"edges", "counts"} <= set(data.files):
                raise ActdesignError(f"{str(path)!r}: an .npz histogram needs arrays "
                                     "'edges' and 'counts'")
            edges, counts = data["edges"], data["counts"]
        _require_numeric(path, edges, counts)
        return Histogram(edges, counts, path.name)
    _require_numeric(path, data)
    return Histogram.from_values(data, path.name)


def _require_numeric(path, *arrays):
    for a in arrays:
        if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
            raise ActdesignError(f"{str(path)!r}: expected numbers, found dtype {a.dtype}")


def from_dict(d: dict):
    """The weight described by a spec's objective.weight (already validated)."""
    kind = d["type"]
    if kind == "normal":
        return Normal(d["mean"], d["std"])
    if kind == "uniform":
        return Uniform(*d["domain"])
    if kind == "flat":
        return Flat(*d["domain"])
    if kind == "empirical":
        return Histogram(d["edges"], d["counts"], d.get("source"))
    raise ActdesignError(f"unknown weight type {kind!r}")

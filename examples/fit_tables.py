"""Fit few-bit derivative tables from Python, and see what each extra bit buys.

Run: .venv/bin/python examples/fit_tables.py
"""

from pathlib import Path

from actdesign import spec
from actdesign.activation import resolve
from actdesign.designer import Normal, Uniform, fit_stepwise

out = Path("out")
out.mkdir(exist_ok=True)

for name in ("gelu", "silu", "x*tanh(softplus(x))"):
    act = resolve(name)
    row = [f"{fit_stepwise(act, bits).relative_error:9.2e}" for bits in range(1, 5)]
    print(f"{act.label:>20}  relative E for 1..4 bits under N(0,1): {'  '.join(row)}")

# The same activation, tuned for wider inputs: the table moves where the inputs are.
wide = fit_stepwise(resolve("gelu"), 3, Normal(0.0, 3.0))
flat = fit_stepwise(resolve("gelu"), 3, Uniform(-8.0, 8.0))
print("gelu, 3 bits, N(0, 9) borders:   ", wide.borders.round(3))
print("gelu, 3 bits, U[-8, 8] borders:  ", flat.borders.round(3))
spec.save(spec.from_fit(wide), out / "gelu3_wide.json")
print(f"wrote {out / 'gelu3_wide.json'}")

"""The speed goals, read off step_profile.py's JSON files (rows measured in one run on one card):
each goal's ratio, its limit, and whether it is met.

    python benchmarks/speed_goals.py out/speed_*.json [--markdown]

Goals: `llm` at most eager's step time; at most Liger-Kernel's, at most 0.85x Liger's peak;
`llm+checkpointing` at most 1.05x checkpointing's time; `llm+actnn2` at most 1.10x `llm`'s;
with LoRA, `llm` at most 1.05x PEFT's time at most 0.6x PEFT's peak. A goal whose rows are
missing from a file (Liger not installed, a row that ran out of time) is not listed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from measure import table  # noqa: E402

# (name, row, against, measure, limit)
GOALS = [("time vs eager", "llm", "eager", "step_ms", 1.00),
         ("time vs Liger", "llm", "liger", "step_ms", 1.00),
         ("peak vs Liger", "llm", "liger", "peak_mib", 0.85),
         ("checkpointed time", "llm+checkpointing", "checkpointing", "step_ms", 1.05),
         ("actnn2 on llm", "llm+actnn2", "llm", "step_ms", 1.10),
         ("LoRA time vs PEFT", "llm", "peft", "step_ms", 1.05),
         ("LoRA peak vs PEFT", "llm", "peft", "peak_mib", 0.60)]


def goals(profile: dict) -> list[tuple[str, str, float, float]]:
    """(setup, goal, ratio, limit) for each goal whose two rows the profile has."""
    rows = {r["policy"]: r for r in profile["rows"]}
    shape = f"{profile['model']} {profile['batch']} x {profile['seq']}" + (
        f", LoRA r={profile['lora']}" if profile.get("lora") else "")
    out = []
    for name, row, against, key, limit in GOALS:
        if name.startswith("LoRA") != bool(profile.get("lora")):
            continue
        if row in rows and against in rows and rows[row].get(key) and rows[against].get(key):
            out.append((shape, name, rows[row][key] / rows[against][key], limit))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    found = []
    for path in args.files:
        profile = json.loads(Path(path).read_text())
        found += goals(profile)
        device = profile["device"]
    print(f"\nSpeed goals on {device if args.files else '?'} (each ratio from one run)")
    line = table(["setup", "goal", "ratio", "limit", "met"], args.markdown, width=20, first=34)
    for shape, name, ratio, limit in found:
        line([shape, name, f"{ratio:.3f}", f"{limit:.2f}", "yes" if ratio <= limit else "NO"])


if __name__ == "__main__":
    main()

"""The record the cost model predicts from (``comfuse/planner/cost.py``: BEST_SEEN), read
again from stored autotuning decisions: per schedule, how many regions timed its plans and
the best and worst of their best times over the region's unfused ops; where decisions carry
the roofline's estimates, how far each estimate was from the measured time.

    python scripts/plan_record.py [DIR ...]   # default: every bench/results/**/tuning/
"""
from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path


def schedule_of(name: str, plans: dict) -> str:
    if name in plans and "schedule" in plans[name]:
        return plans[name]["schedule"]
    found = re.match(r"comfuse_([a-z_0-9]+?)_[0-9a-f]{16}$", name)
    return found.group(1) if found else name


def main(argv: list) -> None:
    roots = [Path(a) for a in argv] or [Path(__file__).resolve().parents[1] / "bench" / "results"]
    files = {p.name: p for root in roots for p in sorted(root.glob("**/tuning/*.json"))}  # (copies once)
    best, errors = {}, []
    for path in files.values():
        d = json.loads(path.read_text())
        times, plans = d.get("times_ms", {}), d.get("plans", {})
        unfused = times.get("unfused", math.inf)
        if not math.isfinite(unfused):
            continue
        mine = {}
        for name, t in times.items():
            if name == "unfused" or not math.isfinite(t):
                continue
            s = schedule_of(name, plans)
            mine[s] = min(mine.get(s, math.inf), t / unfused)
            if "estimate_ms" in plans.get(name, {}):
                errors.append(plans[name]["estimate_ms"] / t)
        for s, r in mine.items():
            best.setdefault(s, []).append(r)
    print(f"{len(files)} decisions")
    print("| schedule | regions | best time over the ops' | worst |")
    print("|---|---|---|---|")
    for s, rs in sorted(best.items()):
        print(f"| {s} | {len(rs)} | {min(rs):.2f} | {max(rs):.2f} |")
    if errors:
        print(f"estimates over measured times: median {statistics.median(errors):.2f}, "
              f"range {min(errors):.2f}-{max(errors):.2f} over {len(errors)} plans")


if __name__ == "__main__":
    main(sys.argv[1:])

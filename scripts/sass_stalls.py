"""Where a warp-specialised kernel's warps wait, from Nsight Compute's per-instruction samples.

Reads the SASS page of an ncu report as CSV (``scripts/ncu_stages.py`` says how to make one)
and prints, per partition (the code between ``USETMAXREG`` instructions: each partition of a
``gl.warp_specialize`` sets its own register count first):

- its instructions, how often they ran, its warp-stall samples and the leading stall reasons;
- its shared-memory wavefronts against the ideal (bank conflicts) and its global sectors
  against the ideal (uncoalesced accesses);
- with ``--ranges``, the same sums over instruction ranges (say, one pass of the epilogue);
- with ``--top``, the most-stalled instructions with the one that last wrote an operand
  (what the warp waits on).

    python scripts/sass_stalls.py ln1024-sass.csv [--top 15] [--ranges 82:3145,3145:3475]
"""
from __future__ import annotations

import argparse
import collections
import csv
import re


def load(path: str):
    """(instruction texts, rows as dicts of int counters) of an ncu SASS CSV."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names, data = rows[head], rows[head + 1:]

    def num(v: str) -> int:
        try:
            return int(v.replace(",", ""))
        except ValueError:
            return 0
    src = [r[names.index("Source")].strip() for r in data]
    counters = [{n: num(v) for n, v in zip(names, r) if n != "Source"} for r in data]
    return src, counters


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0]


def summary(src, cnt, lo: int, hi: int, label: str) -> str:
    stalls = collections.Counter()
    for c in cnt[lo:hi]:
        for k, v in c.items():
            if k.startswith("stall_") and "Not Issued" not in k:
                stalls[k[6:]] += v
    total = sum(stalls.values())
    lead = ", ".join(f"{k} {100 * v / max(total, 1):.0f}%" for k, v in stalls.most_common(5) if v)
    shared = sum(c.get("L1 Wavefronts Shared", 0) for c in cnt[lo:hi])
    shared_ideal = sum(c.get("L1 Wavefronts Shared Ideal", 0) for c in cnt[lo:hi])
    sectors = sum(c.get("L2 Theoretical Sectors Global", 0) for c in cnt[lo:hi])
    sectors_ideal = sum(c.get("L2 Theoretical Sectors Global Ideal", 0) for c in cnt[lo:hi])
    ran = sum(c.get("Instructions Executed", 0) for c in cnt[lo:hi])
    return (f"{label}: instructions [{lo}, {hi}) ({hi - lo}), run {ran}, stall samples {total}: {lead}\n"
            f"    shared wavefronts {shared} (ideal {shared_ideal}, x{shared / max(shared_ideal, 1):.2f}); "
            f"global sectors {sectors} (ideal {sectors_ideal}, x{sectors / max(sectors_ideal, 1):.2f})")


def producers(src, i: int, lo: int) -> list:
    """For each register instruction i reads, the last instruction before it (from lo) that
    wrote it: what the warp may wait on (a load, for a long-scoreboard stall)."""
    body = re.sub(r"^@!?U?P\w+\s+", "", src[i]).split(" ", 1)
    reads = set(re.findall(r"\bR\d+\b", body[1].split(",", 1)[1] if len(body) > 1 and "," in body[1] else ""))
    found = []
    for j in range(i - 1, lo - 1, -1):
        m = re.match(r"(@!?U?P\w+\s+)?([A-Z][\w.]*)\s+R(\d+)\b", src[j])
        if not reads or not m or m.group(2).startswith(("ST", "RED", "ATOM")):
            continue
        width = 4 if ".128" in m.group(2) else 2 if ".64" in m.group(2) else 1
        written = {f"R{int(m.group(3)) + k}" for k in range(width)} & reads
        if written:
            found.append(j)
            reads -= written
    return sorted(found)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--ranges", default="", help="instruction index ranges, lo:hi comma-separated")
    args = ap.parse_args()
    src, cnt = load(args.csv)
    total = sum(c.get("Warp Stall Sampling (All Samples)", 0) for c in cnt)
    print(f"{args.csv}: {len(src)} instructions, {total} warp-stall samples")
    marks = [i for i, s in enumerate(src) if "USETMAXREG" in s]
    bounds = sorted({0, *marks, len(src)})
    for lo, hi in zip(bounds, bounds[1:]):
        regs = re.search(r"0x([0-9a-f]+)\s*$", src[lo]) if "USETMAXREG" in src[lo] else None
        label = f"partition from {src[lo][:40]!r}" + (f" ({int(regs.group(1), 16)} registers)" if regs else "")
        if hi - lo > 1:
            print(summary(src, cnt, lo, hi, label))
    for part in filter(None, args.ranges.split(",")):
        lo, hi = (int(v) for v in part.split(":"))
        print(summary(src, cnt, lo, hi, "range"))
    if args.top:
        print(f"the {args.top} most-stalled instructions (index, samples, leading reason, text <- last writer):")
        order = sorted(range(len(src)), key=lambda i: -cnt[i].get("Warp Stall Sampling (All Samples)", 0))
        for i in sorted(order[:args.top]):
            reasons = sorted(((v, k[6:]) for k, v in cnt[i].items() if k.startswith("stall_")
                              and "Not Issued" not in k), reverse=True)
            lo = max(m for m in [0, *marks] if m <= i)
            samples = cnt[i].get("Warp Stall Sampling (All Samples)", 0)
            print(f"  {i:5d} {samples:5d} {reasons[0][1]:>10}  {src[i][:56]}")
            for j in producers(src, i, lo):
                print(f"  {'':24}<- {j}: {src[j][:60]}")


if __name__ == "__main__":
    main()

"""scripts/sass_stalls.py on a small made-up Nsight Compute SASS table: partitions cut at
USETMAXREG, stall sums, and the instructions that wrote a stalled instruction's operands."""
import csv
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sass_stalls.py"
HEAD = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "L1 Wavefronts Shared",
        "L1 Wavefronts Shared Ideal", "L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Ideal",
        "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]
ROWS = [  # (source, samples, long_sb, barrier, shared wavefronts, ideal)
    ("LDC R1, c[0x0][0x28]", 0, 0, 0, 0, 0),
    ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x98", 1, 0, 1, 0, 0),
    ("LDG.E.128 R52, desc[UR10][R16.64]", 2, 0, 0, 0, 0),
    ("LDS.128 R68, [R92+0x18000]", 1, 0, 0, 16, 4),
    ("PRMT R71, R52, 0x7632, R71", 40, 38, 2, 0, 0),
    ("USETMAXREG.DEALLOC.CTAPOOL 0xb0", 0, 0, 0, 0, 0),
    ("@P0   R2UR UR7, R7", 5, 0, 5, 0, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0, 0x100", 20, 0, 20, 0, 0),
]


def load_script():
    spec = importlib.util.spec_from_file_location("sass_stalls", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_table(path: Path) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f, quoting=csv.QUOTE_ALL)
        out.writerow(["Kernel Name", "k"])
        out.writerow(HEAD)
        for n, (src, samples, long_sb, barrier, wav, ideal) in enumerate(ROWS):
            out.writerow([hex(0x1000 + 16 * n), src, samples, 1024, wav, ideal, 0, 0, long_sb, barrier, long_sb])


def test_partitions_stalls_and_producers(tmp_path, capsys, monkeypatch):
    sass_stalls = load_script()
    table = tmp_path / "k-sass.csv"
    write_table(table)
    src, cnt = sass_stalls.load(str(table))
    assert len(src) == len(ROWS) and cnt[4]["stall_long_sb"] == 38
    line = sass_stalls.summary(src, cnt, 1, 5, "epilogue")
    # (the "Not Issued" column is not counted twice)
    assert "stall samples 41: long_sb 93%, barrier 7%" in line and "x4.00" in line
    # PRMT reads R52 (the LDG's) and R71 (the LDS.128's fourth register); an R2UR writes no R
    assert sass_stalls.producers(src, 4, 1) == [2, 3]
    assert sass_stalls.producers(src, 7, 5) == []
    monkeypatch.setattr("sys.argv", ["sass_stalls.py", str(table), "--top", "2", "--ranges", "2:5"])
    sass_stalls.main()
    out = capsys.readouterr().out
    assert "(152 registers)" in out and "(176 registers)" in out and "range: instructions [2, 5)" in out
    assert "<- 2: LDG.E.128 R52" in out

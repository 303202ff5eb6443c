"""The models suite's report: the table of every (model, form) row, the ratios against
Inductor in the same mode, the profiles' and fused regions' lines, and the figure."""
from __future__ import annotations

from pathlib import Path

from .kernels import fused_lines, profile_lines


def _fmt(t) -> str:
    return f"{t[0]:.3f} [{t[1]:.3f}..{t[2]:.3f}]" if t else "-"


def markdown(results: dict) -> str:
    """The table: per model and form, times with their range, tokens a second, peak memory,
    first calls cold and warm, and the checks against eager; the step's speed against
    Inductor's in the same mode (``_baseline``)."""
    meta = results.get("meta", {})
    lines = [f"# Whole models: {meta.get('gpu') or meta.get('device', '')}, torch {meta.get('torch', '?')}, "
             f"{'small sizes' if meta.get('small') else 'real sizes'}", "",
             "| model | form | forward ms [range] | step ms [range] | step tokens/s | step vs Inductor | "
             "peak GiB fwd / step | first step s cold / warm | first forward s cold / warm | "
             "loss rel err | grads rel err | loss-only forward ms [range] | loss-only step ms [range] | "
             "vs Inductor | peak GiB | loss / grads rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["model"], r["form"]): r["step_ms"][0] for r in results["rows"]
            if r.get("form", "").startswith("inductor") and r.get("step_ms")}
    base_loss = {(r["model"], r["form"]): r["loss_step_ms"][0] for r in results["rows"]
                 if r.get("form", "").startswith("inductor") and r.get("loss_step_ms")}
    for r in results["rows"]:
        layers = r.get("layers", "?")
        head = f"| {r['model']} ({layers} layer{'' if layers == 1 else 's'}) | {r['form']} |"
        if r.get("skipped") or r.get("error"):
            lines.append(f"{head} {'n/a: ' + r['skipped'] if r.get('skipped') else 'error: ' + r['error']} |" +
                         " |" * 13)
            continue
        step_ms = r.get("step_ms")
        tokens = f"{r['batch'] * r['seq'] / step_ms[0] * 1e3:,.0f}" if step_ms else "-"
        key = _baseline(r, base)
        speed = f"{base[key] / step_ms[0]:.3f}x" if step_ms and key else "-"
        warm = r.get("warm", {})
        peaks = " / ".join(str(r.get(k) if r.get(k) is not None else "-") for k in ("forward_peak_gib", "step_peak_gib"))
        lines.append(f"{head} {_fmt(r.get('forward_ms'))} | {_fmt(step_ms)} | {tokens} | {speed} | {peaks} | "
                     f"{r.get('first_step_s', '-')} / {warm.get('first_step_s', '-')} | "
                     f"{r.get('first_forward_s', '-')} / {warm.get('first_forward_s', '-')} | "
                     f"{r.get('loss_rel_err', float('nan')):.1e} | {r.get('grads_rel_err', float('nan')):.1e} | "
                     + _loss_step(r, base_loss))
    lines += (ratio_lines(results["rows"]) + host_lines(results["rows"]) + profile_lines(results["rows"])
              + fused_lines(results["rows"]))
    return "\n".join(lines) + "\n"


RATIOS = (("forward_ms", "forward"), ("loss_forward_ms", "loss-only forward"), ("step_ms", "step"),
          ("loss_step_ms", "loss-only step"))


def ratio_lines(rows: list) -> list:
    """Each row that is not Inductor's against Inductor's in the same mode (``_baseline``):
    speed (Inductor's median time over the row's: above 1, faster) of the forward, the
    loss-only forward and both steps; the step's peak memory and the cold first step as
    fractions of Inductor's (below 1, less)."""
    inductor = {(r["model"], r["form"]): r for r in rows if r.get("form", "").startswith("inductor")
                and r.get("step_ms")}
    out = []
    for r in rows:
        key = _baseline(r, inductor) if r.get("step_ms") and not r["form"].startswith("inductor") else None
        if key is None:
            continue
        base = inductor[key]
        cells = [f"{base[k][0] / r[k][0]:.3f}x" if r.get(k) and base.get(k) else "-" for k, _ in RATIOS]
        cells += [f"{r[k] / base[k]:.3f}x" if r.get(k) and base.get(k) else "-"
                  for k in ("step_peak_gib", "first_step_s")]
        out.append(f"| {r['model']} | {r['form']} | {key[1]} | " + " | ".join(cells) + " |")
    if not out:
        return []
    return ["", "Against Inductor in the same mode (speed: Inductor's time over the form's; memory and first "
            "step: the form's over Inductor's):", "",
            "| model | form | against | " + " | ".join(name for _, name in RATIOS) + " | step peak memory | first step |",
            "|---|---|---|" + "---|" * (len(RATIOS) + 2)] + out


def host_lines(rows: list) -> list:
    """How fast each row's process launched: the host time of a small in-place op, back to
    back with the GPU idle, at the process's start and after its first calls (before timing)."""
    cells = [f"| {r['model']} | {r['form']} | {r['launch_host_us'].get('start', '-')} | "
             f"{r['launch_host_us'].get('timed', '-')} |" for r in rows if r.get("launch_host_us")]
    if not cells:
        return []
    return ["", "Host time of one small launch in each row's process, us (back-to-back calls, the GPU idle):", "",
            "| model | form | at its start | when timed |", "|---|---|---|---|"] + cells


def _baseline(r: dict, base: dict):
    """The (model, form) of Inductor's row that ``r`` compares with: Inductor in the same mode
    (``comfuse@reduce-overhead`` against ``inductor@reduce-overhead``), else its default mode;
    None where neither was measured."""
    same = (r["model"], "inductor" + r["form"][len(r["form"].split("@")[0]):])
    return same if same in base else (r["model"], "inductor") if (r["model"], "inductor") in base else None


def _loss_step(r: dict, base: dict) -> str:
    """The cells of the compiled function that returns the loss alone: its forward (grad off)
    and its training step."""
    t = r.get("loss_step_ms")
    if not t:
        return "- | - | - | - | - |"
    key = _baseline(r, base)
    speed = f"{base[key] / t[0]:.3f}x" if key else "-"
    errs = r.get("loss_step_rel_err") or [float("nan")] * 2
    return (f"{_fmt(r.get('loss_forward_ms'))} | {_fmt(t)} | {speed} | {r.get('loss_step_peak_gib', '-')} | "
            f"{errs[0]:.1e} / {errs[1]:.1e} |")


def figures(results: dict, out_dir) -> list:
    """models.png: per model and form, the training step's and the forward's speed against
    Inductor's default mode, the step's peak memory and the cold first step; returns the paths
    written (none without matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = [r for r in results["rows"] if r.get("step_ms")]
    if not rows:
        return []
    models = list(dict.fromkeys(r["model"] for r in rows))
    forms = list(dict.fromkeys(r["form"] for r in rows))
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.5))
    width = 0.8 / len(forms)
    panels = (("step_ms", "training step, x Inductor (default)"), ("forward_ms", "forward with loss, x Inductor"),
              ("step_peak_gib", "training step, peak GiB"), ("first_step_s", "first step from torch.compile, s (cold)"))
    for ax, (key, title) in zip(axes, panels):
        for j, form in enumerate(forms):
            values = []
            for m in models:
                r = next((x for x in rows if x["model"] == m and x["form"] == form), {})
                base = next((x for x in rows if x["model"] == m and x["form"] == "inductor"), None)
                v = r.get(key)
                if key.endswith("_ms"):
                    v = base[key][0] / v[0] if v and base else None
                values.append(v or 0.0)
            ax.bar([i + j * width for i in range(len(models))], values, width, label=form)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(models))], models)
        ax.set_title(title, fontsize=10)
        if key.endswith("_ms"):
            ax.axhline(1.0, color="black", linewidth=0.8)
        if key == "step_peak_gib" and not any(r.get(key) for r in rows):
            ax.text(0.5, 0.5, "not measured (no GPU)", ha="center", transform=ax.transAxes)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path = Path(out_dir) / "models.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]

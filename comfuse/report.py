"""What comfuse found and decided, for people (``str(report)``) and programs (fields)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RegionReport:
    index: int
    anchor: str  # the fx node of the GEMM
    kind: str  # "gemm_epilogue"
    fused: bool
    reason: str  # why not fused ("" when fused)
    stages: int
    schedule: str  # "tile", "row_in_cta" or "" when not fused
    ir: str  # the region as found, in the IR's text form
    plan: str = ""  # one line: schedule, strip, stages, tile sizes
    ops: list = dataclasses.field(default_factory=list)  # fx nodes in the region
    outputs: list = dataclasses.field(default_factory=list)  # fx nodes the kernel writes
    notes: list = dataclasses.field(default_factory=list)  # where growth stopped, and why
    through: list = dataclasses.field(default_factory=list)  # what region finding read through
    kernel_path: str = ""  # generated source on disk
    launch: str = ""  # inside Inductor: who launches the kernel (or why comfuse's operator does)
    tuned_ms: tuple = ()  # autotuned: (the chosen plan's ms, the unfused ops' ms), alone on random inputs
    replayed: str = ""  # inside Inductor, once settled: its calls replayed as N launch(es), or why not
    forms: list = dataclasses.field(default_factory=list)  # (pass, IR text) per planner step
    templates: list = dataclasses.field(default_factory=list)  # (Gluon schedule, '' or why not) on sm_90
    planned: object = dataclasses.field(default=None, repr=False)  # the Plan / ChainPlan run
    found: object = dataclasses.field(default=None, repr=False)  # the Region as found; for
    # a b2b chain, (regions, links, writes): what plan_chain takes

    def summary(self) -> str:
        status = "fused" if self.fused else "not fused"
        line = f"region {self.index} [{self.kind}] at {self.anchor}: {status}"
        if self.fused:
            line += f", {self.stages} stage(s), schedule {self.schedule}"
        else:
            line += f": {self.reason}"
        return line

    def __str__(self) -> str:
        parts = [self.summary()]
        if self.plan:
            parts.append(f"  plan: {self.plan}")
        if self.ops:
            parts.append(f"  ops: {', '.join(self.ops)}")
        if self.outputs:
            parts.append(f"  writes: {', '.join(self.outputs)}")
        if self.templates:
            offers = "; ".join(f"{name}: {why[:160] if why else 'offered'}" for name, why in self.templates)
            parts.append(f"  warp-specialised kernels (sm_90): {offers}")
        for note in self.through:
            parts.append(f"  read through {note}")
        for note in self.notes:
            parts.append(f"  stopped at {note}")
        if self.kernel_path:
            parts.append(f"  kernel source: {self.kernel_path}")
        if self.launch and self.fused:
            parts.append(f"  launched: {self.launch}")
        if self.replayed:
            parts.append(f"  replayed: {self.replayed}")
        if self.ir:
            parts.append("  " + self.ir.replace("\n", "\n  "))
        return "\n".join(parts)


@dataclasses.dataclass
class Report:
    function: str
    regions: list
    graph: str = ""  # the graph after fusion (fx code)
    error: str = ""  # why nothing could be captured, if so
    notes: list = dataclasses.field(default_factory=list)  # what the backend changed besides regions

    @property
    def fused(self) -> list:
        return [r for r in self.regions if r.fused]

    def __str__(self) -> str:
        head = f"comfuse report for {self.function}: {len(self.regions)} region(s), " \
               f"{len(self.fused)} fused"
        if self.error:
            head += f"\n  capture failed, runs eagerly: {self.error}"
        head += "".join(f"\n  {note}" for note in self.notes)
        body = [str(r) for r in self.regions]
        return "\n\n".join([head] + body)

"""What apollo decided, kept for the user: one :class:`GraphPlan` per compiled ATen graph.

``apollo_compile.last_plan()`` returns the :class:`ModelPlan` of the most recently compiled
Dynamo graph; ``apollo_compile.plans()`` all of them in this process, kept across
``torch._dynamo.reset()`` until ``apollo_compile.clear_plans()``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch.fx

from .report import dump


@dataclass
class GraphPlan:
    name: str
    kind: str  # "forward" | "backward" | "inference"
    device: str
    gm: torch.fx.GraphModule
    decisions: dict[str, Any]
    fallback: str | None = None  # why this graph did not run apollo's runtime, if it did not
    runtimes: dict[str, Any] = field(default_factory=dict)  # "lanes" (and "one_lane") callables
    runner_ref: Any = None  # weakref to the CUDA-graph runner (see `runner`)
    checkpoint: Any = None  # memory_budget: a forward's joint graph's checkpoint decision, a whole step's recompute decision
    compile_s: dict[str, float] = field(default_factory=dict)  # "passes", "subgraphs": where compiling went

    @property
    def runner(self):
        """The CUDA-graph runner on CUDA (which runtime it measured and replays) while the compiled
        graph lives. Plans outlive ``torch._dynamo.reset()`` and recompiles, so they hold the
        runner weakly: a strong reference would keep every replaced graph's CUDA graph, pool and
        static outputs allocated (gigabytes, which every later peak would include)."""
        return self.runner_ref() if self.runner_ref is not None else None

    @property
    def title(self) -> str:
        return f"apollo {self.name} ({self.kind}) planned for {self.device}"

    @property
    def listing(self) -> str:
        return dump.listing(self.gm, self.title)

    @property
    def runtime_source(self) -> str | None:
        src = self.decisions.get("codegen")
        return src.text if src is not None else None

    @property
    def lanes(self):
        return self.decisions.get("lanes")

    @property
    def memory(self):
        return self.decisions.get("memory")

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"graph": self.name, "kind": self.kind, "device": self.device}
        if "modality" in self.decisions:
            out["modality"] = self.decisions["modality"]
        if "cost" in self.decisions:
            out["cost"] = self.decisions["cost"]
        if self.lanes is not None:
            out["lanes"] = self.lanes.summary()
        if self.decisions.get("quotas") is not None:  # predicted candidates, and fits from measuring them
            out["quotas"] = self.decisions["quotas"].summary()
        if self.decisions.get("main_allocated") is not None:  # side-lane gradients in main-stream memory
            out["main_allocated"] = self.decisions["main_allocated"].summary()
        if self.memory is not None:
            out["memory"] = {"arena_bytes": self.memory.arena_bytes, "total_bytes": self.memory.total_bytes}
        if self.checkpoint is not None:  # predicted activation bytes (saved, peak) before and after the budget
            out["checkpoint"] = self.checkpoint.summary()
        if self.decisions.get("saved") is not None:
            out["saved"] = self.decisions["saved"]
        if self.decisions.get("offload") is not None:  # copies of saved values to the host and back
            out["offload"] = self.decisions["offload"]
        if self.fallback:
            out["fallback"] = self.fallback
        if self.compile_s:
            out["compile_s"] = {k: round(v, 2) for k, v in self.compile_s.items()}
        if self.runner is not None:
            out["cuda_graph"] = self.runner.summary()
        return out

    def write(self, directory: str) -> list[str]:
        """Write the listing, JSON, DOT, runtime source and memory plan; return the paths."""
        os.makedirs(directory, exist_ok=True)
        files = {
            f"{self.name}.apollo.txt": self.listing,
            f"{self.name}.apollo.json": dump.to_json(self.gm, self.summary()),
            f"{self.name}.dot": dump.to_dot(self.gm, self.title),
        }
        if self.runtime_source is not None:
            files[f"{self.name}.runtime.py"] = self.runtime_source
            single = self.decisions["codegen"].one_lane
            if single is not None:
                files[f"{self.name}.one_lane.runtime.py"] = single.text
        if self.memory is not None:
            files[f"{self.name}.memory.txt"] = self.memory.to_text()
        paths = []
        for fname, text in files.items():
            path = os.path.join(directory, fname)
            with open(path, "w") as f:
                f.write(text)
            paths.append(path)
        return paths


@dataclass
class ModelPlan:
    """The plans of one Dynamo graph: its forward and backward, or its inference graph."""

    name: str
    graphs: dict[str, GraphPlan] = field(default_factory=dict)
    pre_grad: dict[str, Any] = field(default_factory=dict)  # decisions of the pre-autograd passes
    joint: dict[str, Any] = field(default_factory=dict)  # decisions of the joint-graph passes

    @property
    def forward(self) -> GraphPlan | None:
        return self.graphs.get("forward")

    @property
    def backward(self) -> GraphPlan | None:
        return self.graphs.get("backward")

    @property
    def inference(self) -> GraphPlan | None:
        return self.graphs.get("inference")

    def __repr__(self) -> str:
        return f"ModelPlan({self.name!r}, graphs={list(self.graphs)})"


_PLANS: list[ModelPlan] = []


def record(plan: ModelPlan) -> None:
    _PLANS.append(plan)


def last_plan() -> ModelPlan | None:
    """The plan of the most recently compiled graph, or None before any compilation."""
    return _PLANS[-1] if _PLANS else None


def plans() -> list[ModelPlan]:
    """Every plan made in this process, oldest first."""
    return list(_PLANS)


def clear_plans() -> None:
    _PLANS.clear()

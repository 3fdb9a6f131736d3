"""GPU probe: does a CUDA graph replay see a Python float or int that changes between calls?

Dynamo passes a float it has seen take two values as a 0-dim CPU tensor (tensorified) and an int
as a SymInt. A kernel takes a CPU scalar's value as a launch argument, so a replay would keep the
captured one: apollo's runner does not capture a graph with such inputs (cudagraph.py,
`host_values`; "unchecked" rows turn that off to show why) and replays a graph with SymInt inputs
only at the captured values (`input_shapes`). Each row trains a small linear model for six steps
with a changing scalar and compares loss and gradient with eager.

    PYTHONPATH=. python benchmarks/probes/scalar_input_probe.py    # exit status 1 if a checked row is WRONG
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # the repo root, for apollo_compile
import apollo_compile  # noqa: E402,F401  (registers backend="apollo")
from apollo_compile.runtime import cudagraph  # noqa: E402

HOST_VALUES = cudagraph.host_values


def run(kind: str, compiler: str, checked: bool = True) -> str:
    cudagraph.host_values = HOST_VALUES if checked else (lambda args: [])
    torch._dynamo.reset()
    torch.manual_seed(0)
    w = torch.randn(64, 64, device="cuda", requires_grad=True)

    def step(x, s):
        y = x @ w
        return (y * s).sum() if kind == "float" else (y[:, :s] * 2.0).sum()

    compiled = torch.compile(step, backend="apollo", options={"subgraph_compiler": compiler})
    scalars = [0.5, 1.5, 2.5, 3.5, 4.5, 5.5] if kind == "float" else [3, 5, 7, 9, 11, 13]
    worst = 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k, s in enumerate(scalars):
            x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(k))
            loss = compiled(x, s)
            loss.backward()
            got, w.grad = w.grad.clone(), None
            ref_loss = step(x, s)
            ref_loss.backward()
            ref, w.grad = w.grad.clone(), None
            worst = max(worst, abs(float(loss) - float(ref_loss)) / abs(float(ref_loss)),
                        float((got - ref).norm() / ref.norm()))
    plan = apollo_compile.last_plan()
    runs = {g: (plan.graphs[g].runner.summary() if plan.graphs[g].runner is not None else None) for g in plan.graphs}
    brief = {g: (s["replays"], s["ungraphed_calls"], s["disabled"]) if s else None for g, s in runs.items()}
    msgs = sorted({str(w.message)[:160] for w in caught if "apollo" in str(w.message)})
    return f"{kind:5} {compiler:8} {'checked' if checked else 'unchecked':9} max rel err {worst:.1e}  {'OK' if worst < 1e-3 else 'WRONG'}  {brief}  {msgs}"


def main() -> int:
    if not torch.cuda.is_available():
        print("scalar_input_probe.py needs CUDA: the question is what a CUDA graph replays")
        return 2
    print(run("float", "inductor", checked=False))  # WRONG by design: why the check exists
    checked = [run(kind, compiler) for kind in ("float", "int") for compiler in ("inductor", "eager")]
    print("\n".join(checked))
    return 1 if any(" WRONG " in row for row in checked) else 0


if __name__ == "__main__":
    sys.exit(main())

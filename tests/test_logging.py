"""apollo shows up in PyTorch's logging and debugging tools."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import sys, torch
sys.path.insert(0, {tests!r}); sys.path.insert(0, {repo!r})
import apollo_compile
from models import MLP
c = torch.compile(MLP(), backend="apollo", options={{"subgraph_compiler": "eager"}})
c(torch.randn(4, 32)).backward()
"""


def run(env_extra, tmp_path):
    env = dict(os.environ, **env_extra)
    code = SCRIPT.format(tests=os.path.join(REPO, "tests"), repo=REPO)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


def test_torch_logs_shows_pass_decisions(tmp_path):
    out = run({"TORCH_LOGS": "+apollo_compile"}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pass lanes" in out.stderr and "pass modality" in out.stderr and "planned" in out.stderr


def test_torch_trace_gets_plan_artifacts(tmp_path):
    trace_dir = tmp_path / "trace"
    out = run({"TORCH_TRACE": str(trace_dir)}, tmp_path)
    assert out.returncode == 0, out.stderr
    text = "".join(p.read_text() for p in trace_dir.iterdir())
    assert "apollo_plan_frame0_0_forward" in text and "apollo_plan_frame0_0_backward" in text


def test_torch_compile_debug_writes_dumps(tmp_path):
    out = run({"TORCH_COMPILE_DEBUG": "1", "TORCH_COMPILE_DEBUG_DIR": str(tmp_path / "dbg")}, tmp_path)
    assert out.returncode == 0, out.stderr
    dumps = [p.name for p in (tmp_path / "dbg").rglob("*.apollo.txt")]
    assert sorted(dumps) == ["frame0_0_backward.apollo.txt", "frame0_0_forward.apollo.txt"], dumps

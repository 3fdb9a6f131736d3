"""apollo shows up in PyTorch's logging and debugging tools."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import os, sys, torch
sys.path.insert(0, {tests!r}); sys.path.insert(0, {repo!r})
{before_apollo}
import apollo_compile
from models import MLP
c = torch.compile(MLP(), backend="apollo", options={{"subgraph_compiler": "eager"}})
c(torch.randn(4, 32)).backward()
"""


def run(env_extra, tmp_path, before_apollo=""):
    """The script in a fresh interpreter; a variable set to None in `env_extra` is unset."""
    env = {k: v for k, v in dict(os.environ, **env_extra).items() if v is not None}
    code = SCRIPT.format(tests=os.path.join(REPO, "tests"), repo=REPO, before_apollo=before_apollo)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)


@pytest.fixture(scope="module")
def torch_logs(tmp_path_factory):
    """The script run once with TORCH_LOGS="+apollo_compile", for the two tests that read its log."""
    return run({"TORCH_LOGS": "+apollo_compile"}, tmp_path_factory.mktemp("torch_logs"))


def test_torch_logs_shows_pass_decisions(torch_logs):
    out = torch_logs
    assert out.returncode == 0, out.stderr
    assert "pass lanes" in out.stderr and "pass modality" in out.stderr and "planned" in out.stderr


def decision_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "frame0_0_forward: pass lanes" in line]


def test_each_pass_decision_is_logged_once(torch_logs):
    """torch imports apollo while it reads TORCH_LOGS and gives it a handler; apollo adds none."""
    out = torch_logs
    assert out.returncode == 0, out.stderr
    assert len(decision_lines(out.stderr)) == 1, decision_lines(out.stderr)
    assert sum("frame0_0_forward planned" in line for line in out.stderr.splitlines()) == 1


def test_torch_logs_set_after_torch_was_imported_is_read_once(tmp_path):
    """TORCH_LOGS set after torch is imported: apollo reads it when it is imported, once."""
    out = run({"TORCH_LOGS": None}, tmp_path, before_apollo='os.environ["TORCH_LOGS"] = "+apollo_compile"')
    assert out.returncode == 0, out.stderr
    assert len(decision_lines(out.stderr)) == 1, decision_lines(out.stderr)


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

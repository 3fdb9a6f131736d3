"""apollo_compile.explain and its Report: the text table, the HTML page (also rendered by a real
headless Chromium when one is installed), the Chrome trace and the command line."""

from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

import apollo_compile
from apollo_compile import pipeline
from apollo_compile.annotations import info
from apollo_compile.report import dump, html_page
from apollo_compile.report.cli import load_function, parse_option
from apollo_compile.report.stats import TOP_OPS_RANKING, describe_candidate, largest_ops, predicted_timeline
from apollo_compile.report.svg import node_layout
from models import MLP, GraphBreakModel, TwoTower, two_tower_inputs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHROMIUM = "/usr/bin/chromium"
# CI installs it with:  apt-get update && apt-get install -y chromium
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def two_tower():
    """(model, report): TwoTower explained with the eager subgraph compiler."""
    torch._dynamo.reset()
    model = TwoTower()
    return model, apollo_compile.explain(model, *two_tower_inputs(), options={"subgraph_compiler": "eager"})


@pytest.fixture(scope="module")
def h200_report():
    """A wider TwoTower planned for an H200: wide enough that some matmuls are compute-bound."""
    torch._dynamo.reset()
    return apollo_compile.explain(TwoTower(width=128), *two_tower_inputs(batch=16),
                                  options={"subgraph_compiler": "eager", "device": "H200"})


def _has_class(page: str, cls: str) -> bool:
    return re.search(rf'class="(?:[^"]*\s)?{re.escape(cls)}(?:\s[^"]*)?"', page) is not None


# ---- explain() and the text table ------------------------------------------------------------


def test_explain_plans_forward_and_backward(two_tower):
    model, report = two_tower
    assert report.ran_backward
    assert [g.kind for g in report.graphs] == ["forward", "backward"]
    assert all(p.grad is None for p in model.parameters()), "explain() must leave .grad as it found it"
    assert all(any(p is q for q in apollo_compile.plans()) for p in report.plans)


def test_candidates_show_predicted_and_measured_times(h200_report, monkeypatch):
    """Each graph's runtime candidates with the model's prediction; once a CUDA-graph runner has
    measured them (faked here: no GPU), its times and the replayed one appear beside them."""
    import weakref

    gp = h200_report.graph(h200_report.graphs[0].name)
    names = [c.name for c in gp.decisions["quotas"].candidates]
    assert {"lanes", "one_lane"} <= set(names)
    text = str(h200_report)
    assert f"candidates: {gp.name}: " in text and "measured" not in text.split(f"candidates: {gp.name}: ")[1].split("\n")[0]

    class Runner:
        def summary(self):
            return {"chosen": "lanes", "measured_ms": {"lanes": 1.5, "one_lane": 2.0},
                    "candidate_pool_bytes": {"lanes": 1222639616, "one_lane": 1163919360}}

    runner = Runner()
    monkeypatch.setattr(gp, "runner_ref", weakref.ref(runner))
    line = str(h200_report).split(f"candidates: {gp.name}: ")[1].split("\n")[0]
    # each measured candidate with the memory pool its capture held: lanes' speed beside their memory
    assert "lanes" in line and "measured 1.500 ms, pool 1,166 MiB (replayed)" in line
    assert "measured 2.000 ms, pool 1,110 MiB" in line
    if any(n.startswith("quota:") for n in names):
        assert "(not captured)" in line
    page = h200_report.to_html()
    assert _has_class(page, "candidates") and "replayed" in page
    assert "graph pool (GPU)" in page and "<td>1,166 MiB</td>" in page


def test_text_table_names_lanes_modalities_and_predicted_times(two_tower):
    _, report = two_tower
    text = str(report)
    assert "serial µs" in text and "concurrent µs" in text
    for gp in report.graphs:
        serial, concurrent = gp.lanes.predicted_us()
        row = next(line for line in text.splitlines() if line.startswith(gp.name + " "))
        assert f"{serial:.1f}" in row and f"{concurrent:.1f}" in row, row
        lanes_line = next(line for line in text.splitlines() if line.strip().startswith(gp.name) and "lane" in line)
        assert "vision" in lanes_line and "text" in lanes_line and "fusion" in lanes_line
        stats = next(s for s in report.stats() if s.name == gp.name)
        assert stats.lanes == gp.lanes.lanes and len(stats.lanes) == 2
        assert stats.arena_bytes == gp.memory.arena_bytes and stats.total_bytes == gp.memory.total_bytes
        assert stats.recomputed == sum(info(n).recomputed for n in gp.gm.graph.nodes)
    assert "fallback:" not in text


def test_predicted_timeline_follows_the_dag(two_tower):
    _, report = two_tower
    for gp in report.graphs:
        lp = gp.lanes
        times = predicted_timeline(lp)
        assert set(times) == {sg.id for sg in lp.subgraphs}
        for a, b in lp.dag.edges:
            assert times[a][1] <= times[b][0] + 1e-9
        assert max(e for _, e in times.values()) == pytest.approx(lp.predicted_us()[1])


def test_several_dynamo_graphs_and_one_lane():
    report = apollo_compile.explain(GraphBreakModel(), torch.randn(4, 32), options={"subgraph_compiler": "eager"})
    assert len(report.plans) == 2 and len(report.graphs) == 4
    assert "from 2 Dynamo graph(s)" in str(report)
    assert all(list(g.lanes.lanes) == [0] for g in report.graphs)
    assert report.to_html().count('class="graph"') == 4


def test_fallback_reason_is_reported(monkeypatch):
    def boom(gm, ctx):
        raise RuntimeError("no plan today")

    monkeypatch.setattr(pipeline, "GRAPH_PASSES", [("boom", boom)] + pipeline.GRAPH_PASSES)
    with pytest.warns(apollo_compile.ApolloFallbackWarning):
        report = apollo_compile.explain(MLP(), torch.randn(4, 32), options={"subgraph_compiler": "eager"})
    text = str(report)
    assert "fallback: frame0_0_forward:" in text and "no plan today" in text
    assert report.fallback_warnings
    page = report.to_html()
    assert "no plan today" in page and "No lane plan for this graph" in page


def test_top_ops_discriminate_at_the_launch_floor(h200_report):
    """On a small model planned for an H200 every op's estimate sits near the launch floor (2.0 µs);
    the top ops are ranked by the roofline time past it, then FLOPs, then bytes, and show the FLOPs
    or bytes that rank them instead of µs that all read the same."""
    fw = h200_report.graphs[0]
    for sg in fw.lanes.subgraphs:
        top = largest_ops(sg.nodes, 3)
        keys = [(info(n).est_us, info(n).flops, info(n).bytes) for n in top]
        assert keys == sorted(keys, reverse=True)
        rest = [n for n in sg.nodes if info(n).bound in ("compute", "memory") and n not in top]
        assert all(info(n).est_us <= info(top[-1]).est_us for n in rest)
    ops = largest_ops(fw.gm.graph.nodes, 5)
    ests = [info(n).est_us for n in ops]
    assert max(ests) < 1.15 * min(ests), "the model should sit near the launch floor for this test to mean much"
    assert dump.format_target(ops[0]).startswith(("convolution", "addmm", "mm", "bmm")), ops[0]
    page = h200_report.to_html()
    assert TOP_OPS_RANKING in page and _has_class(page, "top-ops-ranking")
    labels = re.findall(r'class="sg-op num" data-cost="[^"]*">([^<]*)<', page)
    assert labels and not any(label.endswith("µs") for label in labels) and len(set(labels)) > 1, labels
    assert any(label.endswith("FLOP") for label in labels) and any(label.endswith("B") for label in labels)
    text = str(h200_report)
    assert f"top ops ({TOP_OPS_RANKING}):" in text
    line = next(x for x in text.splitlines() if x.startswith(f"  {fw.name}") and "[sg " in x)
    assert line.split()[1] == ops[0].name and "FLOP" in line


def test_candidate_names_and_the_measured_column_are_explained(h200_report):
    assert describe_candidate("quota:1=56,2=8") == "lane 1 on 56 SMs; lane 2 on 8 SMs; lane 0 on the rest"
    assert describe_candidate("one_lane") and describe_candidate("lanes")
    page = h200_report.to_html()
    for cls in ("candidate-names", "measured-note"):
        assert _has_class(page, cls), cls
    assert "quota:LANE=SMS" in page and "one_lane: every subgraph on the caller&#x27;s stream" in page
    assert "measured ms (GPU)" in page and "fills in on a CUDA device only" in page and "on CPU it stays empty" in page
    names = [c.name for c in h200_report.graphs[0].decisions["quotas"].candidates]
    for name in names:
        assert f'<td class="what">{html.escape(describe_candidate(name))}</td>' in page
    text = " ".join(str(h200_report).split())
    assert "quota:LANE=SMS" in text and "measured fills in on a CUDA device only" in text


def test_each_explanation_is_printed_once(h200_report):
    """The notes that hold for every graph sit once, after the graphs, not under each graph."""
    assert len(h200_report.graphs) == 2
    page = h200_report.to_html()
    for cls in ("top-ops-ranking", "candidate-names", "measured-note"):
        assert page.count(f'class="note {cls}"') == 1, cls
    assert page.count(TOP_OPS_RANKING) == 1
    text = str(h200_report)
    assert text.count("quota:LANE=SMS") == 1 and text.count("measured fills in on a CUDA device only") == 1


def test_a_cpu_plan_says_why_measured_and_compute_columns_are_empty(two_tower, h200_report):
    _, report = two_tower
    assert {g.device for g in report.graphs} == {"cpu"}
    text = " ".join(str(report).split())
    assert "planned for the CPU: the measured columns fill in on a GPU only" in text
    assert "the compute column counts ops whose FLOP per byte reaches the device's ridge point" in text
    page = report.to_html()
    assert page.count('class="note device-note"') == 1 and "fill in on a GPU only" in page
    assert "planned for the CPU" not in str(h200_report) and "device-note" not in h200_report.to_html()


# ---- HTML ------------------------------------------------------------------------------------


def test_save_html_has_stable_ids_and_classes(h200_report, tmp_path):
    path = h200_report.save_html(str(tmp_path / "report.html"))
    page = open(path, encoding="utf-8").read()
    assert page.startswith("<!DOCTYPE html>")
    for gp in h200_report.graphs:
        assert f'id="graph-{gp.name}"' in page
        assert f'id="nodegraph-{gp.name}"' in page and f'id="nodes-{gp.name}"' in page
        for sg in gp.lanes.subgraphs:
            assert f'id="bar-{gp.name}-predicted-sg{sg.id}"' in page
            assert f'id="sg-{gp.name}-{sg.id}"' in page
    for cls in ("lane-timeline", "memory-arena", "graph-view", "node-graph", "node compute", "node memory",
                "sg-bar", "buffer", "node-table", "summary"):
        assert _has_class(page, cls), cls
    # self-contained: no external resources
    assert not re.search(r'(src|href)="(https?:)?//', page)
    assert "<script src" not in page and "<link" not in page


def test_big_graphs_show_subgraph_boxes_instead_of_nodes(h200_report, monkeypatch):
    monkeypatch.setattr(html_page, "NODE_CAP", 10)
    page = h200_report.to_html()
    assert "too many to draw one by one" in page and not _has_class(page, "node-graph-svg")
    assert _has_class(page, "sg-box") and _has_class(page, "node-table")


def test_node_layout_layers_respect_edges(h200_report):
    for gp in h200_report.graphs:
        drawn, inputs, layer = node_layout(gp.gm)
        assert drawn and all(info(n).bound in ("compute", "memory") for n in drawn)
        for n in drawn:
            assert all(layer[i] < layer[n] for i in inputs[n]), n


def test_add_measured_draws_second_rows_and_trace_threads(two_tower, tmp_path):
    _, report = two_tower
    fw = report.graphs[0]
    times = predicted_timeline(fw.lanes)
    try:
        report.add_measured(fw.name, {sg: (s * 1.1, e * 1.2) for sg, (s, e) in times.items()})
        assert _has_class(report.to_html(), "sg-bar measured")
        measured = [e for e in report.to_trace()["traceEvents"] if e.get("cat") == "measured"]
        assert len(measured) == len(times)
        assert "measured: frame0_0_forward" in str(report)
        with pytest.raises(KeyError, match="no subgraph 99"):
            report.add_measured(fw.name, {99: (0.0, 1.0)})
        with pytest.raises(KeyError, match="no graph named"):
            report.add_measured("nope", {})
    finally:
        report.measured.clear()


# ---- trace -----------------------------------------------------------------------------------


def test_save_trace_has_an_x_event_per_subgraph(two_tower, tmp_path):
    _, report = two_tower
    path = report.save_trace(str(tmp_path / "trace.json"))
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    for pid, gp in enumerate(report.graphs, start=1):
        xs = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        assert sorted(e["args"]["subgraph"] for e in xs) == [sg.id for sg in gp.lanes.subgraphs]
        times = predicted_timeline(gp.lanes)
        for e in xs:
            sg = gp.lanes.subgraphs[e["args"]["subgraph"]]
            assert e["tid"] == sg.lane
            assert e["ts"] == pytest.approx(times[sg.id][0], abs=1e-3)
            assert e["dur"] == pytest.approx(sg.est_us, abs=1e-3)
        names = {e["args"].get("name") for e in events if e["ph"] == "M" and e["pid"] == pid}
        assert f"{gp.name} ({gp.kind})" in names


# ---- command line ----------------------------------------------------------------------------


def test_parse_option():
    assert parse_option("max_lanes=1") == ("max_lanes", 1)
    assert parse_option("strict=True") == ("strict", True)
    assert parse_option("device=H200") == ("device", "H200")
    assert parse_option("modalities={'vision': 'v'}") == ("modalities", {"vision": "v"})
    assert parse_option("dump_dir=a=b") == ("dump_dir", "a=b")
    with pytest.raises(Exception, match="key=value"):
        parse_option("max_lanes")


def test_load_function_from_module_name():
    assert load_function("models:two_tower_inputs") is two_tower_inputs


def test_cli_report_in_a_subprocess(tmp_path):
    script = tmp_path / "build_model.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {os.path.join(REPO, "tests")!r})
        from models import TwoTower, two_tower_inputs

        def build():
            return TwoTower(), two_tower_inputs(), {{"subgraph_compiler": "eager"}}
    """))
    out, trace = tmp_path / "r.html", tmp_path / "t.json"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "apollo_compile", "report", f"{script}:build", "--out", str(out),
         "--trace", str(trace), "--option", "max_lanes=1"],
        cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "frame0_0_forward" in proc.stdout and "frame0_0_backward" in proc.stdout
    lanes = [line for line in proc.stdout.splitlines() if line.startswith("  frame0_0_") and " lane 0:" in line]
    assert len(lanes) == 2 and all("lane 0: fusion, text" in line and "vision" in line for line in lanes), lanes
    assert "lane 1:" not in proc.stdout  # max_lanes=1 took effect
    assert 'id="graph-frame0_0_forward"' in out.read_text(encoding="utf-8")
    assert any(e["ph"] == "X" for e in json.loads(trace.read_text())["traceEvents"])


# ---- a real browser --------------------------------------------------------------------------


def _chromium(tmp_path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"
    profile.mkdir(exist_ok=True)
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(not os.path.exists(CHROMIUM) or shutil.which(CHROMIUM) is None,
                    reason="headless check needs Chromium at /usr/bin/chromium: apt-get install -y chromium")
def test_chromium_renders_the_report(h200_report, tmp_path):
    path = tmp_path / "report.html"
    h200_report.save_html(str(path))
    url = path.as_uri()
    dom = _chromium(tmp_path, "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-3000:]
    html = dom.stdout
    assert 'data-ready="1"' in html, "the page's script did not run to the end"
    for gp in h200_report.graphs:
        assert f'id="graph-{gp.name}"' in html
    for cls in ("lane-timeline", "memory-arena", "node compute", "node memory", "sg-bar", "buffer"):
        assert _has_class(html, cls), cls
    assert html.count("<svg") >= 4 * len(h200_report.graphs)

    shot = tmp_path / "shot.png"
    res = _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,1000", url)
    assert res.returncode == 0, res.stderr[-3000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1400, 1000)


@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="docs/report.png is rendered by Chromium: apt-get install -y chromium")
def test_docs_report_png_is_made_by_its_script(tmp_path):
    """docs/make_report_png.py renders the README's example from the current code (here with the
    eager subgraph compiler, which plans the same and compiles faster)."""
    spec = importlib.util.spec_from_file_location("make_report_png", os.path.join(REPO, "docs", "make_report_png.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "report.png"
    assert script.main(["--out", str(out), "--option", "device=H200", "--option", "subgraph_compiler=eager"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert struct.unpack(">II", data[16:24]) == script.SIZE

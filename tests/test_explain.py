"""apollo_compile.explain(model, *args, options={...}, **kwargs): the model's inputs by position
and by keyword (as Hugging Face models are called), apollo's options as a dict, and the backward
run from a loss found in the output (a tensor, ``.loss``, ``["loss"]``)."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import apollo_compile
from apollo_compile.report.cli import main as cli_main
from apollo_compile.report.explain import loss_of
from models import TwoTower, two_tower_inputs

EAGER = {"subgraph_compiler": "eager"}


@dataclasses.dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class KeywordModel(nn.Module):
    """Called as HF models are: ``model(x=..., labels=..., return_dict=...)``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, return_dict: bool = False):
        logits = self.b(torch.relu(self.a(x)))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        if return_dict:
            return {"loss": loss, "logits": logits}
        return Output(loss=loss, logits=logits)


def _kinds(report) -> list[str]:
    return [g.kind for g in report.graphs]


def test_keyword_inputs_reach_the_model():
    images, tokens = two_tower_inputs()
    report = apollo_compile.explain(TwoTower(), images=images, tokens=tokens, options=EAGER)
    assert _kinds(report) == ["forward", "backward"] and report.backward_from == "the output"
    fw = report.graphs[0]
    shapes = [tuple(n.meta["val"].shape) for n in fw.gm.graph.nodes if n.op == "placeholder"]
    assert tuple(images.shape) in shapes and tuple(tokens.shape) in shapes
    assert {"vision", "text"} <= {m for mods in fw.lanes.lanes.values() for m in mods}


def test_positional_and_keyword_inputs_mix():
    x, labels = torch.randn(4, 8), torch.tensor([0, 1, 2, 3])
    report = apollo_compile.explain(KeywordModel(), x, labels=labels, options=EAGER)
    assert report.ran_backward and report.backward_from == "output.loss"
    assert "ran forward + backward (from output.loss)" in str(report)


def test_options_reach_apollo():
    images, tokens = two_tower_inputs()
    options = {"subgraph_compiler": "eager", "max_lanes": 1, "device": "H200"}
    report = apollo_compile.explain(TwoTower(), images, tokens, options=options)
    assert report.options == options
    assert report.graphs and all(list(g.lanes.lanes) == [0] for g in report.graphs)
    assert {g.device for g in report.graphs} == {"H200"}
    assert "max_lanes=1" in report.to_html()


def test_output_object_with_a_loss_gets_a_backward_graph():
    model = KeywordModel()
    report = apollo_compile.explain(model, x=torch.randn(4, 8), labels=torch.tensor([0, 1, 2, 3]), options=EAGER)
    assert _kinds(report) == ["forward", "backward"] and report.backward_from == "output.loss"
    assert report.graph(report.graphs[1].name).lanes is not None
    assert "backward" in str(report) and 'class="kind kind-backward"' in report.to_html()
    assert all(p.grad is None for p in model.parameters()), "explain() must leave .grad as it found it"


def test_dict_output_with_a_loss_gets_a_backward_graph():
    report = apollo_compile.explain(KeywordModel(), x=torch.randn(4, 8), labels=torch.tensor([0, 1, 2, 3]),
                                    return_dict=True, options=EAGER)
    assert _kinds(report) == ["forward", "backward"] and report.backward_from == "output['loss']"


def test_no_loss_no_backward():
    """No labels: the output's loss is None; a non-scalar tensor output is no loss either."""
    report = apollo_compile.explain(KeywordModel(), x=torch.randn(4, 8), options=EAGER)
    assert not report.ran_backward and report.backward_from is None
    assert "ran forward only" in str(report)
    assert loss_of(torch.randn(3, requires_grad=True)) == (None, None)
    assert loss_of({"loss": torch.tensor(1.0)}) == (None, None)  # no grad: nothing to run backward from
    scalar = torch.randn(1, requires_grad=True).sum()
    assert loss_of(scalar)[1] == "the output" and loss_of(Output(scalar, scalar))[1] == "output.loss"


@pytest.mark.parametrize("bad", [["subgraph_compiler", "eager"], "eager", 3])
def test_options_of_the_wrong_type_are_refused(bad):
    with pytest.raises(TypeError, match="options must be a dict"):
        apollo_compile.explain(KeywordModel(), torch.randn(4, 8), options=bad)


def test_bad_option_is_refused_before_compiling():
    with pytest.raises(apollo_compile.ApolloOptionsError, match="unknown option 'max_lane'"):
        apollo_compile.explain(KeywordModel(), torch.randn(4, 8), options={"max_lane": 1})


def test_an_apollo_option_passed_as_a_model_input_says_options():
    """An apollo option passed as a keyword, where options= takes it, gets a TypeError naming options=."""
    with pytest.raises(TypeError, match=r"options=\{'subgraph_compiler': \.\.\.\}"):
        apollo_compile.explain(TwoTower(), *two_tower_inputs(), subgraph_compiler="eager")


def test_an_apollo_option_into_a_forward_that_takes_kwargs_warns():
    class TakesKwargs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x, **kwargs):
            return self.lin(x).mean()

    with pytest.warns(UserWarning, match="'max_lanes' is an apollo option"):
        report = apollo_compile.explain(TakesKwargs(), torch.randn(4, 8), max_lanes=1, options=EAGER)
    assert report.ran_backward


def test_cli_builds_keyword_inputs(tmp_path, capsys):
    script = tmp_path / "build_kw.py"
    script.write_text(textwrap.dedent("""
        import torch
        from test_explain import KeywordModel

        def build():
            batch = {"x": torch.randn(4, 8), "labels": torch.tensor([0, 1, 2, 3]), "return_dict": True}
            return KeywordModel(), batch, {"subgraph_compiler": "eager"}
    """))
    out = tmp_path / "r.html"
    assert cli_main(["report", f"{script}:build", "--out", str(out), "--option", "max_lanes=1"]) == 0
    text = capsys.readouterr().out
    assert "forward + backward (from output['loss'])" in text and "max_lanes=1" in out.read_text(encoding="utf-8")


def test_hugging_face_clip_by_keyword():
    """A tiny Hugging Face CLIPModel called as the Trainer calls it: the contrastive loss in the
    ModelOutput (return_loss=True) gives the backward graph."""
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1, "num_attention_heads": 4,
                     "vocab_size": 99, "max_position_embeddings": 16, "pad_token_id": 0, "bos_token_id": 97,
                     "eos_token_id": 98},
        vision_config={"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
                       "num_attention_heads": 4, "image_size": 16, "patch_size": 8},
        projection_dim=16)
    torch.manual_seed(0)
    model = transformers.CLIPModel(config)
    input_ids = torch.randint(1, 97, (2, 7))
    input_ids[:, -1] = 98  # CLIP pools the text at its end-of-text token
    pixel_values = torch.randn(2, 3, 16, 16)
    report = apollo_compile.explain(model, input_ids=input_ids, pixel_values=pixel_values, return_loss=True,
                                    options=EAGER)
    assert report.ran_backward and report.backward_from == "output.loss"
    assert "backward" in _kinds(report) and "forward" in _kinds(report)
    assert all(p.grad is None for p in model.parameters())
    assert "(from output.loss)" in str(report)

"""The attention-masks pass (``passes/attention_masks.py``): a mask whose last dimension is broadcast
reaches ``scaled_dot_product_attention`` with that dimension dense, the same values and shape,
and training stays eager's; dense masks, no mask and symbolic shapes are left as they are."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import apollo_compile
from apollo_compile.passes import attention_masks
from helpers import TOLERANCE, assert_trains_like_eager, dynamo_graph
from test_optimizer_step import PARAMS  # its module docstring says why (Adam's eps=1e-4 too)

EAGER = {"subgraph_compiler": "eager"}
HEADS, WIDTH, TOKENS = 2, 16, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask=None):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, WIDTH))


class MaskedTwoTower(nn.Module):
    """Two attention towers and a join. The text tower's mask is built as transformers builds its
    bidirectional mask when traced: a column of ``q_idx >= 0`` broadcast to (B, 1, Q, K), strides
    (0, Q, 1, 0); `mask` picks it, a dense copy of it, or none."""

    def __init__(self, mask: str = "broadcast"):
        super().__init__()
        self.mask = mask
        self.image, self.text = Attention(), Attention()
        self.embed = nn.Embedding(32, WIDTH)

    def text_mask(self, ids):
        b, t = ids.shape
        if self.mask == "none":
            return None
        column = (torch.arange(t, device=ids.device)[None, None, :, None] >= 0)
        mask = column.expand(b, 1, t, t)
        return mask.contiguous() if self.mask == "dense" else mask

    def forward(self, patches, ids):
        image = self.image(patches).mean(1)
        x = self.embed(ids)
        text = self.text(x, self.text_mask(ids)).mean(1)
        logits = F.normalize(image, dim=-1) @ F.normalize(text, dim=-1).t() * 10.0
        labels = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def inputs(step: int, batch: int = 4):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, TOKENS, WIDTH, generator=g), torch.randint(0, 32, (batch, TOKENS), generator=g)


def _dynamo_graph(model, *args):
    """The Dynamo graph of `model` (helpers.dynamo_graph), traced afresh (another instance's compiled code is reused
    without calling the backend)."""
    torch._dynamo.reset()
    return dynamo_graph(model, *args)


def _sdpa_masks(gm):
    return [attention_masks.mask_of(n) for n in gm.graph.nodes
            if n.op == "call_function" and n.target in attention_masks.SDPA_TARGETS]


def test_a_broadcast_mask_reaches_attention_with_its_last_dimension_dense():
    torch.manual_seed(0)
    model = MaskedTwoTower("broadcast")
    gm, example = _dynamo_graph(model, *inputs(0))
    expected = gm(*example)
    decision = attention_masks.run(gm, None)
    assert decision["changed"] and len(decision["masks"]) == 1
    (rewritten,) = decision["masks"]
    assert rewritten["shape"] == [4, 1, TOKENS, TOKENS] and rewritten["stride"] == [0, TOKENS, 1, 0]
    image_mask, text_mask = _sdpa_masks(gm)
    assert image_mask is None
    val = text_mask.meta["example_value"]
    assert list(val.shape) == rewritten["shape"] and val.stride(-1) == 1  # what the fused kernels check
    # one slice of the broadcast batch dimension is copied, not the whole mask
    copied = text_mask.args[0].meta["example_value"]
    assert text_mask.target == "expand_as" and list(copied.shape) == [1, 1, TOKENS, TOKENS]
    torch.testing.assert_close(gm(*example), expected, rtol=0, atol=0)


@pytest.mark.parametrize("mask", ["dense", "none"])
def test_a_dense_mask_or_none_is_left_as_it_is(mask):
    torch.manual_seed(0)
    gm, _ = _dynamo_graph(MaskedTwoTower(mask), *inputs(0))
    code = gm.code
    assert attention_masks.run(gm, None) == {"changed": False, "masks": []}
    assert gm.code == code


def test_training_with_a_broadcast_mask_matches_eager():
    """Module-compiled, and the pass's decision in the plan."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    apollo_compile.clear_plans()
    assert_trains_like_eager(MaskedTwoTower("broadcast"), inputs, options=EAGER, steps=3)
    decision = apollo_compile.last_plan().pre_grad["attention_masks"]
    assert decision["changed"] and decision["masks"][0]["stride"] == [0, TOKENS, 1, 0]


def test_whole_step_with_a_broadcast_mask_and_adamw_inside_matches_eager():
    """compile_step(step, optimizer=AdamW): the loss and the parameters after each step as eager's
    (at test_optimizer_step's tolerance, with its eps)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MaskedTwoTower("broadcast")
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)

    def step(patches, ids):
        loss = model(patches, ids)
        loss.backward()
        return loss.detach()

    compiled = apollo_compile.compile_step(step, optimizer=opt, options=EAGER)
    for i in range(3):
        loss = compiled(*inputs(i))
        ref_loss = ref(*inputs(i))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, ref_loss.detach(), **PARAMS if i else TOLERANCE["eager"])
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, **PARAMS, msg=lambda m: f"step {i} {name}: {m}")
    assert apollo_compile.last_plan().pre_grad["attention_masks"]["changed"]


def test_a_mask_of_symbolic_shape_is_left_as_it_is():
    """With dynamic shapes the mask's strides are symbolic: not read, and training is still eager's."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = MaskedTwoTower("broadcast")
    ref = copy.deepcopy(model)
    compiled = torch.compile(model, backend="apollo", options=EAGER, dynamic=True)
    for batch in (4, 6):
        x = inputs(batch, batch)
        torch.testing.assert_close(compiled(*x), ref(*x), **TOLERANCE["eager"])
    assert apollo_compile.last_plan().pre_grad["attention_masks"]["changed"] is False


def test_which_masks_are_rewritten():
    """A last dimension of stride 0 (broadcast) or of a transposed mask is not dense; a dense one,
    or one key only, is left."""
    dense = torch.ones(4, 1, TOKENS, TOKENS, dtype=torch.bool)
    assert attention_masks.last_dim_not_dense(torch.ones(1, 1, TOKENS, 1, dtype=torch.bool).expand_as(dense))
    assert attention_masks.last_dim_not_dense(dense.transpose(-1, -2))
    assert not attention_masks.last_dim_not_dense(dense)
    assert not attention_masks.last_dim_not_dense(torch.ones(4, 1, TOKENS, 1, dtype=torch.bool).expand(4, 2, TOKENS, 1))


class _HFLoss(nn.Module):
    """A Hugging Face two-tower model called as HF models are, by keyword, the loss off its output."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, pixels):
        return self.model(input_ids=ids, pixel_values=pixels, return_loss=True).loss


def test_hugging_face_siglip_with_the_mask_older_transformers_trace():
    """HF SigLIP with transformers made to build its bidirectional mask as versions before
    huggingface/transformers#48925 did whenever the model is traced (an all-True column expanded,
    strides (0, Q, 1, 0)): the pass lays out the text tower's mask, and training is eager's."""
    masking = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking, "_ignore_bidirectional_mask_sdpa"):
        pytest.skip("this transformers decides its masks elsewhere")
    from models import tiny_hf

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(masking, "_ignore_bidirectional_mask_sdpa", lambda *args, **kwargs: False)
        torch._dynamo.reset()
        apollo_compile.clear_plans()

        def make_inputs(i):
            g = torch.Generator().manual_seed(i)
            return torch.randint(1, 99, (4, 16), generator=g), torch.randn(4, 3, 16, 16, generator=g)

        assert_trains_like_eager(_HFLoss(tiny_hf("siglip")), make_inputs, options=EAGER, steps=2)
    decision = apollo_compile.last_plan().pre_grad["attention_masks"]
    assert decision["changed"] and {tuple(m["stride"]) for m in decision["masks"]} == {(0, 16, 1, 0)}

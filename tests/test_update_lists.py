"""passes/update_lists.py's cut (NOTE: A list is cut where one launch ends): each part is what one
launch of torch's multi-tensor kernel takes, by the rule of ATen's MultiTensorApply.cuh, restated
here (`aten_launches`) and checked against the launch counts measured on the H200."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apollo_compile.passes.update_lists import CHUNK, LAUNCH_CHUNKS, LAUNCH_TENSORS, parts_of


def aten_launches(sizes: list[int], max_tensors: int, max_chunks: int = LAUNCH_CHUNKS, chunk: int = CHUNK) -> int:
    """Launches of torch's multi-tensor kernel over one list of tensors of `sizes` elements, as
    ``multi_tensor_apply_for_fused_optimizer`` makes them: a block per chunk; a launch when the
    blocks are full, or the tensors are and the last one's chunks are all in; a tensor cut by a
    launch goes on in the next."""
    launches = tensors = blocks = 0
    for size in sizes:
        chunks = -(-size // chunk)
        tensors += 1
        for c in range(chunks):
            blocks += 1
            last = c == chunks - 1
            if (tensors == max_tensors and last) or blocks == max_chunks:
                launches += 1
                blocks = 0
                tensors = 0 if last else 1
    return launches + (blocks > 0)


def test_parts_of_cuts_at_the_tensors_or_the_chunks_of_one_launch():
    assert parts_of([1, 1, 1, 1, 1], max_tensors=2, max_chunks=10, chunk=1) == [[0, 1], [2, 3], [4]]
    assert parts_of([3, 3, 3, 3], max_tensors=9, max_chunks=6, chunk=1) == [[0, 1], [2, 3]]
    assert parts_of([5, 5, 5], max_tensors=9, max_chunks=4, chunk=2) == [[0], [1], [2]]  # 3 chunks each
    assert parts_of([10, 1, 1], max_tensors=9, max_chunks=4, chunk=1) == [[0], [1, 2]]  # a larger one alone
    assert parts_of([1, 10, 1], max_tensors=9, max_chunks=4, chunk=1) == [[0], [1], [2]]
    assert parts_of([], max_tensors=4) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=60), st.integers(1, 8), st.integers(1, 12), st.integers(1, 5))
def test_every_part_is_one_launch(sizes, max_tensors, max_chunks, chunk):
    """Each part takes one launch (a tensor of more chunks than one launch holds: as many as it
    needs alone), and the parts are the list in order."""
    parts = parts_of(sizes, max_tensors, max_chunks, chunk)
    assert [i for part in parts for i in part] == list(range(len(sizes)))
    for part in parts:
        launches = aten_launches([sizes[i] for i in part], max_tensors, max_chunks, chunk)
        chunks = -(-sizes[part[0]] // chunk)
        alone = len(part) == 1 and chunks > max_chunks
        assert launches == (-(-chunks // max_chunks) if alone else 1), (part, launches)


def test_hf_siglips_update_launches_as_measured():
    """HF SigLIP base's 408 parameters (built on the meta device): eager's fused AdamW over one
    list takes 13 launches, a cut by elements alone (320 x 65536 per part) 21, as
    benchmarks/probes/step_kernels.py counts on a GPU; one launch per part takes 15 (the token
    embedding, 375 chunks, takes two alone; docs/design/step-passes.md#launch-parts). Each tower's parameters in reverse order, as the
    backward makes their gradients."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.SiglipModel(transformers.SiglipConfig())
    towers: dict[str, list[int]] = {}
    for name, p in model.named_parameters():
        towers.setdefault(name.split(".")[0] if name.startswith(("vision_model", "text_model")) else "join",
                          []).append(p.numel())
    adam = LAUNCH_TENSORS[4]  # params, grads, exp_avgs, exp_avg_sqs
    assert aten_launches([p.numel() for p in model.parameters()], adam) == 13

    def by_elements(sizes: list[int]) -> list[list[int]]:
        parts, total = [], 0
        for size in sizes:
            if not parts or total + size > LAUNCH_CHUNKS * CHUNK:
                parts.append([])
                total = 0
            parts[-1].append(size)
            total += size
        return parts

    tower_lists = [sizes[::-1] for sizes in towers.values()]
    assert sum(aten_launches(part, adam) for sizes in tower_lists for part in by_elements(sizes)) == 21
    assert sum(aten_launches([sizes[i] for i in part], adam)
               for sizes in tower_lists for part in parts_of(sizes, adam)) == 15

"""The pieces of the CUDA-graph runner that need no GPU: layout checks and output copies."""

import torch

from apollo_compile.runtime.cudagraph import fresh_copies, is_dense


def test_is_dense():
    assert is_dense(torch.randn(3, 4)) and is_dense(torch.randn(3, 4).t())
    assert is_dense(torch.randn(2, 3, 4).permute(2, 0, 1)) and is_dense(torch.randn(1, 5)[:, :])
    assert not is_dense(torch.randn(3, 1).expand(3, 4))  # overlapping
    assert not is_dense(torch.randn(4, 6)[:, :3])  # gaps


def test_fresh_copies_keep_values_and_strides_in_new_memory():
    tensors = [torch.randn(3, 4).t(), torch.randn(5), torch.randn(2, dtype=torch.bfloat16), torch.randn(4, 6)[:, :3]]
    copies = fresh_copies(tensors)
    for src, dst in zip(tensors, copies):
        assert torch.equal(src, dst) and dst.dtype == src.dtype
        assert dst.data_ptr() != src.data_ptr()
        if is_dense(src):
            assert dst.stride() == src.stride()
    # the copies live in new memory: a later write to a source changes no copy
    for src in tensors:
        src.add_(1)
    assert not any(torch.equal(src, dst) for src, dst in zip(tensors, copies))
    # contiguous float32 copies share one allocation (one copy kernel for all of them)
    many = [torch.randn(3), torch.randn(2, 2), torch.randn(1)]
    copies = fresh_copies(many)
    assert len({c.untyped_storage().data_ptr() for c in copies}) == 1
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(many, copies))


def test_is_non_overlapping():
    from apollo_compile.runtime.cudagraph import is_non_overlapping

    assert is_non_overlapping(torch.randn(4, 6)[:, :3])  # gaps are fine
    assert is_non_overlapping(torch.empty_strided((4, 4, 4, 8), (384, 8, 96, 1)))  # a slice of a qkv projection
    assert not is_non_overlapping(torch.randn(3, 1).expand(3, 4))
    assert not is_non_overlapping(torch.randn(10).as_strided((3, 3), (2, 1)))  # rows overlap
    buf = torch.empty_strided((4, 4, 4, 8), (384, 8, 96, 1))
    buf.copy_(torch.randn(4, 4, 4, 8))  # what the runner does with such an input


def test_plans_hold_the_cuda_graph_runner_weakly():
    """A plan outlives dynamo.reset() and recompiles; it must not keep a replaced graph's CUDA graph,
    pool and static outputs allocated (it did, and inflated every later peak in the H200 runs)."""
    import gc
    import weakref

    from apollo_compile.plan import GraphPlan
    from apollo_compile.runtime.cudagraph import CudaGraphRunner, GraphFamily

    runner = CudaGraphRunner({"lanes": lambda args: args}, "g_forward", "forward", GraphFamily(), set(), None)
    plan = GraphPlan("g_forward", "forward", "cuda", gm=None, decisions={}, runner_ref=weakref.ref(runner))
    assert plan.runner is runner and plan.summary()["cuda_graph"]["replays"] == 0
    del runner
    gc.collect()
    assert plan.runner is None and "cuda_graph" not in plan.summary()

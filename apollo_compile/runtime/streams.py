"""Lane streams: what the generated runtime calls as ``rt``.

On CUDA each side lane is a CUDA stream and cross-lane dependencies are events; lane 0 is
whatever stream is current when the graph runs (the caller's, or the CUDA-graph capture stream).
With SM quotas, a side lane's stream belongs to a green context limited to that many SMs (lane 0
always runs on the whole device). On CPU every call is a no-op, so the same generated program
runs its subgraphs in launch order.

A forward and its backward get the same plain stream for each side lane (``shared_streams``, the
family's): the caching allocator hands a freed block only to a tensor allocated on the stream that
allocated it, so a saved activation a forward's side lane made can be reused by the backward's
same lane, and only there (docs/design/cuda-graphs.md#donation-on-side-lanes).
"""

from __future__ import annotations

import contextlib
import weakref

import torch


def quota_stream(sms: int, device: torch.device):
    """A green context of `sms` SMs and its stream (kept together: the stream needs its context)."""
    from torch.cuda.green_contexts import GreenContext

    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        ctx = GreenContext.create(num_sms=sms, device_id=index)  # torch >= 2.12: keyword-only
    except TypeError:
        ctx = GreenContext.create(sms, index)  # torch 2.11: positional
    return ctx, ctx.Stream()


class LaneRuntime:
    def __init__(self, side_lanes: list[int], recorded: list[int], device: torch.device,
                 quotas: dict[int, int] | None = None,
                 shared_streams: dict[int, torch.cuda.Stream] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.events: dict[int, torch.cuda.Event] = {}
        self.green_contexts: list = []
        self.held: list[tuple] = []  # values read across lanes, until the join (keep_alive)
        self.made_here: dict[int, dict[int, weakref.ref]] = {}  # lane -> id -> input made on its stream
        if self.cuda:
            shared = {} if shared_streams is None else shared_streams
            for lane in side_lanes:
                sms = (quotas or {}).get(lane)
                if sms:  # a quota stream is this runtime's own: its context limits it
                    ctx, self.streams[lane] = quota_stream(sms, device)
                    self.green_contexts.append(ctx)
                else:
                    if lane not in shared:
                        shared[lane] = torch.cuda.Stream(device=device)
                    self.streams[lane] = shared[lane]
            self.events = {sg: torch.cuda.Event() for sg in recorded}

    def empty(self, size: tuple[int, ...], stride: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A buffer on the caller's stream that a side lane writes (codegen, NOTE: Main-allocated)."""
        return torch.empty_strided(size, stride, dtype=getattr(torch, dtype), device=self.device)

    def fork(self, lanes: list[int]) -> None:
        """Side lanes wait for everything already queued on the caller's stream (inputs)."""
        if self.cuda:
            main = torch.cuda.current_stream()
            for lane in lanes:
                self.streams[lane].wait_stream(main)

    def lane(self, lane: int):
        return torch.cuda.stream(self.streams[lane]) if self.cuda else contextlib.nullcontext()

    def record(self, subgraph: int) -> None:
        if self.cuda:
            self.events[subgraph].record()

    def wait(self, subgraph: int) -> None:
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.events[subgraph])

    def keep_alive(self, lane: int, *values) -> None:
        """Hold values that `lane` reads but another lane made until :meth:`release` (graph inputs
        count as the main lane's, except those :meth:`free_at_last_reader` names).

        Not ``record_stream``: under CUDA-graph capture the allocator defers a recorded block's
        free until capture ends and keeps its events, and each call costs host time per tensor
        (parameters included). Holding a reference until the main lane has joined every side
        lane is exact in both modes and costs one append."""
        if self.cuda:
            if self.made_here:
                made = self.made_here.get(lane, {})
                values = tuple(v for v in values if (ref := made.get(id(v))) is None or ref() is not v)
            self.held.append(values)

    def free_at_last_reader(self, made_here: dict[int, list[torch.Tensor]]) -> None:
        """Side lane -> inputs its own stream made and only it reads (saved activations of the
        forward's same lane, found by the backward's capture): :meth:`keep_alive` does not hold
        them, so the lane frees each at its last reader and its stream reuses the block. An empty
        dict ends it. Held weakly (an input held here would never be freed) and matched by
        identity, so a later tensor at the same address or with the same id is never taken for one."""
        self.made_here = {lane: {id(t): weakref.ref(t) for t in ts} for lane, ts in made_here.items()}

    def abandon(self) -> None:
        """A run raised midway (an OOM): join every side lane into the caller's stream and let go
        of what the run held across lanes.

        Under CUDA-graph capture the join lets capture end cleanly; ending it with side work
        unjoined fails and leaves the graph's pool allocated for the rest of the process (a failed
        capture must give its memory back: docs/design/cuda-graphs.md#a-failed-capture). Outside
        capture the held values go once the device is idle; kept, they would stay allocated for as
        long as the plan that holds this runtime."""
        if not self.cuda:
            return
        main = torch.cuda.current_stream()
        for stream in self.streams.values():
            main.wait_stream(stream)
        if not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()
        self.held.clear()

    def release(self) -> None:
        """Called after the join: every cross-lane reader is done, in stream order."""
        self.held.clear()

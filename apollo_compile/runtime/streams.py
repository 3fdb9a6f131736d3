"""Lane streams: what the generated runtime calls as ``rt``.

On CUDA each side lane is a CUDA stream and cross-lane dependencies are events; lane 0 is
whatever stream is current when the graph runs (the caller's, or the CUDA-graph capture stream).
On CPU every call is a no-op, so the same generated program runs its subgraphs in launch order.
"""

from __future__ import annotations

import contextlib

import torch


class LaneRuntime:
    def __init__(self, side_lanes: list[int], recorded: list[int], device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.streams: dict[int, torch.cuda.Stream] = {}
        self.events: dict[int, torch.cuda.Event] = {}
        if self.cuda:
            self.streams = {lane: torch.cuda.Stream(device=device) for lane in side_lanes}
            self.events = {sg: torch.cuda.Event() for sg in recorded}

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
        """Tell the allocator that `lane`'s stream reads these, so freeing them waits for it."""
        if not self.cuda:
            return
        stream = self.streams[lane] if lane else torch.cuda.current_stream()
        for v in values:
            if isinstance(v, torch.Tensor) and v.is_cuda:
                v.record_stream(stream)

"""Tensors copied to a CUDA device ahead of their use (issue 49, item 6): a streamed run reads the next decoder block
on a helper thread while the current one computes; on a GPU that thread also copies the block's tensors to the
device, through page-locked (pinned) host memory on a stream of its own, so that the copy runs beside the current
block's kernels at the bus's full rate instead of on the pass's stream, synchronously, from pageable memory.

The pinned host buffers come from torch's caching host allocator, which records each asynchronous copy's use of a
buffer and does not hand it out again before the copy is done: dropping them after the copies are queued is safe.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def ahead_to(device) -> bool:
    """Whether tensors for `device` are copied ahead of their use (CUDA only: a CPU block is used where it is read)."""
    return torch.device(device).type == "cuda"


@dataclass
class DeviceCopies:
    """`tensors` (name -> tensor on the device) whose copies were queued on a side stream; `event` marks their end.
    Use them only through `ready()`."""

    tensors: dict[str, Tensor]
    event: object
    device: torch.device

    @classmethod
    def of(cls, tensors: dict[str, Tensor], device, stream=None) -> "DeviceCopies":
        """Queue the copies of `tensors` (host tensors) to the CUDA `device` on `stream` (default: a new side
        stream), each through pinned memory, and return at once (the calling thread does not wait for them)."""
        device = torch.device(device)
        stream = stream if stream is not None else torch.cuda.Stream(device)
        out = {}
        with torch.cuda.stream(stream):
            for name, t in tensors.items():
                host = t if t.is_pinned() else t.pin_memory()
                out[name] = host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return cls(out, event, device)

    def ready(self) -> dict[str, Tensor]:
        """The tensors, for use on the device's current stream: that stream waits for the copies (the host does
        not), and the allocator is told the tensors are used there, so their memory is not reused before it is
        done with them."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(self.event)
        for t in self.tensors.values():
            t.record_stream(current)
        return self.tensors

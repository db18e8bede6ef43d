"""The devices and process groups of a training job (one process, or DDP through ``torchrun``).

Two kinds of values cross ranks, each on the group made for it:
- device tensors (gradients through DDP, the summed loss statistics of a log window, the replica
  check) on the job's backend: NCCL for CUDA tensors, gloo for CPU ones;
- host values (token counts and stop votes every step, the vocabulary and validation results
  that rank 0 computes alone) on a gloo group, so they never stage through a GPU and never sync
  one. Its long timeout lets rank 0 validate or save a checkpoint while the other ranks wait in
  a host collective, not in an NCCL one whose watchdog would end the job.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# How long the other ranks wait for rank 0's validation, test scoring or checkpoint.
HOST_TIMEOUT = datetime.timedelta(hours=6)


@dataclass
class Distributed:
    """This process's rank in the job, and the collectives the trainer uses."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    host_group: dist.ProcessGroup | None = None  # gloo, for host values

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls, device: torch.device) -> Distributed:
        """One process, or the DDP job ``torchrun`` describes in the environment."""
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size == 1:
            return cls(device=device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and the caching allocator use the current one
            dist.init_process_group("nccl", device_id=device)
            host_group = dist.new_group(backend="gloo", timeout=HOST_TIMEOUT)
        else:
            dist.init_process_group("gloo", timeout=HOST_TIMEOUT)
            host_group = dist.group.WORLD
        return cls(dist.get_rank(), world_size, device, host_group)

    def sum(self, values: list[float]) -> list[float]:
        """Host values summed across ranks (identity for one process)."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device="cpu")  # the gloo host group
        dist.all_reduce(tensor, group=self.host_group)
        return tensor.tolist()

    def sum_on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A tensor on this process's device summed across ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(tensor)
        return tensor

    def broadcast_parameters(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank (what DDP does when it wraps one)."""
        if self.world_size > 1:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.detach(), src=0)

    def broadcast(self, value):
        """Rank 0's ``value`` (any picklable object) on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

"""
nanoparcae/ranks.py: the processes torchrun starts (a plain `python` run is one), and what they must agree on.
"""

import inspect
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nanoparcae.command import local_rank, spans

# -----------------------------------------------------------------------------
# Processes and the device. torchrun sets RANK; NCCL runs on CUDA, gloo on a CPU.


def parse_device(name):
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={name} is not a device this code runs on; pass cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={name}, but this machine has no CUDA GPU; pass --device=cpu")
    return device


RANK0_GROUP = None  # init_distributed's gloo group with the long timeout, for lone work


def init_distributed(device, timeout=timedelta(minutes=10), rank0_timeout=timedelta(hours=1)):
    """Join torchrun's process group when RANK is set -> this process's device. Collectives fail after
    `timeout`, those waiting for lone work after `rank0_timeout`."""
    global RANK0_GROUP
    if "RANK" not in os.environ:
        return device
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # it would hang, pytorch #167288
        raise ValueError("torchrun restarted the workers into the failed attempt's rendezvous store; launch it "
                         "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    # NCCL's group is bound to this rank's GPU, so its collectives never guess a device
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=device if cuda else None)
    # A gloo group beside NCCL's waits on the CPU, where NCCL's watchdog sees no pending op to time out
    RANK0_GROUP = dist.new_group(backend="gloo", timeout=rank0_timeout)
    return device


def no_buffer_sync():
    """DDP's keyword that skips the buffer sync at each forward, which torch 2.13 renamed. The old one skips the
    sync at start too, safe as every rank computes its RoPE tables."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}


def wait_for_rank0():
    """Wait here, up to rank0_timeout, while rank 0 (or a node's local rank 0) works alone."""
    if dist.is_initialized():
        dist.barrier(group=RANK0_GROUP)


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def print0(*args, **kwargs):
    """Print on rank 0 only, flushed, so a multi-process run logs from one process."""
    if rank_and_world()[0] == 0:
        print(*args, **kwargs, flush=True)


# MFU divides the matmul FLOPs executed (Parcae.matmul_flops_per_token) by the GPU's peak.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, per GPU


def peak_bf16_flops(device):
    """The GPU's dense bf16 peak, MFU's denominator; None on a CPU or an unlisted GPU."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)

# -----------------------------------------------------------------------------
# Ranks that agree. DDP keeps replicas equal only through equal gradients, so a rank started from another checkpoint
# or data drifts apart unseen, and one that stops alone leaves the others waiting. So its findings go to every rank.


def gather(value, group=None):
    """value from every rank, in rank order."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=group)
    return gathered


class Finished(Exception):
    """Ends an agreement's block on a rank that has nothing to do, such as a run trained to its end."""


class Agreement:
    """A `with` block of the set-up each rank runs on its own disk, ending in one gather on every rank. share(name=text)
    records what this rank found, and wait_for_rank0() lets global rank 0 work alone first. A ValueError or
    FileNotFoundError ends the block on its rank, Finished without a refusal. Then every rank raises one ValueError,
    for the first rank whose findings differ from rank 0's, else the first refusal; else `finished` is Finished's."""

    def __enter__(self):
        self.found, self.waited = {}, False
        return self

    def share(self, **found):
        self.found.update(found)

    def wait_for_rank0(self):
        self.waited = True
        wait_for_rank0()

    def __exit__(self, kind, err, traceback):
        if kind is not None and not issubclass(kind, (ValueError, FileNotFoundError, Finished)):
            return False
        if not self.waited:  # every rank waits once, in the block or here
            wait_for_rank0()
        rank, world = rank_and_world()
        node = int(os.environ.get("GROUP_RANK", rank // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        where = f"node {node} ({socket.gethostname()}, rank {rank})"
        # where the long timeout holds, as each rank's own reads take their time (13.4 GB at the 1.3B)
        ranks = gather((where, self.found, kind is Finished, kind and str(err)), RANK0_GROUP)
        shared = [name for name in ranks[0][1] if all(name in found for _, found, *_ in ranks)]
        for where, found, *_ in ranks:
            if names := [name for name in shared if found[name] != ranks[0][1][name]]:
                raise ValueError(f"{where} holds {' and '.join(str(found[name]) for name in names)}, rank 0 "
                                 f"{' and '.join(str(ranks[0][1][name]) for name in names)}; every rank must start "
                                 f"from rank 0's run and data: keep $NANOPARCAE_BASE_DIR on a filesystem the nodes "
                                 f"share, or copy rank 0's run folder, tokenizers/ and fineweb-edu/ to each node "
                                 f"(or give --device_batch_size where the GPUs' free memory differs)")
        lines = [line if not finished else None for _, _, finished, line in ranks]
        if first := next(((rank, line) for rank, line in enumerate(lines) if line), None):
            raise ValueError(first[1] if lines.count(first[1]) == len(lines) else
                             f"{first[1]} (rank {first[0]}; every rank stops)")
        self.finished = ranks[0][3] if ranks[0][2] else None
        return True

# -----------------------------------------------------------------------------
# Replicas that drift apart, found at each checkpoint

INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by bytes per element


def drift(state):
    """Every rank's weights compared -> None if every replica equals rank 0's, else what differs. Each tensor's bit
    patterns are summed as int64, wrapping: integer addition is exact and order-free, so equal tensors sum equal
    on any device, and any one changed bit changes the sum."""
    if not dist.is_initialized():
        return None
    sums = [t.detach().view(INTEGERS[t.element_size()]).sum(dtype=torch.int64) for t in state.values()]
    names, sums = list(state), gather(torch.stack(sums).tolist() if sums else [])
    if not (off := [rank for rank, other in enumerate(sums) if other != sums[0]]):
        return None
    tensors = [name for i, name in enumerate(names) if any(other[i] != sums[0][i] for other in sums)]
    return (f"on rank {spans(off)}, {len(tensors)} of {len(names)} tensors differ from rank 0's ("
            + ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "") + ")")

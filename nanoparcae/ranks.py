"""
nanoparcae/ranks.py: the processes torchrun starts, and ranks that agree through one gather.
A plain `python` run is one process. Before the first step every rank checks its start and data.
At each checkpoint, the replicas' weights are compared.
"""

import inspect
import os
import socket
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nanoparcae.command import spans

# -----------------------------------------------------------------------------
# Processes and the device. torchrun sets RANK; NCCL runs on CUDA, gloo on a CPU.
# A plain `python` run is one process.


def parse_device(name):
    """Turn --device's value into a torch.device.
    Raises ValueError naming the flag for a device this code cannot use, or CUDA where there is none."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={name} is not a device this code runs on; pass cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={name}, but this machine has no CUDA GPU; pass --device=cpu")
    return device


def local_rank():
    """Return this process's rank on its node, torchrun's LOCAL_RANK; 0 in a plain run."""
    return int(os.environ.get("LOCAL_RANK", 0))


RANK0_GROUP = None  # init_distributed's gloo group with the long timeout, for wait_for_rank0


def init_distributed(device, timeout=timedelta(minutes=10), rank0_timeout=timedelta(hours=1)):
    """Join torchrun's process group when RANK is set, and return this process's device.
    Its collectives fail after `timeout`; wait_for_rank0 waits up to `rank0_timeout`.
    Workers restarted into the failed attempt's store would hang, so they raise ValueError."""
    global RANK0_GROUP
    if "RANK" not in os.environ:
        return device
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # pytorch #167288
        raise ValueError("torchrun restarted the workers into the failed attempt's rendezvous store; launch it "
                         "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    # A gloo group beside NCCL's waits on the CPU.
    # No NCCL op is then pending, which NCCL's watchdog would time out.
    RANK0_GROUP = dist.new_group(backend="gloo", timeout=rank0_timeout)
    return device


def no_buffer_sync():
    """Return DDP's keyword that skips the buffer sync at each forward; torch 2.13 renamed it.
    The old one also skips the sync at start. That is safe, since every rank computes its own RoPE tables."""
    names = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in names else {"broadcast_buffers": False}


def wait_for_rank0():
    """Make every rank wait here while rank 0, or a node's local rank 0, works alone.
    Such work writes a checkpoint, trains the tokenizer or fetches the CORE bundle.
    Each rank's read of the checkpoint it resumes from counts too.
    The wait lasts up to init_distributed's rank0_timeout.
    Otherwise the others would fail at their next collective's shorter timeout."""
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
    """Return the GPU's dense bf16 peak, MFU's denominator; None on a CPU or an unlisted GPU."""
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else ""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)

# -----------------------------------------------------------------------------
# Ranks that agree. DDP keeps replicas equal only through equal averaged gradients and optimiser arithmetic.
# A rank started from another checkpoint (say, kept on one node only) trains on, drifting apart unseen.
# A rank that stops alone leaves the others waiting at their next collective until its timeout.
# So every comparison is gathered on every rank, and every rank decides alike.

INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by bytes per element


def weight_sums(state):
    """Sum each tensor's bit patterns as int64, wrapping, and return one int per tensor of a state dict.
    Integer addition is exact and order-free, so equal tensors sum equal on any device and GPU.
    Any one changed bit changes the sum. It costs one read of the weights in memory."""
    sums = [t.detach().view(INTEGERS[t.element_size()]).sum(dtype=torch.int64) for t in state.values()]
    return torch.stack(sums).tolist() if sums else []


def gather(value):
    """Return value from every rank, in rank order; [value] in one process.
    Ranks decide alike through it, with min(gather(x)), all(gather(x)) or gather(x)[0] for rank 0's."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@contextmanager
def refusing_alike():
    """Run a block on every rank; a ValueError or FileNotFoundError on any rank stops every rank.
    The ranks meet once each has ended the block, in wait_for_rank0's long wait, and gather their errors.
    Each raises ValueError with the first refusing rank's line, naming that rank when the others differ."""
    refusal = None
    try:
        yield
    except (FileNotFoundError, ValueError) as err:
        refusal = str(err)
    wait_for_rank0()
    lines = gather(refusal)
    refused = [(rank, line) for rank, line in enumerate(lines) if line]
    if refused:
        rank, line = refused[0]
        raise ValueError(line if all(other == line for other in lines) else f"{line} (rank {rank}; every rank stops)")


def agree_to_start(run_name, step, digest):
    """Gather each rank's start before anything is built.
    A start is the step of the checkpoint it would resume from, and its digest. No checkpoint is (0, None).
    Ranks that would start from different checkpoints all raise ValueError with one line."""
    points = {}
    for rank, start in enumerate(gather((step, digest))):
        points.setdefault(start, []).append(rank)
    if len(points) > 1:
        where = "; ".join(f"step {step} ({f'weights {digest}' if digest else 'no checkpoint'}) on rank "
                          f"{spans(ranks)}" for (step, digest), ranks in points.items())
        raise ValueError(f"the ranks would start run {run_name} from different checkpoints: {where}; every node "
                         f"must see the run's newest checkpoint: keep $NANOPARCAE_BASE_DIR on a filesystem the "
                         f"nodes share, or copy the run folder to each node")


def agree_on_data(tokenizer, shards):
    """Gather every rank's tokenizer and FineWeb-Edu training shards before the data is read.
    tokenizer is None where its node has none; shards is a span ("0-345"), or None for other data.
    When a node's differ from rank 0's, every rank raises ValueError alike, in one line naming that node.
    Tokenizers compare by their files' digest, the one a checkpoint records."""
    rank, world = rank_and_world()
    node = int(os.environ.get("GROUP_RANK", rank // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    held = gather((node, socket.gethostname(), None if tokenizer is None else tokenizer.digest, shards))
    _, _, tokenizer0, shards0 = held[0]
    differ = {}  # (node, host, (what it holds, what rank 0 holds) for each that differs) -> its ranks
    for rank, (node, host, digest, train_shards) in enumerate(held):
        what = [] if digest == tokenizer0 else \
            [("no tokenizer" if digest is None else f"tokenizer {digest}", f"tokenizer {tokenizer0}")]
        what += [] if train_shards == shards0 else [(f"training shards {train_shards}", f"training shards {shards0}")]
        if what:
            differ.setdefault((node, host, tuple(what)), []).append(rank)
    if differ:
        (node, host, what), ranks = next(iter(differ.items()))
        theirs, rank0s = zip(*what)
        others = f" ({len(differ) - 1} more node(s) differ)" if len(differ) > 1 else ""
        raise ValueError(f"node {node} ({host}, rank {spans(ranks)}) holds {' and '.join(theirs)}, rank 0 "
                         f"{' and '.join(rank0s)}{others}; every node must read rank 0's data: keep "
                         f"$NANOPARCAE_BASE_DIR on a filesystem the nodes share, or copy rank 0's tokenizers/ and "
                         f"fineweb-edu/ folders to each node")


def drift(state):
    """At a checkpoint, gather every rank's weight_sums.
    -> None if every replica equals rank 0's. Else what differs, for the line that stops the run."""
    if not dist.is_initialized():
        return None
    names, sums = list(state), gather(weight_sums(state))
    off = [rank for rank, other in enumerate(sums) if other != sums[0]]
    if not off:
        return None
    tensors = [name for i, name in enumerate(names) if any(other[i] != sums[0][i] for other in sums)]
    return (f"on rank {spans(off)}, {len(tensors)} of {len(names)} tensors differ from rank 0's ("
            + ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "") + ")")

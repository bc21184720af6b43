"""
nanoparcae/ranks.py: ranks that agree. Before the first step every rank checks that all start from the same
checkpoint; at each checkpoint the replicas' weights are compared.
Each check runs before what it protects; docs/distributed.md says what each catches.
"""

import hashlib

import torch
import torch.distributed as dist

from nanoparcae.common import fail, spans

# -----------------------------------------------------------------------------
# Ranks that agree. DDP keeps its replicas equal only by giving each the same averaged gradients and the same
# optimiser arithmetic: a rank that starts from another checkpoint (checkpoints kept on one node only, say) trains
# on, drifting apart unseen, and a rank that stops alone leaves the others waiting at their next collective until
# its timeout. So every comparison is gathered on every rank, and every rank decides alike.

INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by bytes per element


def weight_sums(state):
    """Per tensor of a state dict, the sum of its elements' bit patterns read as integers (int64, wrapping) ->
    a list of ints. Integer addition is exact and does not depend on order, so equal tensors give equal sums on
    any device and GPU, and any one changed bit changes the sum; it costs one read of the weights in memory."""
    sums = [t.detach().view(INTEGERS[t.element_size()]).sum(dtype=torch.int64) for t in state.values()]
    return torch.stack(sums).tolist() if sums else []


def checkpoint_digest(state):
    """A checkpoint's weights as 12 hex digits: the sha256 of weight_sums. Of the weights already loaded rather
    than of the file's bytes: every rank has them in memory to resume from (5.4 GB in the 1.3B model's float32,
    on the GPU), where hashing the file would read all of its ~16 GB again, optimiser state included, from disk;
    and the weights are what the ranks must share."""
    return hashlib.sha256(repr(weight_sums(state)).encode()).hexdigest()[:12]


def gather(value):
    """value from every rank, in rank order (one process: [value])."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def one_refusal(lines):
    """Each rank's refusal (a line, or None) -> None when no rank refused, else the line every rank stops with:
    the first rank's, naming that rank when the others did not refuse alike."""
    refusals = [(rank, line) for rank, line in enumerate(lines) if line]
    if not refusals:
        return None
    rank, line = refusals[0]
    alike = len(refusals) == len(lines) and all(other == line for _, other in refusals)
    return line if alike else f"{line} (rank {rank}; every rank stops)"


def refuse_alike(refusal):
    """Every rank's refusal (a line, or None) gathered: when any rank refused, every rank fails with one line
    (one_refusal), printed once a node. A refusal that only some ranks meet is never silent."""
    if line := one_refusal(gather(refusal)):
        fail(line)


def agree_to_start(run_name, refusal, step, digest):
    """Before anything is built: every rank's refusal (a line, or None), the step of the checkpoint it would
    resume from (0: none) and that checkpoint's digest (None: none), gathered. ValueError with one line on every
    rank when any rank refused (the first one's line) or when they would start from different checkpoints."""
    starts = gather((refusal, step, digest))
    if line := one_refusal([line for line, _, _ in starts]):
        raise ValueError(line)
    points = {}
    for rank, (_, step, digest) in enumerate(starts):
        points.setdefault((step, digest), []).append(rank)
    if len(points) > 1:
        where = "; ".join(f"step {step} ({f'weights {digest}' if digest else 'no checkpoint'}) on rank "
                          f"{spans(ranks)}" for (step, digest), ranks in points.items())
        raise ValueError(f"the ranks would start run {run_name} from different checkpoints: {where}; every node "
                         f"must see the run's newest checkpoint: keep $NANOPARCAE_BASE_DIR on a filesystem the "
                         f"nodes share, or copy the run folder to each node")


def drift(state):
    """At a checkpoint: every rank's weight_sums gathered -> None when every replica equals rank 0's, else what
    differs, for the line that stops the run."""
    if not dist.is_initialized():
        return None
    names, sums = list(state), gather(weight_sums(state))
    off = [rank for rank, other in enumerate(sums) if other != sums[0]]
    if not off:
        return None
    tensors = [name for i, name in enumerate(names) if any(other[i] != sums[0][i] for other in sums)]
    return (f"on rank {spans(off)}, {len(tensors)} of {len(names)} tensors differ from rank 0's ("
            + ", ".join(tensors[:3]) + (", ..." if len(tensors) > 3 else "") + ")")

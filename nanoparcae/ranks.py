"""
nanoparcae/ranks.py: ranks that agree.
Before the first step, every rank checks that all start from the same checkpoint and read the same data.
At each checkpoint, the replicas' weights are compared.
Each check runs before what it protects; docs/distributed.md says what each catches.
"""

import hashlib
import os
import socket
from contextlib import contextmanager

import torch
import torch.distributed as dist

from nanoparcae.common import rank_and_world, spans, wait_for_rank0

# -----------------------------------------------------------------------------
# Ranks that agree. DDP keeps replicas equal only through equal averaged gradients and optimiser arithmetic.
# A rank started from another checkpoint (say, kept on one node only) trains on, drifting apart unseen.
# A rank that stops alone leaves the others waiting at their next collective until its timeout.
# So every comparison is gathered on every rank, and every rank decides alike.

INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # by bytes per element


def weight_sums(state):
    """A state dict -> a list of ints, one per tensor: its bit patterns summed as int64, wrapping.
    Integer addition is exact and order-free, so equal tensors sum equal on any device and GPU.
    Any one changed bit changes the sum. It costs one read of the weights in memory."""
    sums = [t.detach().view(INTEGERS[t.element_size()]).sum(dtype=torch.int64) for t in state.values()]
    return torch.stack(sums).tolist() if sums else []


def gather(value):
    """value from every rank, in rank order (one process: [value])."""
    if not dist.is_initialized():
        return [value]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def one_refusal(lines):
    """Each rank's refusal (a line, or None) -> the line every rank stops with, or None.
    It is the first rank's line; it names that rank when the others did not refuse alike."""
    refusals = [(rank, line) for rank, line in enumerate(lines) if line]
    if not refusals:
        return None
    rank, line = refusals[0]
    alike = len(refusals) == len(lines) and all(other == line for _, other in refusals)
    return line if alike else f"{line} (rank {rank}; every rank stops)"


@contextmanager
def refusing_alike(explain=str):
    """Around a block every rank runs: its ValueError or FileNotFoundError, as the line explain(err), is gathered
    once every rank has ended the block (wait_for_rank0's long timeout), then refuse_alike.
    A refusal on one rank stops every rank, none stops alone."""
    refusal = None
    try:
        yield
    except (FileNotFoundError, ValueError) as err:
        refusal = explain(err)
    wait_for_rank0()
    refuse_alike(refusal)


def refuse_alike(refusal):
    """Every rank's refusal (a line, or None) gathered: when any rank refused, every rank raises ValueError with
    one line (one_refusal). A refusal that only some ranks meet is never silent."""
    if line := one_refusal(gather(refusal)):
        raise ValueError(line)


def agree_to_start(run_name, refusal, step, digest):
    """Before anything is built, gather each rank's start:

    - refusal: a line, or None.
    - step: of the checkpoint it would resume from (0: none).
    - digest: that checkpoint's (None: none).

    Raises ValueError with one line on every rank if any rank refused (the first one's line).
    Likewise if they would start from different checkpoints."""
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


def tokenizer_digest(tokenizer):
    """A tokenizer's vocabulary, every token's bytes in id order, as 12 hex digits of their sha256."""
    vocabulary = hashlib.sha256()
    for token in range(tokenizer.vocab_size):
        piece = tokenizer.enc.decode_single_token_bytes(token)
        vocabulary.update(len(piece).to_bytes(4, "little") + piece)
    return vocabulary.hexdigest()[:12]


def agree_on_data(tokenizer, shards):
    """Before the data is read: every rank's tokenizer (None: its node has none) and FineWeb-Edu training shards
    (spans; None: other data), gathered. A node whose either differs from rank 0's: every rank raises ValueError
    alike, one line naming that node."""
    rank, world = rank_and_world()
    node = int(os.environ.get("GROUP_RANK", rank // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    held = gather((node, socket.gethostname(), None if tokenizer is None else tokenizer_digest(tokenizer),
                   shards))
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

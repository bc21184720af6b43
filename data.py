"""
data.py: the training data loader (METHOD.md §2).
Each rank reads its own share of the documents and tokenizes them ahead in a thread.
It packs them best-fit into rows that start with BOS. Its state is small and resumes exactly.
It also yields the held-out batches, and scores a model's loss and bits per byte on them.
nanoparcae/dataset.py reads the text, and nanoparcae/tokenizer.py tokenizes it.

    reader = ChunkReader()                       # one per process, shared by its loaders
    loader = DataLoader(tokenizer, "stdlib", "train", batch_size=8, seq_len=2048, reader=reader)
    x, y = next(loader); state = loader.state_dict()   # a loader given `state` yields the same next
"""

import bisect
import collections
import contextlib
import functools
import itertools
import math
import queue
import random
import threading

import torch
import torch.distributed as dist

from model import evaluation_initial_state
from nanoparcae.dataset import ChunkReader, check_split, list_chunks

# -----------------------------------------------------------------------------
# The document stream, one rank's share of a split, epoch after epoch, each document with an id

class DocumentStream:
    """One rank's documents of a split.
    Each epoch shuffles the chunks, and each chunk's documents, from the seed.
    Rank r takes every world_size-th document, so the shares are disjoint and cover the split.
    A document's id is (epoch, chunk position, index in this rank's share)."""

    def __init__(self, source, split, seed=0, rank=0, world_size=1, reader=None, sharers=1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        self.chunks = list_chunks(source, split)
        self.source, self.split, self.seed, self.rank = source, split, seed, rank
        # `reader` is shared by this process's loaders, the `sharers` streams of this split
        self.world_size, self.reader, self.sharers = world_size, reader or ChunkReader(), sharers
        self._order = (None, None)

    def order(self, epoch):  # cached, since it is asked for once per chunk
        if self._order[0] != epoch:
            order = list(range(len(self.chunks)))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def share(self, epoch, position, shared=True):
        chunk = self.chunks[self.order(epoch)[position]]
        docs = (list(self.reader.documents(chunk, epoch, self.sharers)) if shared
                else self.reader.read(chunk))
        random.Random(f"{self.seed}:{epoch}:{position}").shuffle(docs)
        return docs[self.rank::self.world_size]

    def iterate(self, epoch=0, position=0, index=0, loop=True):
        """(doc_id, text) from the given id on, epoch after epoch if loop."""
        while True:
            whole_epoch, found = position == 0 and index == 0, False
            for pos in range(position, len(self.chunks)):
                docs = self.share(epoch, pos)
                found = found or bool(docs)
                for i in range(index, len(docs)):
                    yield (epoch, pos, i), docs[i]
                index = 0
            if whole_epoch and not found:  # looping over nothing would hang the trainer
                check_split(self.source, self.split)  # the split itself may hold none
                raise ValueError(f"rank {self.rank} of {self.world_size} has no documents in the "
                                 f"{self.split} split of {self.source}: use more data or fewer "
                                 f"ranks")
            if not loop:
                return
            epoch, position, index = epoch + 1, 0, 0

# -----------------------------------------------------------------------------
# The loader: BOS-aligned best-fit packing (METHOD.md §2), tokenized ahead, exactly resumable

DRAIN = 8  # at an epoch's end a buffer holds at most 1/DRAIN of its share


def tokenize_ahead(tokenizer, stream, start, loop, batch_docs, num_threads):
    """Lists of (doc_id, tokens), BOS first, batch_docs documents at a time."""
    documents = stream.iterate(*start, loop=loop)
    while batch := list(itertools.islice(documents, batch_docs)):
        doc_ids, texts = zip(*batch)
        yield list(zip(doc_ids, tokenizer.encode(list(texts), prepend_bos=True,
                                                 num_threads=num_threads)))


class Prefetcher:
    """Runs a generator in a thread, up to `depth` items ahead (tiktoken releases the GIL)."""

    def __init__(self, generator, depth=8):
        self.queue, self.stop = queue.Queue(depth), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(generator,), daemon=True)
        self.thread.start()

    def _run(self, generator):
        try:
            for item in generator:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except BaseException as e:  # the consumer raises it
            self._put(("error", e))

    def _put(self, message):
        while not self.stop.is_set():
            with contextlib.suppress(queue.Full):
                self.queue.put(message, timeout=0.1)
                return True
        return False

    def close(self):  # a thread left running could abort Python at exit
        self.stop.set()
        self.thread.join(timeout=60)

    def get(self):  # the next item; None at the end
        kind, item = self.queue.get()
        if kind != "item":  # put back, so every later call sees the same end or error
            self.queue.put((kind, item))
        if kind == "error":
            raise item
        return item


class DataLoader:
    """Yields (x, y), (batch_size, seq_len) on `device` (METHOD.md §2).
    Rows of seq_len + 1 tokens, each starting with BOS, are packed best-fit from a buffer of
    about buffer_docs documents; overflow is cropped. The train split loops; val is read once.
    At an epoch's end the buffer drains to an eighth of the share before the next epoch enters,
    so a share smaller than the buffer is still trained once before any document repeats.
    The state is only document ids; a resumed loader re-reads its buffer, yielding the same batches.
    `reader` is a ChunkReader this loader and sharers - 1 others share; None gives it its own."""

    def __init__(self, tokenizer, source, split, batch_size, seq_len, rank=0, world_size=1, seed=0,
                 device="cpu", buffer_docs=1000, num_threads=4, tokenize_batch=128, reader=None,
                 sharers=1):
        # first, so that close() runs when a check below raises
        self.prefetcher, self.pending = None, collections.deque()
        self.tokenizer, self.batch_size, self.seq_len = tokenizer, batch_size, seq_len
        self.device, self.tokenize_batch = torch.device(device), tokenize_batch
        self.buffer_docs, self.num_threads = buffer_docs, num_threads
        self.stream = DocumentStream(source, split, seed, rank, world_size, reader, sharers)
        self.loop = split == "train"
        self.next_doc = (0, 0, 0)  # id of the next document to take into the buffer
        self.epoch_docs = 0  # documents taken from the epoch of next_doc: the share, at its end
        self.buffer = []  # (length, arrival, doc_id, tokens), sorted by length then arrival
        self.arrivals = self.batches = 0

    def _next_document(self):
        if not self.pending:
            if self.prefetcher is None:
                self.prefetcher = Prefetcher(tokenize_ahead(
                    self.tokenizer, self.stream, self.next_doc, self.loop, self.tokenize_batch,
                    self.num_threads))
            if (batch := self.prefetcher.get()) is None:
                return None
            self.pending.extend(batch)
        doc_id, tokens = self.pending[0]
        if doc_id[0] != self.next_doc[0]:  # the next epoch waits while the buffer drains
            if len(self.buffer) > self.epoch_docs // DRAIN:
                return None
            self.epoch_docs = 0
        self.pending.popleft()
        self.next_doc, self.epoch_docs = (doc_id[0], doc_id[1], doc_id[2] + 1), self.epoch_docs + 1
        return doc_id, tokens

    def _fill_buffer(self):
        while len(self.buffer) < self.buffer_docs:
            if (document := self._next_document()) is None:  # val is read once, or it drains
                return
            bisect.insort(self.buffer, (len(document[1]), self.arrivals, *document))
            self.arrivals += 1

    def _pack_row(self):
        """Pack the longest document that fits, or else the shortest, cropped (METHOD.md §2)."""
        row, capacity = [], self.seq_len + 1
        while len(row) < capacity:
            self._fill_buffer()
            if not self.buffer:
                return None
            room = capacity - len(row)
            longest_fitting = bisect.bisect_right(self.buffer, (room, math.inf)) - 1
            tokens = self.buffer.pop(max(longest_fitting, 0))[3]
            row.extend(tokens[:room])
        return row

    def __iter__(self):
        return self

    def __next__(self):
        rows = []
        for _ in range(self.batch_size):
            row = self._pack_row()
            if row is None:
                if self.batches == 0:
                    raise ValueError(
                        f"the {self.stream.split} split of {self.stream.source} holds less than "
                        f"one batch ({self.batch_size} x {self.seq_len + 1} tokens) for rank "
                        f"{self.stream.rank}: use a smaller batch size or sequence length, "
                        f"or more data")
                raise StopIteration
            rows.append(row)
        self.batches += 1
        batch = torch.tensor(rows, dtype=torch.long)
        x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        if self.device.type == "cuda":  # pinned, so the copy overlaps the GPU's work
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def state_dict(self):
        s = self.stream
        return {"source": s.source, "split": s.split, "seed": s.seed, "rank": s.rank,
                "world_size": s.world_size, "next_doc": list(self.next_doc),
                "buffer": [[arrival, *doc_id] for _, arrival, doc_id, _ in self.buffer],
                "epoch_docs": self.epoch_docs, "arrivals": self.arrivals, "batches": self.batches}

    def load_state_dict(self, state):
        s = self.stream
        mine = (s.split, s.seed, s.rank, s.world_size)
        theirs = (state["split"], state["seed"], state["rank"], state["world_size"])
        if mine != theirs:
            raise ValueError(f"loader state is for (split, seed, rank, world_size) = {theirs}, "
                             f"this loader is {mine}: each rank must save and restore its own "
                             f"loader state")
        self.close()
        self.pending.clear()
        self.next_doc = tuple(state["next_doc"])
        self.epoch_docs = state.get("epoch_docs", math.inf)  # a state without it never drains
        self.arrivals, self.batches = state["arrivals"], state["batches"]
        # the buffered documents, re-read and re-tokenized a chunk at a time
        by_chunk = collections.defaultdict(list)
        for arrival, epoch, position, index in state["buffer"]:
            by_chunk[epoch, position].append((arrival, index))
        self.buffer = []
        for (epoch, position), entries in by_chunk.items():
            docs = s.share(epoch, position, shared=False)  # no other loader resumes this chunk
            token_lists = self.tokenizer.encode([docs[i] for _, i in entries], prepend_bos=True,
                                                num_threads=self.num_threads)
            for (arrival, index), tokens in zip(entries, token_lists):
                bisect.insort(self.buffer, (len(tokens), arrival, (epoch, position, index), tokens))

    def close(self):  # stop tokenizing ahead
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None

    def __del__(self):
        self.close()


def val_batches(tokenizer, source, batch_size, seq_len, num_tokens, rank=0, world_size=1,
                device="cpu", reader=None):
    """Yield the same held-out batches at every call, num_tokens of the val split over all ranks.
    Seed 0, at least one batch each; fewer if the split runs out."""
    loader = DataLoader(tokenizer, source, "val", batch_size, seq_len, rank, world_size, seed=0,
                        device=device, reader=reader)
    yield from itertools.islice(loader, max(1, num_tokens // (batch_size * seq_len * world_size)))
    loader.close()


# -----------------------------------------------------------------------------
# The validation loss and bits per byte of held-out batches at depth T (METHOD.md §2)

def in_eval_mode(evaluate):
    """Run evaluate(model, ...) in eval mode, then restore the model's mode."""
    @functools.wraps(evaluate)
    def run(model, *args, **kwargs):
        was_training = model.training
        try:
            return evaluate(model.eval(), *args, **kwargs)
        finally:
            model.train(was_training)
    return run


def bf16_autocast(device):
    """Autocast to bf16 on CUDA, as training does. On a CPU it keeps an enclosing autocast on."""
    enabled = device.type == "cuda" or torch.is_autocast_enabled(device.type)
    return torch.autocast(device.type, torch.bfloat16, enabled=enabled)


@torch.no_grad()
@in_eval_mode
def evaluate_bpb(model, tokenizer, batches, T=None, seed=1234, state_norm=False):
    """Score (x, y) batches over all ranks -> (loss, bpb), and the mean ||h_T|| with state_norm.
    The loss is the mean nats per target, not y = -1. Bits per byte count the targets' bytes."""
    device = next(model.parameters()).device
    token_bytes = tokenizer.token_bytes.to(device)
    # Sums of nats, targets, nats of byte tokens, bytes, ||h_T|| x positions, positions.
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    h0_table = None
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        if h0_table is None or h0_table.size(1) < x.size(1):
            h0_table = evaluation_initial_state(model.config.d_model, x.size(1), seed, device)
        stats = {}
        with bf16_autocast(device):
            nats = model(x, targets=y, T=T, h0=h0_table[:, :x.size(1)].expand(x.size(0), -1, -1),
                         reduction="none", diagnostics=stats).double()
        valid = y >= 0
        num_bytes = torch.where(valid, token_bytes[y.clamp(min=0)], 0)
        sums[:4] += torch.stack([nats[valid].sum(), valid.sum().double(), nats[num_bytes > 0].sum(),
                                 num_bytes.sum().double()])
        if state_norm and stats["h_norm"] is not None:
            sums[4:] += torch.stack([stats["h_norm"].double(), sums.new_ones(())]) * x.numel()
    if dist.is_initialized():
        dist.all_reduce(sums)
    nats, targets, byte_nats, num_bytes, h_norm, positions = sums.tolist()
    if targets == 0 or num_bytes == 0:
        raise ValueError("no validation tokens to evaluate: pass more of them (eval_core.py "
                         "--val_tokens, train.py --eval_tokens) or check the data source")
    loss, bpb = nats / targets, byte_nats / (math.log(2) * num_bytes)
    return (loss, bpb, h_norm / positions if positions else None) if state_norm else (loss, bpb)

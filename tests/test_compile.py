"""torch.compile as train.py uses it (model.compile_blocks, DDP over gloo, bf16 autocast, dynamo's eager backend):
the graphs dynamo builds through training steps with sampled depths and gradient accumulation, evals at every T
from 1 to 2 x mu_rec, and CORE's scoring at batch sizes and lengths training never saw. The recompile limit is never
hit, the evals add compiled graphs of their own, CORE adds none (eager by choice), and two DDP processes build the
same graphs as one plain process."""

import json
import logging
import socket
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from nanoparcae.core_tasks import Row
from eval_core import evaluate_bpb, score_rows
from model import Parcae, ParcaeConfig, evaluation_initial_state

# d_model 256: a block holds 3 MB of weights, past the 1 MB of DDP's first bucket, so dynamo's DDP optimizer, left
# on, would split every block compiled inside DDP's forward
CONFIG = dict(d_model=256, head_dim=64, mu_rec=3, vocab_size=320, seq_len=32)
BATCH, STEPS, GRAD_ACCUM = 4, 3, 2
pytestmark = pytest.mark.slow  # compiles, and starts two processes


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LimitHits(logging.Handler):
    """The first line of every warning dynamo logs on reaching a recompile limit (it then runs the code eagerly)."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        if "recompile_limit" in record.getMessage():
            self.lines.append(record.getMessage().splitlines()[0])


def count_graphs(rank, world, port, out_dir):
    """Train, evaluate and score as train.py does, in a fresh process; write the graph count after each phase and
    the recompile-limit warnings dynamo logged."""
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    limit_hits = LimitHits()
    logging.getLogger("torch._dynamo").addHandler(limit_hits)
    from torch._dynamo.utils import counters
    compiled = []  # the graphs handed to the backend: after DDP's optimizer has split them, if it is on

    def eager_backend(graph, example_inputs):
        compiled.append(len(graph.graph.nodes))
        return graph.forward

    torch.manual_seed(0)
    raw = Parcae(ParcaeConfig.from_depth(6, **CONFIG))
    raw.compile_blocks(backend=eager_backend)
    model = DDP(raw, broadcast_buffers=False) if world > 1 else raw
    optimizer = torch.optim.SGD(raw.parameters(), lr=1e-3)
    depth_generator, data = torch.Generator(), torch.Generator().manual_seed(0)
    vocab, seq_len = CONFIG["vocab_size"], CONFIG["seq_len"]
    graphs = {}
    for step in range(STEPS):  # every process draws the same depths: its graphs then match one process's
        for micro in range(GRAD_ACCUM):
            depth_generator.manual_seed(step * GRAD_ACCUM + micro)
            x, y = (torch.randint(vocab, (BATCH, seq_len), generator=data) for _ in range(2))
            with (model.no_sync() if world > 1 and micro < GRAD_ACCUM - 1 else nullcontext()), \
                    torch.autocast("cpu", torch.bfloat16):
                (model(x, y, depth_generator=depth_generator) / GRAD_ACCUM).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    graphs["training"] = counters["stats"]["unique_graphs"], len(compiled)
    tokenizer = SimpleNamespace(token_bytes=torch.ones(vocab, dtype=torch.long))
    batches = [tuple(torch.randint(vocab, (BATCH, seq_len), generator=data) for _ in range(2)) for _ in range(2)]
    with torch.autocast("cpu", torch.bfloat16):
        for T in range(1, 2 * raw.config.mu_rec + 1):
            evaluate_bpb(raw, tokenizer, batches, T)
        graphs["evals"] = counters["stats"]["unique_graphs"], len(compiled)
        rows = [Row(list(range(1, n + 1)), 1, n, i) for i, n in enumerate([17, 17, 17, 23, 9, 5, 5])]
        h0_table = evaluation_initial_state(raw.config.d_model, seq_len, 0, "cpu")
        score_rows(raw, rows, raw.config.mu_rec, h0_table, batch_tokens=60)
    graphs["core"] = counters["stats"]["unique_graphs"], len(compiled)
    Path(out_dir, f"{world}_{rank}.json").write_text(json.dumps({"graphs": graphs, "limit_hits": limit_hits.lines}))
    if world > 1:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    """{(world, rank): what count_graphs wrote} for one plain process and two DDP processes."""
    out = tmp_path_factory.mktemp("compile")
    # the plain process and the DDP pair share nothing: they run side by side, each process one thread, each forked
    # from the server conftest started, which has imported torch
    jobs = [mp.start_processes(count_graphs, args=(world, free_port(), str(out)), nprocs=world, join=False,
                               start_method="forkserver") for world in (1, 2)]
    for job in jobs:
        while not job.join():
            pass
    return {(world, rank): json.loads((out / f"{world}_{rank}.json").read_text())
            for world in (1, 2) for rank in range(world)}


def test_no_recompile_limit_and_evals_compiled_and_core_eager(counts):
    for result in counts.values():
        assert result["limit_hits"] == [], result
        graphs = result["graphs"]  # phase -> [dynamo's unique_graphs, graphs the backend compiled]
        assert graphs["evals"][0] > graphs["training"][0] > 0, graphs  # the evals' no-grad graphs: compiled
        assert graphs["core"] == graphs["evals"], graphs  # CORE's shapes compiled nothing


def test_ddp_compiles_the_graphs_of_one_process(counts):
    assert counts[2, 0]["graphs"] == counts[2, 1]["graphs"] == counts[1, 0]["graphs"]

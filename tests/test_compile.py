"""torch.compile as train.py uses it (model.compile_regions): the compiled regions equal the eager forward (loss,
gradients, one optimizer step), a training step calls the regions it should, per-sequence depths never recompile
after warm-up, and evals and decoding run on a compiled model. Then, in processes of their own (DDP over gloo, bf16
autocast, dynamo's eager backend): the graphs dynamo builds through training steps with sampled depths and gradient
accumulation, evals at every T from 1 to 2 x mu_rec, and CORE's scoring at batch sizes and lengths training never
saw. The recompile limit is never hit, the evals add compiled graphs of their own, CORE adds none (eager by choice),
and two DDP processes build the same graphs as one plain process."""

import json
import logging
import socket
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from conftest import awaited, beforehand, compile_cache
from engine import generate
from nanoparcae.core_tasks import Row
from data import evaluate_bpb
from eval_core import score_rows
from model import Parcae, ParcaeConfig, evaluation_initial_state, split_depths
from optim import build_optimizer

# d_model 256: a block holds 3 MB of weights, past the 1 MB of DDP's first bucket, so dynamo's DDP optimizer, left
# on, would split every block compiled inside DDP's forward
CONFIG = dict(d_model=256, head_dim=64, mu_rec=3, vocab_size=320, seq_len=32)
BATCH, STEPS, GRAD_ACCUM = 4, 3, 2


SMALL = dict(d_model=64, head_dim=32, mu_rec=3, mu_bwd=2, vocab_size=257, seq_len=16)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing, and leaves dynamo's settings as it found them."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(optimize_ddp=True, recompile_limit=torch._dynamo.config.recompile_limit), \
            torch.fx.experimental._config.patch(backed_size_oblivious=False):  # compile_regions sets them
        yield
    torch._dynamo.reset()


def small_pair(injection="diagonal", backend="aot_eager"):
    """Two copies of one small model: eager, and compiled by model.compile_regions."""
    torch.manual_seed(0)
    eager, compiled = (Parcae(ParcaeConfig.from_depth(3, injection=injection, **SMALL)) for _ in range(2))
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_regions(backend=backend)
    return eager, compiled


def train_step(model, x, depths, autocast=False):
    """One forward and backward at the given depths, h0 seeded -> (loss, gradients)."""
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = model(x, x, depths=depths, h0_generator=torch.Generator().manual_seed(1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def assert_compiled_equals_eager(eager, compiled, autocast, rtol, atol):
    x = torch.randint(0, 257, (4, 16), generator=torch.Generator().manual_seed(0))
    depths = split_depths(torch.tensor([5, 4, 2, 1]), 2, training=True)  # rows stop at different steps
    results = [train_step(model, x, depths, autocast) for model in (eager, compiled)]
    torch.testing.assert_close(results[1][0], results[0][0], rtol=rtol, atol=atol)
    for got, want in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for model in (eager, compiled):
        build_optimizer(model, adamw_lr=8e-3).step()
    for got, want in zip(compiled.parameters(), eager.parameters()):
        # Muon orthogonalises in bf16: its update rounds to a few of bf16's steps times muon_lr 8e-3
        torch.testing.assert_close(got, want, rtol=rtol, atol=max(atol, 8e-3 * 2 ** -5))


@pytest.mark.slow
@pytest.mark.parametrize("injection", ["diagonal", "none"])
def test_compiled_regions_equal_eager(injection):
    """dynamo's graphs and autograd's compiled backward (aot_eager), in float32: loss, gradients, one step."""
    assert_compiled_equals_eager(*small_pair(injection), autocast=False, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # inductor generates and builds C++ for each region
@beforehand(compile_cache)
def test_inductor_regions_equal_eager_in_bf16():
    """Inductor's kernels, the fused loss reading bf16 logits among them: within bf16's rounding.
    float32's numerics are the aot_eager test's above."""
    eager, compiled = small_pair(backend="inductor")
    assert_compiled_equals_eager(eager, compiled, True, 2e-2, 2e-3)


def counting_backend(calls):
    """dynamo's eager backend, counting each call of each compiled graph."""
    def backend(graph, example_inputs):
        def run(*args):
            calls.append(graph)
            return graph.forward(*args)
        return run
    return backend


@pytest.mark.slow
@pytest.mark.parametrize("injection", ["diagonal", "none"])
def test_a_step_calls_its_regions_and_new_depths_never_recompile_after_warm_up(injection):
    """Per sequence, the loop step runs on the rows still looping: a dynamic row count, one row included.
    The warm-up steps never step one row with gradient; the later ones do, and at new depths."""
    torch.manual_seed(0)
    model = Parcae(ParcaeConfig.from_depth(3, injection=injection, **SMALL))
    calls = []
    model.compile_regions(backend=counting_backend(calls))
    x = torch.randint(0, 257, (4, 16))

    def step(T):
        calls.clear()
        n, k = split_depths(torch.tensor(T), model.config.mu_bwd, training=True)
        model(x, x, depths=(n, k), h0_generator=torch.Generator().manual_seed(0)).backward()
        loop_steps = int(n.max() + k.max()) if model.injection is not None else 1
        assert len(calls) == 1 + loop_steps + 1  # the prelude, each loop step, the coda with the loss

    for T in ([5, 4, 3, 3], [6, 2, 2, 2]):  # warm-up
        step(T)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 3 <= graphs <= 8  # each region's own, within dynamo's recompile limit of 8
    for T in ([4, 1, 1, 1], [3, 3, 2, 1], [7, 7, 7, 7], [1, 1, 1, 1], [9, 5, 1, 1]):
        step(T)
    generator = torch.Generator()
    for seed in range(4):  # the sampler's draws
        model(x, x, depth_generator=generator.manual_seed(seed),
              h0_generator=torch.Generator().manual_seed(seed)).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.slow
def test_evals_and_decoding_run_on_a_compiled_model():
    """evaluate_bpb compiles graphs of its own and training after it none; decoding runs eagerly, the same tokens."""
    eager, compiled = small_pair(backend="eager")
    x = torch.randint(0, 257, (4, 16))
    for model in (eager, compiled):
        for T in ([5, 4, 3, 3], [6, 2, 2, 1]):
            train_step(model, x, split_depths(torch.tensor(T), 2, training=True))
    trained = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    tokenizer = SimpleNamespace(token_bytes=torch.ones(257, dtype=torch.long))
    batches = [(x, x)]
    for T in (1, 3, 6):
        got, want = (evaluate_bpb(model, tokenizer, batches, T) for model in (compiled, eager))
        assert got == pytest.approx(want)
    evals = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert evals > trained
    train_step(compiled, x, split_depths(torch.tensor([3, 2, 2, 1]), 2, training=True))
    compiled.eval(), eager.eval()
    for T in (2, "auto"):
        generators = [[torch.Generator().manual_seed(i) for i in range(2)] for _ in range(2)]
        samples = [[ids.tolist() for ids, _ in generate(model, [[5, 6, 7]] * 2, 5, T=T, top_k=20, generator=rows)]
                   for model, rows in zip((eager, compiled), generators)]
        assert samples[0] == samples[1]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == evals


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
    raw.compile_regions(backend=eager_backend)
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
                loss = model(x, y, depth_generator=depth_generator, h0_generator=depth_generator)
                (loss / GRAD_ACCUM).backward()
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


def graph_counts(out):
    """{(world, rank): what count_graphs wrote} for one plain process and two DDP processes."""
    # the plain process and the DDP pair share nothing: they run side by side, each process one thread, each forked
    # from the server conftest started, which has imported torch
    jobs = [mp.start_processes(count_graphs, args=(world, free_port(), str(out)), nprocs=world, join=False,
                               start_method="forkserver") for world in (1, 2)]
    for job in jobs:
        while not job.join():
            pass
    return {(world, rank): json.loads((out / f"{world}_{rank}.json").read_text())
            for world in (1, 2) for rank in range(world)}


@pytest.fixture
def counts():
    return awaited(graph_counts)


@pytest.mark.slow  # compiles, and starts two processes
@beforehand(graph_counts)
def test_no_recompile_limit_and_evals_compiled_and_core_eager(counts):
    for result in counts.values():
        assert result["limit_hits"] == [], result
        graphs = result["graphs"]  # phase -> [dynamo's unique_graphs, graphs the backend compiled]
        assert graphs["evals"][0] > graphs["training"][0] > 0, graphs  # the evals' no-grad graphs: compiled
        assert graphs["core"] == graphs["evals"], graphs  # CORE's shapes compiled nothing


@pytest.mark.slow
@beforehand(graph_counts)
def test_ddp_compiles_the_graphs_of_one_process(counts):
    assert counts[2, 0]["graphs"] == counts[2, 1]["graphs"] == counts[1, 0]["graphs"]

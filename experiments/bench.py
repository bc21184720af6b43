"""
bench.py: nanoparcae's performance figures, measured side by side on whatever machine runs it.

    python -m experiments.bench                        # every row; a small model on CPU, the 140M model on CUDA
    python -m experiments.bench --rows 1,8 --steps 1   # a quick look at two rows
    python -m experiments.bench --depth 6 --d_model 384 --seq_len 512
    python -m experiments.bench --json bench.json      # also the rows and the raw figures behind their verdicts
    python -m experiments.bench --rows 9 --seq_len 256 --batch_size 2 --vocab_size 4096   # the compiled step

It prints ONE markdown table (progress goes to stderr), the one docs/performance.md quotes.
Each speed figure is a ratio of two things timed in the same run.
Their repeats interleave, so the noise of a shared machine falls on both.
Each figure is the median of --repeats repeats after a warm-up.
Training steps run forward, backward, gradient clip and optimiser step (optim.build_optimizer).
They run on fixed batches of random tokens.
The depths of every step are drawn up front (model.sample_depths) and replayed as forward's depths.
So both sides of a comparison run exactly the same depths.
Row 9 compiles them as train.py does (compile_step).
Every FLOP/s figure counts the matmul FLOPs executed (Parcae.matmul_flops_per_token).
The paper's C (Parcae.paper_flops_per_token) is for budgets only.
"""

import os
import random
import string
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nanoparcae.checkpoint import digest_of, entry_digests, load_run
from nanoparcae.command import comma_list, command_parser, run_command, size, positive
from nanoparcae.files import write_json
from nanoparcae.ranks import peak_bf16_flops
from nanoparcae.core_tasks import MC, Task
from data import DataLoader, bf16_autocast
from nanoparcae.dataset import iter_documents
from experiments.report import cpu_name
from engine import DRAFT_LENGTH, Draft, auto_draft, generate
from eval_core import evaluate_task
from experiments.decoding import decoding_rows, stdlib_tokens
from experiments.timing import log, median_seconds, print_table, timed
from model import (Parcae, ParcaeConfig, evaluation_initial_state, from_weights, initial_state, sample_depths,
                   split_depths)
from optim import build_optimizer, optimizer_state_bytes
from nanoparcae.tokenizer import Tokenizer

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Defaults: a small model on CPU (minutes on two cores), the 140M model (METHOD.md §1, depth 6) on CUDA
CPU_SIZES = dict(depth=3, d_model=128, head_dim=64, vocab_size=4096, seq_len=128, batch_size=8, steps=2)
CUDA_SIZES = dict(depth=6, d_model=None, head_dim=128, vocab_size=32768, seq_len=2048, batch_size=16, steps=3)
# Row 7 compiles on CPU at a tiny size: inductor's C++ compile grows with the blocks
CPU_COMPILE_SIZES, CPU_COMPILE_BATCH = dict(depth=3, d_model=64, head_dim=32, vocab_size=512, seq_len=64), 4
COMPILE_STEPS, COMPILE_CHUNK = 50, 10
MICRO_BATCHES = (4, 8, 16, 32)
PAPER_MICRO_BATCH = 32  # row 3b: the sequences per device of the paper's runs
TRAINING_MODELS = {"per-sequence": {}, "per-batch": {"sampling": "per_batch_split"},
                   "Transformer": {"injection": "none"}}
DECODE_PROMPT = 16  # row 5: tokens of prompt before the decoded ones


def si(value, unit=""):
    """A rate in SI prefixes: 3.1 Mtok/s, 45 TFLOP/s; bytes go through common.size."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()

# -----------------------------------------------------------------------------
# Models, training steps, and what a step costs

def model_config(args, **overrides):
    sizes = {"d_model": args.d_model} if args.d_model else {}
    return ParcaeConfig.from_depth(args.depth, vocab_size=args.vocab_size, seq_len=args.seq_len,
                                   head_dim=args.head_dim, mu_rec=args.mu_rec, **{**sizes, **overrides})


def model_loss(model, x, y, depths, generator):
    return model(x, y, depths=depths, h0_generator=generator)


def masked_reference_loss(model, x, y, depths, generator):
    """Run per-sequence depths the way the paper does (METHOD.md §2).
    The whole batch steps max(n) times without grad and max(k) times with it.
    torch.where keeps the state of a sequence whose count is used up.
    Row 8 measures model.py's loop against this reference, loss and gradients alike."""
    Bbar_e, ves, cos, sin = model.run_prelude(x)
    n, k = model.loop_depths(x.size(0), depths=depths)
    h = initial_state(Bbar_e.shape, Bbar_e.device, generator).to(Bbar_e.dtype)
    A_bar, n_max = model.injection.A_bar(), int(n.max())
    for step in range(n_max + int(k.max())):
        active = n > step if step < n_max else k > step - n_max
        with torch.set_grad_enabled(step >= n_max):
            stepped = model.loop_step(h, Bbar_e, A_bar, step, ves, cos, sin)
            h = torch.where(active.to(h.device)[:, None, None], stepped, h)
    logits = model.run_coda(h, ves, cos, sin)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-1)


class Trainer:
    """A model, its optimiser as train.py builds it, and one fixed batch of random tokens.
    Its h0 generator, seeded like the rest, serves every step."""

    def __init__(self, config, batch_size, device, seed=0):
        torch.manual_seed(seed)
        self.model = Parcae(config).to(device).train()
        self.optimizer = build_optimizer(self.model, adamw_lr=8e-3)
        tokens = torch.randint(0, config.vocab_size, (batch_size, config.seq_len + 1),
                               generator=torch.Generator().manual_seed(seed))
        self.x, self.y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        self.h0_generator = torch.Generator(device).manual_seed(seed)

    def run(self, schedule, loss_fn=model_loss):
        """One training step per entry of schedule: an (n, k) draw each (model.sample_depths)."""
        for depths in schedule:
            with bf16_autocast(DEVICE):
                loss = loss_fn(self.model, self.x, self.y, depths, self.h0_generator)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def depth_schedule(config, batch_size, num_steps, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [sample_depths(config, batch_size, generator) for _ in range(num_steps)]


def sampled_flops_per_token(config, schedule):
    """Count the executed matmul FLOPs per token at the depths the schedule sampled.
    The count is linear in the steps without and with gradient.
    So at the mean sampled n_i and k_i it counts exactly the passes sampled, not those a masked batch wastes.
    The Transformer's count does not depend on depth."""
    n, k = (torch.cat(steps).double() for steps in zip(*schedule))
    with torch.device("meta"):
        return Parcae(config).matmul_flops_per_token(n, k)


class PassCounter:
    """Count executed recurrent passes, one per sequence per run of the recurrent block.
    It divides the tokens the block's first layer sees by seq_len.
    So a step run on a subset of the batch counts that subset only."""

    def __init__(self, model):
        self.model, self.tokens = model, 0

    def __enter__(self):
        self.handle = self.model.recur[0].register_forward_pre_hook(self._count)
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def _count(self, module, args):
        self.tokens += args[0].numel() // args[0].size(-1)

    @property
    def passes(self):
        return self.tokens / self.model.config.seq_len

# -----------------------------------------------------------------------------
# Shared measurement (rows 1, 2, 3, 6): Parcae per-sequence and per-batch against the Transformer

def measure_training(args, device, batch_size, names=tuple(TRAINING_MODELS)):
    """{name: (tokens/s, executed matmul FLOP/s, mean sampled T)} for the models of TRAINING_MODELS named, timed
    in turn; about --steps x --batch_size sequences per repeat, in micro-batches of batch_size."""
    num_steps = max(1, args.steps * args.batch_size // batch_size)
    configs = {name: model_config(args, **TRAINING_MODELS[name]) for name in names}
    trainers = {name: Trainer(config, batch_size, device) for name, config in configs.items()}
    schedules = {name: depth_schedule(config, batch_size, num_steps) for name, config in configs.items()}
    log(f"training throughput, {', '.join(names)}: {args.repeats} repeats of {num_steps} steps x {batch_size} x "
        f"{args.seq_len}")
    seconds = median_seconds({name: (lambda t=t, s=schedules[name]: t.run(s)) for name, t in trainers.items()},
                             args.repeats)
    tokens = num_steps * batch_size * args.seq_len
    results = {}
    for name, config in configs.items():
        executed = sampled_flops_per_token(config, schedules[name]) * tokens / seconds[name]
        mean_T = sum(int(n.sum() + k.sum()) for n, k in schedules[name]) / (num_steps * batch_size)
        results[name] = (tokens / seconds[name], executed, mean_T)
    return results


def matmul_rate(args, device, shapes):
    """Time (batch x seq_len, k) @ (k, n) at each (k, n) of shapes -> FLOP/s, in the step's dtype."""
    rows, dtype = args.batch_size * args.seq_len, torch.bfloat16 if CUDA else torch.float32
    pairs = [(torch.randn(rows, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype))
             for k, n in shapes]
    flops = sum(2 * a.size(0) * a.size(1) * b.size(1) for a, b in pairs)
    seconds = median_seconds({"mm": lambda: [a @ b for a, b in pairs]}, args.repeats)["mm"]
    return flops / seconds

# -----------------------------------------------------------------------------
# The rows: each returns table rows (number, what, figures, ratio, target), and puts the raw numbers behind
# its verdicts into `figures` (what --json writes for runs/gpu_check.sh)

def row_throughput(args, device, training, figures):
    parcae, gpt = training["per-sequence"], training["Transformer"]
    ratio = figures["flops_ratio"] = parcae[1] / gpt[1]
    return [("1", f"training throughput: Parcae (mu_rec {args.mu_rec}, per-sequence) vs the Transformer of the "
             "same depth; matmul FLOPs executed at the depths sampled",
             f"Parcae {si(parcae[0], 'tok/s')}, {si(parcae[1], 'FLOP/s')} (mean T {parcae[2]:.2f}); "
             f"Transformer {si(gpt[0], 'tok/s')}, {si(gpt[1], 'FLOP/s')}",
             f"FLOP/s {ratio:.2f}x (tok/s {parcae[0] / gpt[0]:.2f}x)",
             f">= 0.90: {'met' if ratio >= 0.9 else 'not met'}")]


def row_mfu(args, device, training, figures):
    """Row 2: MFU against the matmul rate measured here at the model's own shapes.
    A training step could reach that rate at best.
    Where common.PEAK_BF16_FLOPS lists the GPU, MFU against its dense bf16 peak too."""
    d = args.d_model  # the model's own matmuls: q/k/v/out, MLP up and down, the head
    rate = figures["matmul_rate"] = matmul_rate(args, device, ((d, d), (d, 4 * d), (4 * d, d), (d, args.vocab_size)))
    peak = peak_bf16_flops(device)
    parcae, gpt = training["per-sequence"][1], training["Transformer"][1]
    figures["mfu"] = parcae / rate
    what = f"the {'bf16' if CUDA else 'float32'} matmul rate measured at the model's shapes"
    measured = f"Parcae {parcae / rate:.1%}, Transformer {gpt / rate:.1%}"
    if peak is None:
        return [("2", f"achieved FLOP/s (matmul FLOPs executed) against {what}", si(rate, "FLOP/s"), measured, "")]
    return [("2", f"achieved FLOP/s (matmul FLOPs executed) against {what}, and against the GPU's listed bf16 peak",
             f"measured {si(rate, 'FLOP/s')}, listed peak {si(peak, 'FLOP/s')}",
             f"{measured}; of the peak: Parcae {parcae / peak:.1%}, Transformer {gpt / peak:.1%}", "")]


def row_sampling(args, device, training, figures):
    """3a at --batch_size sequences per micro-batch, from the shared measurement; 3b at the paper's 32, timed here
    (the overhead depends on how many sequences share a step's matmuls). figures["sampling_overhead"] is 3b's."""
    sizes = [("3a", args.batch_size)] if args.batch_size != PAPER_MICRO_BATCH else []
    rows = []
    for number, batch_size in sizes + [("3b", PAPER_MICRO_BATCH)]:
        models = training if batch_size == args.batch_size else \
            measure_training(args, device, batch_size, ("per-sequence", "per-batch"))
        per_seq, per_batch = models["per-sequence"], models["per-batch"]
        overhead = figures["sampling_overhead"] = per_batch[1] / per_seq[1] - 1
        rows.append((number, f"per-sequence vs per-batch depth sampling (per_batch_split: the same depths, one per "
                     f"micro-batch), mu_rec {args.mu_rec}, {batch_size} sequences per micro-batch: time per FLOP "
                     "(matmul FLOPs executed)",
                     f"per-sequence {si(per_seq[1], 'FLOP/s')} ({si(per_seq[0], 'tok/s')}, mean T {per_seq[2]:.2f}); "
                     f"per-batch {si(per_batch[1], 'FLOP/s')} ({si(per_batch[0], 'tok/s')}, "
                     f"mean T {per_batch[2]:.2f})", f"overhead {overhead:+.1%}", "paper: +1.8%"))
    return rows


def row_memory(args, device, training, figures):
    """Bytes saved for backward (parameters excluded), counted at every save; peak CUDA memory where present."""
    config = model_config(args, mu_bwd=4)
    torch.manual_seed(0)
    model = Parcae(config).to(device).train()
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    x = torch.randint(0, config.vocab_size, (args.batch_size, config.seq_len), device=device)
    generator = torch.Generator(device).manual_seed(0)
    saved, peaks = {}, {}
    for T in (8, 16, 32):
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in param_storages:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        if CUDA:
            torch.cuda.reset_peak_memory_stats(device)
            baseline = torch.cuda.memory_allocated(device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), bf16_autocast(DEVICE):
            loss = model(x, x, T=T, h0_generator=generator)
        loss.backward()
        model.zero_grad(set_to_none=True)
        saved[T] = sum(storages.values())
        if CUDA:
            peaks[T] = torch.cuda.max_memory_allocated(device) - baseline
    spread = max(saved.values()) / min(saved.values())
    result = ", ".join(f"T={T}: {size(b)}" for T, b in saved.items())
    if peaks:
        result += "; peak CUDA " + ", ".join(f"T={T}: {size(b)}" for T, b in peaks.items())
        spread = max(spread, max(peaks.values()) / min(peaks.values()))
    return [("4", f"memory saved for backward, mu_bwd 4 (saved-tensor hooks, exact{', and peak CUDA' if CUDA else ''})",
             result, f"max/min {spread:.2f}x", f"flat within 10%: {'met' if spread <= 1.10 else 'not met'}")]


def row_decode(args, device, training, figures):
    """Row 5 on a trained checkpoint (--ckpt, else the newest) and the stdlib's text.
    Without a checkpoint it uses an untrained model of the bench's size and random tokens."""
    try:
        ckpt, tokenizer, path = load_run(ckpt=args.ckpt)
        model = from_weights(ckpt["config"], ckpt["model"], device)
        ids = stdlib_tokens(tokenizer, DECODE_PROMPT + args.new_tokens, device)
        where = f"checkpoint {path.parent.name}/{path.name}"
    except (FileNotFoundError, ValueError):
        if args.ckpt:
            raise
        torch.manual_seed(0)
        model = Parcae(model_config(args)).to(device).eval()
        ids = torch.randint(0, model.config.vocab_size, (1, DECODE_PROMPT + args.new_tokens), device=device)
        where = "an untrained model (no checkpoint found)"
    log(f"decoding with {where}")
    with bf16_autocast(DEVICE):
        rows = decoding_rows(model, ids, DECODE_PROMPT, repeats=args.repeats)
    return [(number, f"{what}, {where}", *rest) for number, what, *rest in rows]


def synthetic_task(num_items, seed=0):
    """A multiple-choice task in memory: random words, 4 choices, 2 shots (CORE's prompts are few-shot)."""
    rng = random.Random(seed)

    def words(n):
        return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(n))

    data = [{"query": words(25), "choices": [words(rng.randint(2, 6)) for _ in range(4)], "gold": 0}
            for _ in range(num_items)]
    return Task("synthetic", "", MC, 2, " "), data


def row_core_and_loader(args, device, training, figures):
    log("CORE scoring and the loader: training a 1024-token tokenizer on 1M characters of the stdlib")
    tokenizer = Tokenizer.train(iter_documents("stdlib", "train"), 1024, max_chars=1_000_000)
    config = model_config(args)
    torch.manual_seed(0)
    model = Parcae(config).to(device).eval()
    task, data = synthetic_task(256 if CUDA else 32)
    h0_table = evaluation_initial_state(model.config.d_model, config.seq_len, 0, device)
    seconds = median_seconds({
        name: lambda one=one: evaluate_task(model, tokenizer, task, data, config.mu_rec, 1234, h0_table,
                                            one_per_forward=one)
        for name, one in (("batched", False), ("one", True))}, args.repeats)
    batched, one = len(data) / seconds["batched"], len(data) / seconds["one"]

    loader = DataLoader(tokenizer, "stdlib", "train", args.batch_size, args.seq_len)
    next(loader)  # the first batch waits for the first ~1000 documents to be tokenized
    batches = 20
    loader_rate = batches * args.batch_size * args.seq_len / median_seconds(
        {"loader": lambda: [next(loader) for _ in range(batches)]}, args.repeats)["loader"]
    loader.close()
    train_rate = training["per-sequence"][0]
    return [("6a", f"CORE scoring, T={config.mu_rec} ({len(data)} 4-choice 2-shot items, eval_core.evaluate_task): "
             "batched vs one example per forward", f"batched {batched:.1f} ex/s; one per forward {one:.1f} ex/s",
             f"{batched / one:.2f}x", ""),
            ("6b", f"loader (data.DataLoader, stdlib, {args.batch_size} x {args.seq_len}) vs Parcae training",
             f"loader {si(loader_rate, 'tok/s')}; training {si(train_rate, 'tok/s')}",
             f"{loader_rate / train_rate:.1f}x headroom", "> 1")]


def row_compile(args, device, training, figures):
    """Row 7: model.compile_regions(), as train.py calls it, against eager.
    It runs 50 steps of per-sequence depths and counts dynamo's graphs after every 10 steps.
    The loop step's row count goes dynamic once, so a few early recompilations are by design.
    Later ones are not."""
    if CUDA:
        config, batch_size = model_config(args), args.batch_size
    else:
        config, batch_size = ParcaeConfig.from_depth(**CPU_COMPILE_SIZES, mu_rec=args.mu_rec), CPU_COMPILE_BATCH
    from torch._dynamo.utils import counters as dynamo_counters  # only this row needs dynamo, slow to import
    schedule = depth_schedule(config, batch_size, COMPILE_STEPS + 1)
    eager, compiled = Trainer(config, batch_size, device), Trainer(config, batch_size, device)
    compiled.model.compile_regions(backend=args.compile_backend)
    log(f"torch.compile: compiling the regions (d_model {config.d_model}, {batch_size} x {config.seq_len})")
    compile_seconds = timed(lambda: compiled.run(schedule[:1]))
    eager.run(schedule[:1])
    graphs = [dynamo_counters["stats"]["unique_graphs"]]
    chunks = [schedule[1 + i:1 + i + COMPILE_CHUNK] for i in range(0, COMPILE_STEPS, COMPILE_CHUNK)]
    pending = {"compiled": iter(chunks), "eager": iter(chunks)}

    def run_compiled():
        compiled.run(next(pending["compiled"]))
        graphs.append(dynamo_counters["stats"]["unique_graphs"])

    seconds = median_seconds({"compiled": run_compiled, "eager": lambda: eager.run(next(pending["eager"]))},
                             repeats=len(chunks), warmup=0)
    per_chunk = [after - before for before, after in zip(graphs, graphs[1:])]
    rates = {name: COMPILE_CHUNK / s for name, s in seconds.items()}
    settled = sum(per_chunk[1:]) == 0
    backend = "" if args.compile_backend == "inductor" else f", backend {args.compile_backend}"
    return [("7", f"torch.compile (compile_regions{backend}, d_model {config.d_model}, {batch_size} x "
             f"{config.seq_len}): steps/s compiled vs eager; recompilations over {COMPILE_STEPS} steps of changing "
             "depths",
             f"compiled {rates['compiled']:.2f} steps/s, eager {rates['eager']:.2f} steps/s; first step "
             f"{compile_seconds:.0f} s, {graphs[0]} graphs for its regions; "
             f"then {sum(per_chunk)} recompilations "
             f"(per {COMPILE_CHUNK} steps: {', '.join(map(str, per_chunk))})",
             f"{rates['compiled'] / rates['eager']:.2f}x",
             f"none after step {COMPILE_CHUNK + 1}: {'met' if settled else 'not met'}")]


def row_active_only(args, device, training, figures):
    """Executed recurrent passes per sampled pass, and tokens/s, of model.py's recurrence against
    the masked reference, at the same sampled depths; each size runs about steps x batch_size sequences."""
    config = model_config(args)
    rows = []
    for batch_size in MICRO_BATCHES:
        num_steps = max(1, args.steps * args.batch_size // batch_size)
        trainer = Trainer(config, batch_size, device)
        schedule = depth_schedule(config, batch_size, num_steps)
        sampled = sum(int(n.sum() + k.sum()) for n, k in schedule)
        log(f"active-only recurrence: {num_steps} steps x {batch_size} sequences")
        with PassCounter(trainer.model) as ours:
            trainer.run(schedule)
        with PassCounter(trainer.model) as masked:
            trainer.run(schedule, masked_reference_loss)
        seconds = median_seconds({"ours": lambda: trainer.run(schedule),
                                  "masked": lambda: trainer.run(schedule, masked_reference_loss)},
                                 args.repeats, warmup=0)
        tokens = num_steps * batch_size * config.seq_len
        ours_rate, masked_rate = tokens / seconds["ours"], tokens / seconds["masked"]
        executed = ours.passes / sampled
        rows.append((f"8{'abcd'[len(rows)]}", f"recurrence of model.py vs the masked reference, {batch_size} "
                     f"sequences per micro-batch ({num_steps} steps, {sampled} sampled passes): executed per "
                     "sampled pass; training tok/s",
                     f"model.py {executed:.2f} ({si(ours_rate, 'tok/s')}); masked {masked.passes / sampled:.2f} "
                     f"({si(masked_rate, 'tok/s')})", f"tok/s {ours_rate / masked_rate:.2f}x",
                     f"executed <= 1.05: {'met' if executed <= 1.05 else 'not met'}"))
        del trainer
    return rows


# -----------------------------------------------------------------------------
# Row 9: the step train.py runs, compiled as train.py compiles it, for Parcae per-sequence, Parcae at fixed
# depths and the Transformer: tokens/s, MFU, peak memory, and where the time goes (torch.profiler)

def compile_step(trainer, backend):
    """train.py's compile entry point, applied to a Trainer: the model's regions and the optimiser's updates."""
    trainer.model.compile_regions(backend=backend)
    trainer.optimizer.compile(backend=backend)


def fixed_schedule(config, batch_size, num_steps):
    """Every sequence at the mean depths, (mu_rec - mu_bwd, mu_bwd): the fixed-depth draw of each step."""
    n, k = split_depths(torch.full((batch_size,), config.mu_rec), config.mu_bwd, training=True)
    return [(n, k)] * num_steps


STEP_MODELS = {"Parcae per-sequence": ({}, depth_schedule), "Parcae fixed depth": ({}, fixed_schedule),
               "Transformer": ({"injection": "none"}, depth_schedule)}


def peak_memory(fn, device):
    """Bytes allocated at fn()'s peak over those allocated before it; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - baseline


def busy_time(intervals):
    """The length of the union of (start, end) intervals."""
    total, end = 0.0, -float("inf")
    for start, stop in sorted(intervals):
        total += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total


def profile_steps(fn, num_steps, device):
    """Profile num_steps calls of fn -> (launches per step, the device's idle share).
    On CUDA it counts kernels and copies, and the idle time outside all of them.
    On a CPU it counts the operators dispatched outside any other operator, and no idle share.
    A compiled kernel's call counts as one operator."""
    from torch.profiler import DeviceType, ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall = timed(lambda: [fn() for _ in range(num_steps)])
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        busy = busy_time([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e6
        return len(kernels) / num_steps, max(0.0, 1 - busy / wall)

    def outermost(event):
        parent = event.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        return parent is None
    ops = [e for e in events if e.name.startswith("aten::") and outermost(e)]
    return len(ops) / num_steps, None


def row_step(args, device, training, figures):
    """Row 9: each model's own Trainer, compiled by compile_step, warmed up (its graphs built), then the three
    timed in turn; memory and the profile one model at a time. Fixed depth against per-sequence is time per
    FLOP (matmul FLOPs executed), as row 3: the two sample different mean depths."""
    rate = matmul_rate(args, device, [(args.d_model, 4 * args.d_model)])  # the MLP's up-projection
    peak = peak_bf16_flops(device)
    tokens = args.steps * args.batch_size * args.seq_len
    models = {}
    for name, (overrides, schedule_fn) in STEP_MODELS.items():
        config = model_config(args, **overrides)
        trainer = Trainer(config, args.batch_size, device)
        compile_step(trainer, args.compile_backend)
        schedule = schedule_fn(config, args.batch_size, args.steps)
        log(f"the step, {name}: compiling and warming up")
        trainer.run(schedule)
        memory = peak_memory(lambda: trainer.run(schedule[:1]), device)
        kernels, idle = profile_steps(lambda: trainer.run(schedule[:1]), args.steps, device)
        models[name] = dict(trainer=trainer, schedule=schedule, memory=memory, kernels=kernels, idle=idle,
                            flops_per_token=sampled_flops_per_token(config, schedule))
    seconds = median_seconds({name: (lambda m=m: m["trainer"].run(m["schedule"])) for name, m in models.items()},
                             args.repeats, warmup=0)
    results = {}
    for name, m in models.items():
        flops = m["flops_per_token"] * tokens / seconds[name]
        results[name] = dict(tokens_per_s=tokens / seconds[name], flops=flops, mfu_measured=flops / rate,
                             mfu_listed=flops / peak if peak else None, peak_memory=m["memory"],
                             kernels_per_step=m["kernels"], idle=m["idle"])
    per_seq, fixed, gpt = (results[name] for name in STEP_MODELS)
    overhead = fixed["flops"] / per_seq["flops"] - 1
    figures["step"] = dict(results, matmul_rate=rate, listed_peak=peak, overhead=overhead)
    what = f"the {'bf16' if CUDA else 'float32'} matmul rate at the MLP's shape"
    autocast = "bf16 autocast, " if CUDA else ""
    rows = [("9", f"the step train.py runs (compile_step, backend {args.compile_backend}; {autocast}clip, MuonAdamW), "
             f"{args.batch_size} x {args.seq_len} tokens: MFU of the matmul FLOPs executed against {what}"
             + (" and the listed bf16 peak" if peak else ""),
             f"measured {si(rate, 'FLOP/s')}" + (f", listed peak {si(peak, 'FLOP/s')}" if peak else ""), "", "")]
    targets = {"Parcae per-sequence": 0.45, "Transformer": 0.46}
    for (name, r), letter in zip(results.items(), "abc"):
        mfu = f"MFU {r['mfu_measured']:.1%} of measured" + (f", {r['mfu_listed']:.1%} of listed" if peak else "")
        memory = f"peak {size(r['peak_memory'])}" if r["peak_memory"] is not None else "peak memory: no GPU"
        launches = (f"{r['kernels_per_step']:.0f} kernels per step, GPU idle {r['idle']:.0%}" if CUDA else
                    f"{r['kernels_per_step']:.0f} operators per step")
        ratio = (f"against fixed depth: time per FLOP {overhead:+.1%}, tok/s "
                 f"{r['tokens_per_s'] / fixed['tokens_per_s']:.2f}x" if r is per_seq else "")
        target = (f">= {targets[name]:.0%} of listed: {'met' if r['mfu_listed'] >= targets[name] else 'not met'}"
                  if peak and name in targets else "")
        rows.append((f"9{letter}", f"{name}: tok/s, MFU, peak memory, launches",
                     f"{si(r['tokens_per_s'], 'tok/s')}, {mfu}; {memory}; {launches}", ratio, target))
    return rows


def row_digest(args, device, training, figures):
    """Row 10: a checkpoint's digest (checkpoint.entry_digests), checked on every load, against torch.save and
    torch.load of the same file, in a temporary folder (torch.load reads it from the page cache). The weights are
    the bench's model's; the optimizer's state is a stand-in of optim.optimizer_state_bytes's size."""
    with torch.device("meta"):
        model = Parcae(model_config(args))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.normal_()
    moments = torch.randn(optimizer_state_bytes(model) // 4)
    state = {"model": model.state_dict(), "optimizer": {"state": {0: {"moments": moments}}}}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ckpt_000001.pt"
        torch.save(state, path)
        loaded = torch.load(path, weights_only=True)
        seconds = median_seconds({
            "save": lambda: torch.save(state, path),
            "load": lambda: torch.load(path, weights_only=True),
            "digest_weights": lambda: entry_digests(loaded, ["model"]),
            "digest_all": lambda: digest_of(loaded),
        }, args.repeats)
        weights, whole = sum(t.nbytes for t in state["model"].values()), path.stat().st_size
    figures["digest"] = {**seconds, "weights_bytes": weights, "checkpoint_bytes": whole}
    weights_s, all_s = seconds["digest_weights"], seconds["digest_all"]
    return [("10", f"checkpoint digest (sha256 on {min(8, os.cpu_count() or 1)} threads), model {size(weights)}"
                  f", checkpoint {size(whole)}",
             f"weights {weights_s:.2f} s ({size(weights / weights_s)}/s); whole checkpoint {all_s:.2f} s; "
             f"torch.save {seconds['save']:.2f} s, torch.load {seconds['load']:.2f} s",
             f"the whole digest / torch.load {all_s / seconds['load']:.2f}x", "")]


def row_draft(args, device, training, figures):
    """Row 11: self-speculative decoding (engine.drafted) against plain decoding, greedy, each row's own prompt from
    the stdlib's text: tokens/s at T = mu_rec, 2 mu_rec, 32 and 64, 1 and 8 rows, with the share of drafts accepted
    and the tokens per verify pass. The draft is sample.py's --draft=auto (engine.auto_draft), else depth
    min(mu_rec - 1, T - 1) up to DRAFT_LENGTH long; engine.paced picks each pass's length or decodes plainly. On the
    trained checkpoint (--ckpt, else the newest run), then the 140M's shapes with random weights."""
    rows = []
    for name, (model, ids, new) in draft_models(args, device).items():
        for batch in (1, 8):
            cells, ratios = [], {}
            for T in sorted({model.config.mu_rec, 2 * model.config.mu_rec, 32, 64}):
                auto = auto_draft(model, T)
                draft = auto or Draft(max(1, min(model.config.mu_rec - 1, T - 1)), DRAFT_LENGTH)
                counts = {}

                def decode(draft=None, counts=None):
                    with bf16_autocast(DEVICE):
                        for _ in generate(model, ids[:batch], new, T, temperature=0, draft=draft, counts=counts):
                            pass
                seconds = median_seconds({"plain": decode, "drafted": lambda: decode(draft, counts)},
                                         args.repeats)
                ratio = seconds["plain"] / seconds["drafted"]
                ratios[T] = ratio if auto else 1.0  # where auto declines, sample.py decodes plainly
                plain = counts.get("plain", 0) / (args.repeats + 1)  # the warm-up's, then each repeat's
                passes = max(1, counts.get("passes", 0)) / (args.repeats + 1)
                cells.append(f"T={T}: {batch * new / seconds['plain']:.1f} -> {batch * new / seconds['drafted']:.1f}"
                             f" tok/s ({ratio:.2f}x; drafts {draft.depth}x{draft.length}{'' if auto else ' forced'},"
                             f" {counts.get('agreed', 0) / max(1, counts.get('drafted', 0)):.0%} accepted,"
                             f" {(new - plain) / passes:.1f} tokens a pass, {plain:.0f} plain)")
            figures[f"draft_{name}_B{batch}"] = ratios
            goal = 3 if batch == 1 else 2
            target = "" if name.startswith("140M") else (
                f"T=32 >= {goal}x: {'met' if ratios[32] >= goal else 'not met'}; auto >= 0.95x at every T: "
                f"{'met' if min(ratios.values()) >= 0.95 else 'not met'}")
            rows.append(("11", f"self-speculative decoding vs plain, greedy, {new} tokens, {batch} row(s), {name} "
                         f"model: plain -> drafted (the ratio is sample.py's --draft=auto: 1.00x where it declines)",
                         "; ".join(cells), ", ".join(f"T={T} {r:.2f}x" for T, r in ratios.items()), target))
    return rows


def draft_models(args, device):
    """Row 11's models: {name: (model, 8 prompts of DECODE_PROMPT tokens, new tokens)}. The trained checkpoint
    decodes --new_tokens; the 140M's shapes (depth 6, random weights drawn at seed 0) an eighth of them."""
    models = {}
    try:
        ckpt, tokenizer, path = load_run(ckpt=args.ckpt)
        model = from_weights(ckpt["config"], ckpt["model"], device)
        prompts = stdlib_tokens(tokenizer, 8 * DECODE_PROMPT, device).view(8, DECODE_PROMPT)
        models[f"trained ({path.parent.name})"] = (model, prompts, args.new_tokens)
    except (FileNotFoundError, ValueError) as err:
        log(f"row 11 without a trained model: {err}")
    torch.manual_seed(0)
    config = ParcaeConfig.from_depth(6, vocab_size=32768, seq_len=2048, mu_rec=8)
    model = Parcae(config).to(device).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # random weights: the scaled-zero init would make every depth's text alike
        for p in model.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    prompts = torch.randint(0, config.vocab_size, (8, DECODE_PROMPT), generator=generator).to(device)
    models["140M-shaped random"] = (model, prompts, max(1, args.new_tokens // 8))
    return models


ROWS = {1: row_throughput, 2: row_mfu, 3: row_sampling, 4: row_memory, 5: row_decode, 6: row_core_and_loader,
        7: row_compile, 8: row_active_only, 9: row_step, 10: row_digest, 11: row_draft}
NEEDS_TRAINING = {1, 2, 3, 6}

# -----------------------------------------------------------------------------
# Command line

def device_name(device):
    """The GPU's name, or the CPU's with the threads torch uses."""
    if CUDA:
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def parse_rows(text):
    """--rows' value -> the row numbers, sorted; a number that is no row raises ValueError."""
    rows = comma_list(text)
    if not set(rows) <= set(ROWS):
        raise ValueError(f"--rows={text} takes numbers from 1 to {len(ROWS)}")
    return sorted(set(rows))


def main(argv=None):
    parser = command_parser(__doc__)
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="e.g. 1,3,8")
    parser.add_argument("--depth", type=positive(int), help="layers, a multiple of 3")
    parser.add_argument("--d_model", type=positive(int),
                        help="width (default: 128 on CPU, 128 * (depth/3 + 4) on CUDA)")
    parser.add_argument("--head_dim", type=positive(int))
    parser.add_argument("--vocab_size", type=positive(int))
    parser.add_argument("--seq_len", type=positive(int))
    parser.add_argument("--batch_size", type=positive(int), help="sequences per micro-batch")
    parser.add_argument("--steps", type=positive(int), help="training steps per timed repeat")
    parser.add_argument("--repeats", type=positive(int), default=5, help="timed repeats; each figure is their median")
    parser.add_argument("--mu_rec", type=positive(int), default=8)
    parser.add_argument("--ckpt", help="row 5's checkpoint (default: the newest, else an untrained model)")
    parser.add_argument("--new_tokens", type=positive(int), default=256, help="row 5: tokens decoded")
    parser.add_argument("--compile_backend", default="inductor", choices=["inductor", "eager"],
                        help="row 7's backend; eager: dynamo's tracing and guards without code generation")
    parser.add_argument("--json", help="also write the table and the raw figures behind its verdicts to this file")
    args = parser.parse_args(argv)
    args.rows = parse_rows(args.rows)
    width_from_depth = args.depth is not None  # --depth alone takes METHOD.md §1's width for that depth
    for name, value in (CUDA_SIZES if CUDA else CPU_SIZES).items():
        if getattr(args, name) is None and not (name == "d_model" and width_from_depth):
            setattr(args, name, value)
    config = model_config(args)
    args.d_model = config.d_model
    device = torch.device("cuda" if CUDA else "cpu")
    if CUDA:
        torch.backends.cuda.matmul.allow_tf32 = True

    sizes = (f"depth {args.depth} ({config.n_prelude}/{config.n_recur}/{config.n_coda}), d_model {config.d_model}, "
             f"vocab {config.vocab_size}, {args.batch_size} x {args.seq_len} tokens per step, mu_rec {config.mu_rec}, "
             f"mu_bwd {config.mu_bwd}")
    header = f"nanoparcae bench, torch {torch.__version__}: {sizes}; medians of {args.repeats} repeats after a warm-up"
    t0 = time.perf_counter()
    training = measure_training(args, device, args.batch_size) if NEEDS_TRAINING & set(args.rows) else None
    log(f"training measurement for rows 1, 2, 3, 6 took {time.perf_counter() - t0:.0f} s")
    table, figures = [], {}
    for row in args.rows:
        t0 = time.perf_counter()
        table += ROWS[row](args, device, training, figures)
        log(f"row {row} ({ROWS[row].__name__}) took {time.perf_counter() - t0:.0f} s")
        if args.json:  # after every row: a row that fails or runs out of time leaves the ones before it
            write_json(args.json, {"sizes": sizes, "device": device_name(device), "rows": table,
                                   "figures": figures})
    print(header + "\n")
    print_table(table, f"measured on {device_name(device)}")


if __name__ == "__main__":
    run_command(main)

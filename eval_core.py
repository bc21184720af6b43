"""
eval_core.py: evaluate a checkpoint (METHOD.md §3).
It scores CORE and Core-Extended, bits per byte, and the test-time scaling law L(T).

    python eval_core.py                                   # CORE of the latest checkpoint
    python eval_core.py --T 8 --max_per_task 50           # quicker: 50 examples per task
    python eval_core.py --tasks extended --seeds 1234,2345,3456   # Core-Extended, over 3 seeds
    python eval_core.py --eval bpb --T 1,2,4,8,16,32      # val loss and bpb at each T, fit L(T)
    python eval_core.py --eval ppl --T 1,4                # the paper's val PPL
    torchrun --nproc_per_node 8 eval_core.py --T 8        # examples striped across ranks

CORE is DCLM's 22-task ensemble, scored as nanochat scores it, from nanochat's task files.
They are downloaded on first use to $NANOPARCAE_BASE_DIR/eval_bundle.
Results print as a table and go to a JSON file beside the checkpoint.
Of the two validation losses, --eval bpb scores packed BOS-aligned rows, as training does.
--eval ppl scores one document per forward, as the authors do for the paper's val PPL.
"""

import itertools
import math
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanoparcae.checkpoint import load_run
from nanoparcae.command import command_parser, run_command, checked, listed, positive
from nanoparcae.ranks import init_distributed, parse_device, print0, rank_and_world
from nanoparcae.core_tasks import (CORE_LABELS, EXTENDED_TASKS, LM, build_rows, load_task_data,
                                   read_random_baselines, select_tasks)
from nanoparcae.download import EVAL_BUNDLE_URL, shared_eval_bundle
from data import bf16_autocast, evaluate_bpb, in_eval_mode, val_batches
from nanoparcae.dataset import data_key, iter_documents
from nanoparcae.results import check_results_folder, keep_results, refuse_non_finite, run_data
from model import evaluation_initial_state, from_weights

# -----------------------------------------------------------------------------
# Scoring token rows, many per forward (METHOD.md §3).
# Rows are grouped by length and padded on the right.
# One seeded h0 serves every row, and each gets its mean cross-entropy over its span.

def forward_batches(rows, batch_tokens, one_per_forward):
    """Split rows into forwards -> row indices, one list per forward, longest first.
    A forward holds the rows that fit batch_tokens (rows x width), or one item's rows alone."""
    if one_per_forward:
        by_example = defaultdict(list)
        for i, row in enumerate(rows):
            by_example[row.example].append(i)
        return list(by_example.values())
    batches, batch = [], []
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens)):
        # batch[0] is the longest, so it sets the width
        if batch and (len(batch) + 1) * len(rows[batch[0]].tokens) > batch_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + [batch] if batch else batches


@torch.no_grad()
def score_rows(model, rows, T, h0_table, batch_tokens=1024, one_per_forward=False):
    """Score each row -> its mean cross-entropy over its span, and whether greedy argmax matches it.
    It runs eagerly even under compiled blocks, since nearly every forward has a new shape."""
    with torch.compiler.set_stance("force_eager"):  # a decorator would import dynamo here
        device = h0_table.device
        losses, exact = [0.0] * len(rows), [False] * len(rows)
        for batch in forward_batches(rows, batch_tokens, one_per_forward):
            width = max(len(rows[i].tokens) for i in batch)
            # Pad with id 0 on the right, which causal attention never reads.
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for j, i in enumerate(batch):
                ids[j, :len(rows[i].tokens)] = torch.tensor(rows[i].tokens)
            ids = ids.to(device)
            with bf16_autocast(device):
                logits = model(ids, T=T, h0=h0_table[:, :width].expand(len(batch), -1, -1))
            pairs = [(logits[j, r.start - 1:r.end - 1], ids[j, r.start:r.end])  # predicted, targets
                     for j, r in enumerate(rows[i] for i in batch)]
            batch_losses = torch.stack([F.cross_entropy(p, t) for p, t in pairs]).tolist()
            batch_exact = torch.stack([(p.argmax(-1) == t).all() for p, t in pairs]).tolist()
            for i, loss, hit in zip(batch, batch_losses, batch_exact):
                losses[i], exact[i] = loss, hit
        return losses, exact


# -----------------------------------------------------------------------------
# CORE: accuracy per task, centered on the random baseline, then averaged

def centered_accuracy(accuracy, random_baseline):
    """Center an accuracy on chance (METHOD.md §3), so chance is 0 and perfect is 1."""
    return (accuracy - 0.01 * random_baseline) / (1.0 - 0.01 * random_baseline)


def evaluate_task(model, tokenizer, task, data, T, seed, h0_table, batch_tokens=1024,
                  one_per_forward=False):
    """Score a task's items -> its accuracy.
    Items are striped across ranks and summed, so any number of ranks agree."""
    rank, world = rank_and_world()
    rows = build_rows(task, data, range(rank, len(data), world), tokenizer, seed,
                      model.config.seq_len)
    losses, exact = score_rows(model, rows, T, h0_table, batch_tokens, one_per_forward)
    per_item = defaultdict(list)
    for row, loss, hit in zip(rows, losses, exact):
        per_item[row.example].append((loss, hit))
    correct = torch.zeros(len(data), dtype=torch.float64, device=h0_table.device)
    for idx, scores in per_item.items():
        if not all(math.isfinite(loss) for loss, _ in scores):  # no score: NaN, refused later
            correct[idx] = math.nan
        elif task.kind == LM:  # right when greedy decoding reproduces every continuation token
            correct[idx] = float(scores[0][1])
        else:  # the option with the lowest mean loss wins (the first one on a tie)
            option_losses = [loss for loss, _ in scores]
            correct[idx] = float(option_losses.index(min(option_losses)) == data[idx]["gold"])
    if world > 1:
        dist.all_reduce(correct)
    return correct.mean().item()


@in_eval_mode
def evaluate_core(model, tokenizer, bundle_dir, T=None, max_per_task=-1, tasks="core", seed=1234,
                  batch_tokens=None, one_per_forward=False):
    """Score CORE or Core-Extended at recurrence T, mu_rec by default -> a dict of results.
    It holds per-task accuracies, their means ("core", "core_extended") and the tasks skipped.
    The tasks are "core", "extended", labels separated by commas, or a list of Task."""
    t_start = time.time()
    device = next(model.parameters()).device
    # A GPU wants big batches; on a CPU a small batch's elementwise ops stay in cache.
    batch_tokens = batch_tokens or (16384 if device.type == "cuda" else 1024)
    baselines = read_random_baselines(bundle_dir)
    h0_table = evaluation_initial_state(model.config.d_model, model.config.seq_len, seed, device)
    accuracy, centered, skipped, items = {}, {}, {}, {}
    for task in select_tasks(tasks) if isinstance(tasks, str) else tasks:
        if not (Path(bundle_dir) / "eval_data" / task.path).is_file():
            skipped[task.label] = f"eval_data/{task.path} is not in the bundle"
        elif task.label not in baselines:
            skipped[task.label] = "no random baseline in eval_meta_data.csv"
        if task.label in skipped:
            print0(f"{task.label:<34} skipped: {skipped[task.label]}")
            continue
        t0 = time.time()
        data = load_task_data(bundle_dir, task, max_per_task)
        items[task.label] = len(data)
        accuracy[task.label] = evaluate_task(model, tokenizer, task, data, T, seed, h0_table,
                                             batch_tokens, one_per_forward)
        centered[task.label] = centered_accuracy(accuracy[task.label], baselines[task.label])
        print0(f"{task.label:<34} {task.shots:>2}-shot {task.kind:<17} {len(data):>6} items  "
               f"accuracy {accuracy[task.label]:.4f}  centered {centered[task.label]:+.4f}  "
               f"{time.time() - t0:6.1f}s")
    core = [c for label, c in centered.items() if label in CORE_LABELS]
    extended_ran = any(label not in CORE_LABELS for label in centered)
    return {"T": T if T is not None else model.config.mu_rec, "seed": seed,
            "max_per_task": max_per_task, "items": items, "accuracy": accuracy,
            "centered": centered, "core": sum(core) / len(core) if core else None,
            "core_extended": sum(centered.values()) / len(centered) if extended_ran else None,
            "skipped": skipped, "seconds": time.time() - t_start}

# -----------------------------------------------------------------------------
# The paper's val PPL, and the test-time scaling law L(T) = L_inf + Z exp(-z T)

@torch.no_grad()
@in_eval_mode
def evaluate_ppl(model, tokenizer, docs, T=None, seed=1234):
    """Score the authors' val loss, behind the paper's val PPL (METHOD.md §3), PPL being exp(loss).
    It returns (loss, bpb, documents, tokens) over the targets with bytes. Each document runs alone
    in one forward, its first seq_len + 1 tokens without BOS, from one seeded h0 for all."""
    device = next(model.parameters()).device
    rank, world = rank_and_world()
    seq_len = model.config.seq_len
    token_bytes = tokenizer.token_bytes.to(device)
    h0_table = evaluation_initial_state(model.config.d_model, seq_len, seed, device)
    # Sums of nats of byte tokens, their count, bytes, documents.
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for ids in tokenizer.encode(docs[rank::world]):
        ids = ids[:seq_len + 1]
        if len(ids) < 2:
            continue
        x, y = torch.tensor([ids[:-1]], device=device), torch.tensor([ids[1:]], device=device)
        with bf16_autocast(device):
            nats = model(x, targets=y, T=T, h0=h0_table[:, :x.size(1)], reduction="none").double()
        num_bytes = token_bytes[y]
        sums += torch.stack([nats[num_bytes > 0].sum(), (num_bytes > 0).sum().double(),
                             num_bytes.sum().double(), torch.ones_like(sums[0])])
    if dist.is_initialized():
        dist.all_reduce(sums)
    nats, tokens, num_bytes, num_docs = sums.tolist()
    if tokens == 0:
        raise ValueError("no validation document of 2 or more tokens: check the data source or "
                         "raise --max_docs")
    return nats / tokens, nats / (math.log(2) * num_bytes), int(num_docs), int(tokens)


Z_RATES = (1e-3, 10.0)  # the rates z the fit searches; one at either end fits no law inside them


def fit_test_time_scaling(Ts, losses):
    """Fit L(T) = L_inf + Z exp(-z T) by least squares (METHOD.md §3) -> L_inf, Z, z, rms, at_edge.
    For fixed z the law is linear in (L_inf, Z), so only z is searched, over Z_RATES.
    A log grid finds the best point, then golden-section search refines it.
    at_edge: z ended at an end of Z_RATES, so L_inf is no limit the losses show."""
    T, L = np.asarray(Ts, dtype=np.float64), np.asarray(losses, dtype=np.float64)
    if len(T) < 3 or len(set(T.tolist())) < 3:
        raise ValueError(f"fitting L(T) = L_inf + Z exp(-z T) needs at least 3 distinct T, "
                         f"got {Ts}; pass e.g. --T 1,2,4,8,16")

    def solve(log_z):
        design = np.stack([np.ones_like(T), np.exp(-math.exp(log_z) * T)], axis=1)
        coef = np.linalg.lstsq(design, L, rcond=None)[0]
        return math.sqrt(np.mean((design @ coef - L) ** 2)), coef

    grid = np.linspace(math.log(Z_RATES[0]), math.log(Z_RATES[1]), 241)
    best = int(np.argmin([solve(log_z)[0] for log_z in grid]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        lo, hi = (lo, b) if solve(a)[0] < solve(b)[0] else (a, hi)
    log_z = (lo + hi) / 2
    rms, (L_inf, Z) = solve(log_z)
    return {"L_inf": float(L_inf), "Z": float(Z), "z": math.exp(log_z), "rms": rms,
            "at_edge": bool(min(abs(log_z - grid[0]), abs(log_z - grid[-1])) < 1e-6)}


def fit_line(Ts, losses, mu_rec):
    """Fit L(T) and say it against the loss at mu_rec -> the fit, with that loss.
    A fit at the edge of its search gets a warning line."""
    fit = fit_test_time_scaling(Ts, losses)
    at_mu = losses[Ts.index(mu_rec)]
    print0(f"L(T) = L_inf + Z exp(-z T): L_inf {fit['L_inf']:.4f}  Z {fit['Z']:.4f}  "
           f"z {fit['z']:.4f}  RMS error {fit['rms']:.2e}; L_inf vs loss at T = mu_rec = {mu_rec} "
           f"({at_mu:.4f}): {100 * (fit['L_inf'] - at_mu) / at_mu:+.2f}%")
    if fit["at_edge"]:
        print0(f"warning: the fit of L(T) ends at the edge of its search, z = {fit['z']:g} "
               f"(searched {Z_RATES[0]:g} to {Z_RATES[1]:g}): the losses follow no such law, "
               f"so L_inf is no limit")
    return {**fit, "loss_at_mu_rec": at_mu, "mu_rec": mu_rec}

# -----------------------------------------------------------------------------
# Command line. Each --eval has one function; nanoparcae/results.py keeps the results.

def aggregate_line(result):
    """Say a CORE result's means, skipped tasks and time in one line."""
    centered, skipped, parts = result["centered"], result["skipped"], []
    if result["core"] is not None:
        parts.append(f"CORE {result['core']:.4f} (x100: {100 * result['core']:.2f}) over "
                     f"{sum(label in CORE_LABELS for label in centered)} of 22 tasks")
    if result["core_extended"] is not None:
        parts.append(f"Core-Extended {result['core_extended']:.4f} over {len(centered)} of 46 "
                     f"tasks")
    if skipped:
        parts.append(f"skipped {len(skipped)}: {', '.join(skipped)}")
    return " | ".join(parts + [f"{result['seconds']:.1f}s"])


def run_core(args, model, tokenizer, Ts, seeds):
    """Score CORE at each T and few-shot seed, with the mean and spread over seeds."""
    bundle_dir, why = shared_eval_bundle(args.bundle_url)
    if bundle_dir is None:
        raise ValueError(why)
    kw = dict(max_per_task=args.max_per_task, tasks=args.tasks, batch_tokens=args.batch_tokens)
    runs, summary = [], {}
    for T in Ts:
        for seed in seeds:
            print0(f"--- T = {T}, few-shot seed {seed}")
            result = evaluate_core(model, tokenizer, bundle_dir, T, seed=seed,
                                   one_per_forward=args.one_per_forward, **kw)
            print0(aggregate_line(result))
            runs.append(result)
        for key in ("core", "core_extended"):
            values = [r[key] for r in runs if r["T"] == T and r[key] is not None]
            if len(values) > 1:
                mean, std = statistics.mean(values), statistics.stdev(values)
                summary[f"T{T}_{key}"] = {"mean": mean, "std": std, "seeds": seeds}
                print0(f"T = {T}: {key} over seeds {seeds}: mean {mean:.4f} std {std:.4f} "
                       f"(x100: {100 * mean:.2f} +- {100 * std:.2f})")
    scored = sum(sum(run["items"].values()) for run in runs)
    # CORE's tasks are every run's own data, so only the items scored count.
    return {"runs": runs, "summary": summary, "measured": {"data": None, "amount": scored}}


def run_bpb(args, model, tokenizer, source, Ts, device):
    """Score val loss and bpb at each T, and fit L(T) over 3 or more depths."""
    mu_rec = model.config.mu_rec
    Ts = sorted(set(Ts) | {mu_rec})  # METHOD.md §3 compares L_inf with the loss at mu_rec
    rank, world = rank_and_world()
    batches = list(val_batches(tokenizer, source, args.batch_size, model.config.seq_len,
                               args.val_tokens, rank, world, device))
    tokens = len(batches) * args.batch_size * model.config.seq_len * world
    print0(f"Validation: {source}, {len(batches)} batches of {args.batch_size} x "
           f"{model.config.seq_len} per rank")
    out = {"T": Ts, "loss": [], "bpb": [], "data": source,
           "measured": {"data": data_key(source), "amount": tokens}}
    for T in Ts:
        t0 = time.time()
        loss, bpb = evaluate_bpb(model, tokenizer, batches, T)
        out["loss"].append(loss)
        out["bpb"].append(bpb)
        print0(f"T = {T:>3}: val loss {loss:.4f}  bpb {bpb:.4f}  ppl {perplexity(loss):.2f}  "
               f"{time.time() - t0:.1f}s")
    if len(Ts) >= 3 and all(map(math.isfinite, out["loss"])):  # non-finite: refused, not fitted
        out["fit"] = fit_line(Ts, out["loss"], mu_rec)
    return out


def perplexity(loss):
    """exp(loss), and inf where a finite loss is too large for a float to hold its exponential."""
    return math.exp(loss) if loss < 709 else math.inf


def run_ppl(args, model, tokenizer, source, Ts):
    """Score the paper's val PPL at each T, one document per forward."""
    docs = list(itertools.islice(iter_documents(source, "val"), args.max_docs))
    print0(f"Validation: the first {len(docs)} documents of {source}'s val split, one per "
           f"forward, up to {model.config.seq_len} tokens each, no BOS")
    out = {"T": Ts, "loss": [], "ppl": [], "bpb": [], "data": source}
    for T in Ts:
        t0 = time.time()
        loss, bpb, num_docs, tokens = evaluate_ppl(model, tokenizer, docs, T)
        out["loss"].append(loss)
        out["ppl"].append(perplexity(loss))
        out["bpb"].append(bpb)
        print0(f"T = {T:>3}: val loss {loss:.4f}  ppl {perplexity(loss):.2f}  bpb {bpb:.4f}  "
               f"({num_docs} documents, {tokens:,} tokens)  {time.time() - t0:.1f}s")
    return {**out, "measured": {"data": data_key(source), "amount": tokens}}


items_or_all = checked(int, "a positive number, or -1 for every item",
                       lambda value: value > 0 or value == -1)


def eval_parser(description):
    """Build the flags of an evaluation, for any command that evaluates a loaded model."""
    parser = command_parser(description)
    flag = parser.add_argument
    flag("--eval", default="core", choices=["core", "bpb", "ppl"],
         help="core: CORE; bpb: loss on packed rows; ppl: one document per forward")
    flag("--T", type=listed(positive(int)), default=None,
         help="test-time depth(s), e.g. 8 or 1,2,4,8 (default: mu_rec)")
    flag("--seeds", type=listed(int), default=[1234], help="few-shot seeds (several: mean, std)")
    flag("--max_per_task", type=items_or_all, default=-1, help="items per task, shuffled (-1: all)")
    flag("--tasks", default="core", help="core (22), extended (46), or labels: a,b")
    flag("--batch_tokens", type=positive(int), default=None,
         help="rows x width per forward (default 16384 on CUDA, 1024 on CPU)")
    flag("--one_per_forward", action="store_true", help="one item per forward (nanochat's way)")
    flag("--bundle_url", default=EVAL_BUNDLE_URL, help="where eval_bundle.zip is downloaded from")
    flag("--data", default=None, help="bpb, ppl: validation data (default: the run's)")
    flag("--val_tokens", type=positive(int), default=1 << 20, help="bpb: tokens over all ranks")
    flag("--batch_size", type=positive(int), default=8, help="bpb: sequences per forward")
    flag("--max_docs", type=positive(int), default=1000, help="ppl: the first N documents")
    flag("--device", default=None, help="cpu or cuda (default: cuda when available)")
    return parser


def start_device(args):
    """Pick --device, or CUDA when there is one, and join torchrun's process group."""
    return init_distributed(parse_device(args.device
                                         or ("cuda" if torch.cuda.is_available() else "cpu")))


def evaluate(args, model, tokenizer, ckpt, ckpt_path, device):
    """Run --eval on a loaded model and keep the results beside ckpt_path -> the command's status.
    Results that are not finite are refused with status 3, as a diverged run."""
    Ts = args.T or [model.config.mu_rec]
    # the JSON's room, 400 bytes for each depth's numbers, or each depth and seed's CORE tasks
    tasks = len(args.seeds) * len(EXTENDED_TASKS) if args.eval == "core" else 1
    check_results_folder(ckpt_path, args.eval, Ts, 2**16 + len(Ts) * tasks * 400)
    print0(f"Checkpoint {ckpt_path} (step {ckpt.get('step')}), {model.num_params():,} "
           f"parameters, mu_rec {model.config.mu_rec}, on {device} x {rank_and_world()[1]}")
    source = args.data or run_data(ckpt)
    if args.eval == "core":
        out = run_core(args, model, tokenizer, Ts, args.seeds)
    elif args.eval == "bpb":
        out = run_bpb(args, model, tokenizer, source, Ts, device)
    else:
        out = run_ppl(args, model, tokenizer, source, Ts)
    if refuse_non_finite(out, ckpt_path):
        return 3  # as train.py's diverged run
    keep_results(out, args, ckpt, ckpt_path, Ts, args.eval)
    return 0


def main(argv=None):
    parser = eval_parser(__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="a checkpoint file (default: the latest of --run)")
    which.add_argument("--run", help="a run under <base dir>/runs (default: the newest)")
    args = parser.parse_args(argv)
    device = start_device(args)
    ckpt, tokenizer, ckpt_path = load_run(args.run, args.ckpt)
    model = from_weights(ckpt["config"], ckpt["model"], device)
    return evaluate(args, model, tokenizer, ckpt, ckpt_path, device)


if __name__ == "__main__":
    run_command(main)

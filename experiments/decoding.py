"""
decoding.py: the decoding benchmark, timed side by side for one checkpoint.
It decodes the stdlib's validation text teacher-forced at fixed T, at T_max = 2 mu_rec, and with --T=auto.
--T=auto runs with either exit test.
Then it times the preallocated KV cache against a concatenating one and against full recomputation.
These are bench.py's rows 5a and 5b.
--kv compares the two KV caches of engine.py instead, steps (the exact one) and shared.
It reports bytes, loss, greedy agreement and tokens/s, and draws a figure.

    python -m experiments.decoding                          # the latest checkpoint of the latest run
    python -m experiments.decoding --run=d12 --T=8 --max_new_tokens=512
    python -m experiments.decoding --kv                     # steps vs shared KV cache
"""

from pathlib import Path

import torch
import torch.nn.functional as F

from nanoparcae.checkpoint import load_run
from nanoparcae.command import command_parser, run_command, positive
from nanoparcae.files import check_writable
from nanoparcae.ranks import parse_device
from nanoparcae.dataset import iter_documents
from engine import EXIT_THRESHOLDS, EXITS, KV_CACHES, Decoder, forced_logits, generate, teacher_forced
from experiments.plot import pyplot, save_png
from experiments.scaling_fit import paired_interval
from experiments.timing import log, median_seconds, print_table
from model import ParcaeConfig, from_weights, initial_state

PROMPT = 16  # tokens of prompt before the max_new_tokens decoded

# -----------------------------------------------------------------------------
# The decoding rows: tokens/s and loss of teacher-forced decoding

class ConcatKVCache:
    """A KV cache that grows by concatenation, row 5b's reference: each new position copies every slot's whole cache
    (engine.KVCache's claim and update, without its preallocated size)."""

    def __init__(self):
        self.slots, self.pos = {}, 0

    def claim(self, length):
        self.pos += length

    def update(self, slot, k, v):
        if slot in self.slots:
            k_past, v_past = self.slots[slot]
            k, v = torch.cat([k_past, k], dim=2), torch.cat([v_past, v], dim=2)
        self.slots[slot] = (k, v)
        return k, v


def forward_per_token(model, ids, prompt_len, T, seed=0):
    """Row 5b's "concat": teacher-forced like engine.teacher_forced, but the prompt in one model() call into a
    ConcatKVCache, then model() on each position. -> mean loss."""
    generator = torch.Generator(ids.device).manual_seed(seed)
    h0 = initial_state((1, ids.size(1), model.config.d_model), ids.device, [generator])
    cache, losses = ConcatKVCache(), []
    with torch.no_grad():
        logits = model(ids[:, :prompt_len], T=T, h0=h0[:, :prompt_len], cache=cache)
        for p in range(prompt_len, ids.size(1)):
            losses.append(F.cross_entropy(logits[:, -1].float(), ids[:, p]))
            logits = model(ids[:, p:p + 1], T=T, h0=h0[:, p:p + 1], cache=cache)
    return torch.stack(losses).mean().item()


def stdlib_tokens(tokenizer, length, device):
    """(1, length) ids of the stdlib's validation split, documents joined by BOS: text every machine has."""
    ids = []
    for document in iter_documents("stdlib", "val"):
        ids += tokenizer.encode(document, prepend_bos=True)
        if len(ids) >= length:
            return torch.tensor([ids[:length]], device=device)
    raise ValueError(f"the stdlib's validation split has fewer than {length} tokens; lower max_new_tokens")


def decoding_rows(model, ids, prompt_len, T=None, exit_threshold=None, repeats=3, number="5"):
    """Time teacher-forced decoding of ids[:, prompt_len:] (engine.teacher_forced) -> two table rows.
    The first compares fixed T (default mu_rec), T_max = 2 mu_rec and --T=auto with either exit test.
    The second compares the KV cache at T with a concatenating one and with full recomputation.
    Each row gives tokens/s, loss and steps per token."""
    c = model.config
    T, T_max, new = T or c.mu_rec, 2 * c.mu_rec, ids.size(1) - prompt_len
    modes = {f"T={T}": dict(T=T), f"recompute T={T}": dict(T=T, use_cache=False)}
    if model.injection is not None:
        threshold = {exit: exit_threshold or EXIT_THRESHOLDS[exit] for exit in EXITS}
        modes.update({f"T={T_max}": dict(T=T_max), **{
            f"auto ({exit} < {threshold[exit]:g})": dict(T="auto", exit=exit, exit_threshold=threshold[exit])
            for exit in EXITS}})
    results = {}

    def run(name, length):
        if name == "concat":
            results[name] = (forward_per_token(model, ids[:, :length], prompt_len, T), T)
        else:
            results[name] = teacher_forced(model, ids[:, :length], prompt_len, **modes[name])

    for name in [*modes, "concat"]:
        run(name, prompt_len + min(8, new))  # warm-up: the first calls of every kernel are slow
    log(f"decoding: {new} tokens after a {prompt_len}-token prompt, {', '.join(modes)}, concat")
    seconds = median_seconds({name: lambda name=name: run(name, ids.size(1)) for name in [*modes, "concat"]},
                             repeats, warmup=0)
    rate = {name: new / s for name, s in seconds.items()}

    def cell(name):
        loss, steps = results[name]
        return f"{name}: {rate[name]:.1f} tok/s, loss {loss:.4f}, {steps:.2f} steps/token"

    what = f"(engine.teacher_forced, {new} tokens after a {prompt_len}-token prompt)"
    cache_row = (f"{number}b", f"KV cache at T={T} {what}: preallocated vs model() per token with a concatenating "
                 "cache vs full recomputation", f"{cell(f'T={T}')}; {cell('concat')}; {cell(f'recompute T={T}')}",
                 f"{rate[f'T={T}'] / rate['concat']:.2f}x concat, {rate[f'T={T}'] / rate[f'recompute T={T}']:.2f}x "
                 "recompute", f">= 1.5x concat: {'met' if rate[f'T={T}'] >= 1.5 * rate['concat'] else 'not met'}")
    if model.injection is None:
        return [cache_row]
    auto = next(name for name in modes if name.startswith("auto (state"))
    # auto against T_max, signed: negative where it saves time, positive where its exit tests cost more than they save
    time_change = rate[f"T={T_max}"] / rate[auto] - 1
    steps_change = results[auto][1] / T_max - 1
    loss_up = results[auto][0] / results[f"T={T}"][0] - 1
    met = time_change <= steps_change + 0.2 and loss_up <= 0.005  # time saved >= steps saved - 20 points
    depth_row = (f"{number}a", f"decoding depth {what}: fixed T = mu_rec and 2 mu_rec, --T=auto (state, the "
                 "default; KL)", "; ".join(cell(name) for name in modes if "recompute" not in name),
                 f"auto (state) vs T={T_max}: time {time_change:+.0%}, steps {steps_change:+.0%}; loss vs T={T} "
                 f"{loss_up:+.2%}{cost_split(rate, T, T_max, auto, results[auto][1])}",
                 f"time saved >= steps saved - 20%, loss <= +0.5%: {'met' if met else 'not met'}")
    return [depth_row, cache_row]


def cost_split(rate, T, T_max, auto, auto_steps):
    """Split a decoded token's time using the two fixed depths, time(T) = fixed + T * step.
    The fixed part is the prelude, the coda, the head and the loop around them.
    In steps it shows the fixed part and what --T=auto costs beyond its steps.
    That cost is the exit tests and the skipped slots' fill.
    Then it shows the most any exit test could save against T_max at auto's steps.
    It is empty when T = T_max."""
    if T == T_max:
        return ""
    step = (1 / rate[f"T={T_max}"] - 1 / rate[f"T={T}"]) / (T_max - T)
    fixed = 1 / rate[f"T={T}"] - T * step
    exit_cost = 1 / rate[auto] - fixed - auto_steps * step
    return (f"; per token: fixed cost {fixed / step:.2f} steps, auto's exit cost {exit_cost / step:.2f} steps; "
            f"a free exit would save at most {(T_max - auto_steps) * step * rate[f'T={T_max}']:.0%}")


# -----------------------------------------------------------------------------
# The KV caches compared: steps (exact, a slot per loop step) against shared (one slot per recurrent layer)

BYTES_TS = (1, 8, 32, 64)
LOSS_TS = (4, 8, 16, 32, "auto")
BIG = ParcaeConfig.from_depth(24)  # the paper's 1.3B: 8/8/8 layers, d_model 1,536
BIG_POSITIONS = 2048


def kv_bytes(config, T, kv, positions, bytes_per_value):
    """Count a KV cache's bytes: keys and values of d_model per position, per slot.
    Each prelude and coda layer has one slot.
    Each recurrent layer has one (shared) or one per loop step (steps)."""
    slots = config.n_prelude + config.n_coda + config.n_recur * (1 if kv == "shared" else T)
    return slots * 2 * positions * config.d_model * bytes_per_value


def measured_kv_bytes(model, T, kv, positions):
    """Bytes of the cache's tensors once every slot is written: a 2-token prompt, then one decoded position."""
    decoder = Decoder(model, [0, 0], positions - 2, T, kv=kv)
    decoder.next_logits()
    return decoder.cache.nbytes()


def stdlib_documents(tokenizer, length, count, device):
    """(n, length) ids: the first `length` tokens of the stdlib validation split's first `count` documents that long."""
    docs = []
    for document in iter_documents("stdlib", "val"):
        ids = tokenizer.encode(document, prepend_bos=True)
        if len(ids) >= length:
            docs.append(ids[:length])
        if len(docs) == count:
            break
    if len(docs) < 2:
        raise ValueError(f"the stdlib's validation split has fewer than 2 documents of {length} tokens")
    return torch.tensor(docs, device=device)


def per_document(model, docs, T, kv, new_greedy):
    """Teacher-forced decoding of every document, batched -> (mean loss per document (n,), greedy tokens under
    the true context (n, new), mean steps per token), then free-running greedy tokens (n, new_greedy)."""
    losses, argmax, steps = [], [], []
    for p, (logits, ran) in enumerate(forced_logits(model, docs, PROMPT, T, kv=kv), PROMPT):
        losses.append(F.cross_entropy(logits.float(), docs[:, p], reduction="none"))
        argmax.append(logits.argmax(-1))
        steps.append(ran.float())
    greedy = torch.stack([ids for ids, _ in generate(model, docs[:, :PROMPT], new_greedy, T, temperature=0,
                                                      generator=torch.Generator(docs.device).manual_seed(0), kv=kv)], 1)
    return (torch.stack(losses, 1).mean(1), torch.stack(argmax, 1), torch.stack(steps).mean().item(), greedy)


def kv_rows(model, docs, timing_T, repeats):
    """The two caches side by side -> (table rows, the figure's data)."""
    c, positions = model.config, docs.size(1)
    new, new_greedy = positions - PROMPT, min(64, positions - PROMPT)
    rows, data = [], {"bytes": {}, "big": {}, "loss": {}}
    for T in BYTES_TS:
        for kv in KV_CACHES:
            counted = measured_kv_bytes(model, T, kv, positions)
            assert counted == kv_bytes(c, T, kv, positions, model.wte.weight.element_size()), (kv, T, counted)
            data["bytes"][T, kv] = counted
            data["big"][T, kv] = kv_bytes(BIG, T, kv, BIG_POSITIONS, 2)
    layers = f"{c.n_prelude}/{c.n_recur}/{c.n_coda} layers, d_model {c.d_model}"
    for name, sizes, unit, what in (("bytes", data["bytes"], 2 ** 10, f"this model ({layers}), {positions} positions, "
                                     f"{model.wte.weight.dtype}, counted from the cache's tensors"),
                                    ("big", data["big"], 2 ** 30, f"1.3B (8/8/8 layers, d_model 1,536), "
                                     f"{BIG_POSITIONS} positions, bf16, computed")):
        cells = "; ".join(f"T={T}: steps {sizes[T, 'steps'] / unit:,.1f}, shared {sizes[T, 'shared'] / unit:,.1f}"
                          for T in BYTES_TS)
        flat = all(sizes[T, "shared"] == sizes[1, "steps"] for T in BYTES_TS)
        rows.append((f"kv-{name}", f"KV cache {'KiB' if unit == 2 ** 10 else 'GiB'}: {what}", cells,
                     f"steps / shared at T=64: {sizes[64, 'steps'] / sizes[64, 'shared']:.1f}x",
                     f"shared = T=1's at every T: {'met' if flat else 'not met'}"))
    for T in LOSS_TS:
        runs = {kv: per_document(model, docs, T, kv, new_greedy) for kv in KV_CACHES}
        steps_loss, steps_argmax, steps_ran, steps_greedy = runs["steps"]
        shared_loss, shared_argmax, shared_ran, shared_greedy = runs["shared"]
        interval = paired_interval((shared_loss - steps_loss).tolist())  # 90%, over documents
        mean, (lo, hi) = interval["measured"], interval["ci90"]
        data["loss"][T] = (mean, lo, hi)
        forced = (steps_argmax == shared_argmax).float().mean().item()
        free = (steps_greedy == shared_greedy).float().mean().item()
        verdict = "not shown" if lo <= 0 <= hi else ("shared worse" if lo > 0 else "shared better")
        rows.append((f"kv-loss T={T}", f"teacher-forced loss, {len(docs)} stdlib val documents, {new} tokens "
                     f"each after {PROMPT}; greedy agreement, true context / free-running ({new_greedy} tokens)",
                     f"steps {steps_loss.mean():.4f}, shared {shared_loss.mean():.4f} ({steps_ran:.2f} / "
                     f"{shared_ran:.2f} steps/token); greedy agreement {forced:.1%} / {free:.1%}",
                     f"shared - steps {mean:+.2e} nats, 90% [{lo:+.2e}, {hi:+.2e}]",
                     f"difference: {verdict}"))
    rates = {}
    for T in (c.mu_rec, timing_T):
        fns = {(T, kv): lambda T=T, kv=kv: teacher_forced(model, docs[:1], PROMPT, T, kv=kv) for kv in KV_CACHES}
        rates.update({key: new / s for key, s in median_seconds(fns, repeats).items()})
    rows.append(("kv-speed", f"tokens/s, teacher-forced, 1 document of {new} tokens, median of {repeats}",
                 "; ".join(f"T={T}: steps {rates[T, 'steps']:.1f}, shared {rates[T, 'shared']:.1f}"
                           for T in (c.mu_rec, timing_T)),
                 "; ".join(f"shared / steps at T={T}: {rates[T, 'shared'] / rates[T, 'steps']:.2f}x"
                           for T in (c.mu_rec, timing_T)), "-"))
    return rows, data


def draw_kv(data, title):
    """KV memory against T (the 1.3B at 2,048 positions, bf16) and shared - steps loss against T with its 90%
    interval, for both caches."""
    fig, (left, right) = pyplot().subplots(1, 2, figsize=(10, 4))
    for kv, marker in zip(KV_CACHES, "os"):
        left.plot(BYTES_TS, [data["big"][T, kv] / 2 ** 30 for T in BYTES_TS], marker=marker, label=kv)
    left.set(xscale="log", xlabel="recurrence depth T", ylabel="KV cache per sequence (GiB)",
             title=f"1.3B, {BIG_POSITIONS} positions, bf16")
    left.set_xticks(BYTES_TS, [str(T) for T in BYTES_TS])
    left.minorticks_off()
    left.legend()
    labels = [str(T) for T in LOSS_TS]
    x = range(len(LOSS_TS))
    means = [data["loss"][T][0] for T in LOSS_TS]
    below = [data["loss"][T][0] - data["loss"][T][1] for T in LOSS_TS]
    above = [data["loss"][T][2] - data["loss"][T][0] for T in LOSS_TS]
    right.axhline(0, color="C0", label="steps (exact)")
    right.errorbar(x, means, yerr=[below, above], fmt="s", color="C1", capsize=4, label="shared, 90% interval")
    right.set(xlabel="recurrence depth T", ylabel="loss minus steps' (nats)", title=title)
    right.set_xticks(list(x), labels)
    right.legend()
    return fig


def compare_caches(model, tokenizer, args, device):
    """--kv: the table of both caches, and its figure at --figure."""
    docs = stdlib_documents(tokenizer, PROMPT + args.max_new_tokens, args.documents, device)
    rows, data = kv_rows(model, docs, args.T or 32, args.repeats)
    print_table(rows, f"KV caches on {device}")
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    c = model.config
    save_png(draw_kv(data, f"d_model {c.d_model}, {len(docs)} documents"), args.figure)
    log(f"figure: {args.figure}")


# -----------------------------------------------------------------------------
# Command line

def main(argv=None):
    parser = command_parser(__doc__)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="a checkpoint file (default: the latest of --run)")
    which.add_argument("--run", help="a run under <base dir>/runs (default: the most recently written)")
    parser.add_argument("--T", type=positive(int), default=None,
                        help="the fixed depth measured (default mu_rec; --kv: timed beside mu_rec, default 32)")
    parser.add_argument("--max_new_tokens", type=positive(int), default=256, help="tokens decoded after the prompt")
    parser.add_argument("--exit_threshold", type=positive(float), default=None,
                        help=f"--T=auto stops under this (default {EXIT_THRESHOLDS})")
    parser.add_argument("--repeats", type=positive(int), default=3, help="timed repeats; the median is shown")
    parser.add_argument("--kv", action="store_true", help="compare the steps and shared KV caches instead")
    parser.add_argument("--documents", type=positive(int), default=32, help="--kv: held-out documents for the loss")
    parser.add_argument("--figure", type=Path, default=Path("figures/kv_cache_cpu/kv_shared.png"),
                        help="--kv: where the figure goes")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    device = parse_device(args.device)
    if args.kv:  # the figure's folder, checked before the work
        check_writable(args.figure.parent, args.figure.name)
    ckpt, tokenizer, path = load_run(args.run, args.ckpt)
    model = from_weights(ckpt["config"], ckpt["model"], device)
    ids = stdlib_tokens(tokenizer, PROMPT + args.max_new_tokens, device)
    log(f"{path}: {model.num_params():,} parameters, mu_rec={model.config.mu_rec}, injection={model.config.injection}")
    if args.kv and model.injection is None:
        raise ValueError("--kv compares caches of a looped model; this is the Transformer baseline")
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        if args.kv:
            compare_caches(model, tokenizer, args, device)
            return
        rows = decoding_rows(model, ids, PROMPT, args.T, args.exit_threshold, args.repeats)
    print_table(rows, f"decoding on {device}")


if __name__ == "__main__":
    run_command(main)

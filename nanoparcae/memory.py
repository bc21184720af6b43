"""
nanoparcae/memory.py: the device batch, picked from a training run's memory plan per GPU.
The plan counts weights, gradients, DDP's buckets, the optimiser's state and saved activations.
It needs nothing built. It is an estimate until a GPU measures it (runs/gpu_check.sh compares the two).
"""

from types import SimpleNamespace

import torch

from model import poisson_tail
from nanoparcae.ranks import print0, gather

# Bytes a training step saves for backward per token, from saved tensors on small CPU models:
# (a block run with grad per d, a value embedding per d, the loop per d per (4 + k) steps,
# the head per d, the logits per vocab entry). Compiled (model.compile_regions), the backward
# recomputes the cheap elementwise work, and the loss keeps the bf16 logits alone.
SAVED_PER_TOKEN = {(False, False): (80, 4, 4, 12, 4), (False, True): (56, 4, 4, 12, 4),
                   (True, False): (64, 6, 3, 10, 4), (True, True): (36, 4, 2, 4, 2)}  # (compiled, bf16)
POISSON_FULL_MISS = 1e-6  # poisson_full plans for its depth exceeded once in 10^6 draws


def backprop_depth(config):
    """The most loop steps a sequence backpropagates under config.sampling (model.sample_depths).

    - mu_bwd for the samplers that cap k at it (per_sequence and the rest).
    - poisson_unbounded: 2 mu_bwd, the top of its k ~ U{1..2 mu_bwd}.
    - poisson_full: k = max(1, Poisson(r)) has no top; the k it passes once in 10^6 draws."""
    if config.sampling == "poisson_unbounded":
        return 2 * config.mu_bwd
    if config.sampling == "poisson_full":
        rate = max(config.mu_rec, config.mu_bwd)
        return next(k for k in range(1, 10 * rate + 100) if poisson_tail(rate, k + 1) < POISSON_FULL_MISS)
    if config.sampling == "fixed":
        return min(config.mu_rec, config.mu_bwd)
    return config.mu_bwd


def activation_bytes(model, batch_size, bf16=True, compiled=False):
    """Bytes saved for backward by a training forward of batch_size sequences.
    Each backpropagates through at most backprop_depth steps, which memory follows, not the mean.
    Per token, SAVED_PER_TOKEN's bytes for the step as it runs (eager or compiled, its dtype).
    bf16 also keeps a bf16 copy of every matrix (eager: autocast's weight cache)."""
    c = model.config
    d = c.d_model
    looped = model.injection is not None
    k = backprop_depth(c)
    block, ve, loop, head, vocab = SAVED_PER_TOKEN[compiled, bf16]

    def runs(i):  # how many times layer i runs with grad in one forward
        return k if looped and c.n_prelude <= i < c.n_prelude + c.n_recur else 1

    block_runs = sum(runs(i) for i in range(c.n_layer))
    per_token = (block_runs * block * d + sum(runs(i) for i in model.ve_layers) * ve * d
                 + (loop * (4 + k) * d if looped else 0) + head * d + vocab * c.vocab_size)
    def matrices(modules):  # embeddings are read, not cast
        return sum(p.numel() for module in modules for name, p in module.named_parameters()
                   if p.ndim == 2 and not name.startswith("value_embeds"))

    # compiled, each loop step's graph casts its own copy of the loop's matrices
    in_loop = [model.recur, *([model.injection] if c.injection == "concat" else [])]
    copies = matrices([model]) + (compiled and looped) * (k - 1) * matrices(in_loop)
    return batch_size * c.seq_len * per_token + (2 * copies if bf16 else 0)


def memory_plan(model, device_batch_size, bf16, optimizer_bytes, gpu_gb=(80, 141), compiled=True):
    """Estimated bytes per GPU of training at device_batch_size sequences. It counts:

    - float32 weights and gradients, and DDP's gradient buckets (another copy).
    - the optimiser's state (optim.optimizer_state_bytes).
    - activations at backprop_depth, of the step compiled (train.py's default) or eager.

    "largest_batch" maps each gb of gpu_gb to the most sequences per GPU within 90% of it.
    The rest is left for the backward's transient buffers, the CUDA context and fragmentation.
    0: not even one fits."""
    weights = 4 * model.num_params()
    static = 3 * weights + optimizer_bytes
    per_sequence = activation_bytes(model, 2, bf16, compiled) - activation_bytes(model, 1, bf16, compiled)
    activations = activation_bytes(model, device_batch_size, bf16, compiled)
    fixed = activations - device_batch_size * per_sequence  # eager bf16's weight copies
    largest = {gb: max(0, int((0.9 * gb * 1e9 - static - fixed) // per_sequence)) for gb in gpu_gb}
    return {"weights": weights, "grads": weights, "ddp_buckets": weights, "optimizer": optimizer_bytes,
            "activations": activations, "total": static + activations, "largest_batch": largest}


def largest_divisor(sequences, at_most):
    """The largest device batch of at most at_most sequences that divides `sequences`.
    `sequences` is each process's share of an optimiser step, which accumulation keeps whole.
    None when at_most < 1."""
    return max((size for size in range(1, min(at_most, sequences) + 1) if sequences % size == 0), default=None)


def choose_device_batch(model, args, device, world, optimizer_bytes):
    """--device_batch_size, or the largest size that:

    - divides each process's share of an optimiser step, which accumulation keeps whole.
    - on a GPU, has a memory plan within 90% of the memory free at start-up.
      The least free GPU across ranks decides.
    - on a CPU, is at most 32.

    Prints the plan (on a GPU, or for --dry_run) and the choice.
    A size that does not divide the step or does not fit raises ValueError.
    Returns namespace(size, given, sequences, world, plan, fitting, gpu, gpu_gb).
    gpu_gb: the free GB planned for."""
    given, seq_len, total = args.device_batch_size, args.seq_len, args.total_batch_size
    if given and total % (given * seq_len * world):
        raise ValueError(f"--total_batch_size={total} is not divisible by device_batch_size x seq_len x world = "
                         f"{given} x {seq_len} x {world} = {given * seq_len * world}; change one of them")
    if total % (seq_len * world):
        raise ValueError(f"--total_batch_size={total} is not divisible by seq_len x world = {seq_len} x "
                         f"{world}; change one of them")
    sequences = total // (seq_len * world)  # each process's share of an optimiser step
    bf16, compiled = args.dtype == "bfloat16", bool(args.compile)
    gpu, gpu_gb = None, None
    if device.type == "cuda":  # what is free now: another process may hold some of the GPU
        free, total = (gb / 1e9 for gb in torch.cuda.mem_get_info(device))
        # every rank must pick the same batch: the least free GPU decides
        free, total = (min(values) for values in zip(*gather((free, total))))
        gpu_gb = free
        gpus, gpu = (gpu_gb,), (f"the {free:.1f} GB free of this GPU's {total:.1f} GB "
                                f"({torch.cuda.get_device_name(device)})")
    else:  # no GPU memory to plan for: the plans for the two GPUs the paper's runs are sized for
        gpus = (80, 141)
    # its largest_batch holds at any size
    plan = memory_plan(model, given or 1, bf16, optimizer_bytes, gpus, compiled)
    most = plan["largest_batch"]
    if gpu:
        fitting = largest_divisor(sequences, most[gpu_gb])
        if most[gpu_gb] < (given or 1):
            raise ValueError(f"{f'--device_batch_size={given}' if given else 'one sequence per GPU'} plans "
                             f"{plan['total'] / 1e9:.1f} GB, over 90% of {gpu}; "
                             + (f"the largest device batch that fits is {fitting}" if fitting
                                else "free the GPU, or train a smaller --depth"))
        how = f"whose memory plan fits in 90% of {gpu}"
    else:
        how = "up to 32 (no GPU; a GPU would get " + ", ".join(
            f"{largest_divisor(sequences, most[gb])} in {gb} GB" for gb in gpus) + ")"
        fitting = largest_divisor(sequences, 32)
    size = given or fitting
    if size != (given or 1):
        plan = memory_plan(model, size, bf16, optimizer_bytes, gpus, compiled)
    if device.type == "cuda" or args.dry_run:
        print0(f"memory per GPU (GB): weights {plan['weights'] / 1e9:.1f} + grads {plan['grads'] / 1e9:.1f} "
               f"+ DDP buckets {plan['ddp_buckets'] / 1e9:.1f} + optimizer {plan['optimizer'] / 1e9:.1f} + "
               f"activations {plan['activations'] / 1e9:.1f} ({size} x {seq_len} backpropagating up to "
               f"{backprop_depth(model.config)} steps, {args.dtype}, {'compiled' if compiled else 'eager'}) = "
               f"{plan['total'] / 1e9:.1f} | largest device batch: "
               + ", ".join(f"{n} in {gb:.4g} GB" for gb, n in plan["largest_batch"].items())
               + " | an estimate until a GPU measures it (runs/gpu_check.sh)")
    print0(f"device batch: {size}, " + ("as given" if given else
           f"the largest divisor of the {sequences} sequences a process runs per step {how}"))
    return SimpleNamespace(size=size, given=given, sequences=sequences, world=world, plan=plan,
                           fitting=fitting, gpu=gpu, gpu_gb=gpu_gb)

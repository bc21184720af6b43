"""
nanoparcae/memory.py: the device batch, picked from a training run's memory plan per GPU.
It needs nothing built, and is an estimate until a GPU measures it (runs/gpu_check.sh compares the two).
"""

import torch

from nanoparcae.ranks import print0

# Bytes a training step saves for backward per token, from saved tensors on small CPU models (a block run with grad
# per d, a value embedding per d, the loop per d per (4 + k) steps, the head per d, the logits per vocab entry).
# Compiled (model.compile_regions), the backward recomputes the cheap elementwise work, and keeps the bf16 logits only.
SAVED_PER_TOKEN = {(False, False): (80, 4, 4, 12, 4), (False, True): (56, 4, 4, 12, 4),
                   (True, False): (64, 6, 3, 10, 4), (True, True): (36, 4, 2, 4, 2)}  # (compiled, bf16)


def activation_bytes(model, batch_size, bf16=True, compiled=False):
    """Bytes saved for backward by a training forward of batch_size sequences backpropagating through the most
    steps (memory follows the most, not the mean), plus bf16's copy of each matrix."""
    c = model.config
    d, looped, k = c.d_model, model.injection is not None, c.backprop_depth
    block, ve, loop, head, vocab = SAVED_PER_TOKEN[compiled, bf16]

    def runs(i):  # how many times layer i runs with grad in one forward
        return k if looped and c.n_prelude <= i < c.n_prelude + c.n_recur else 1

    per_token = (sum(map(runs, range(c.n_layer))) * block * d + sum(map(runs, model.ve_layers)) * ve * d
                 + (loop * (4 + k) * d if looped else 0) + head * d + vocab * c.vocab_size)

    def matrices(modules):  # embeddings are read, not cast
        return sum(p.numel() for module in modules for name, p in module.named_parameters()
                   if p.ndim == 2 and not name.startswith("value_embeds"))

    # compiled, each loop step's graph casts its own copy of the loop's matrices
    in_loop = [model.recur, *([model.injection] if c.injection == "concat" else [])]
    copies = matrices([model]) + (compiled and looped) * (k - 1) * matrices(in_loop)
    return batch_size * c.seq_len * per_token + (2 * copies if bf16 else 0)


def memory_plan(model, device_batch_size, bf16, optimizer_bytes, gpu_gb=(80, 141), compiled=True):
    """Estimated bytes per GPU of training at device_batch_size sequences. "largest_batch" maps each gb of gpu_gb
    to the most sequences within 90% of it, the rest left for transient buffers and the CUDA context."""
    weights = 4 * model.num_params()
    static = 3 * weights + optimizer_bytes
    per_sequence = activation_bytes(model, 2, bf16, compiled) - activation_bytes(model, 1, bf16, compiled)
    activations = activation_bytes(model, device_batch_size, bf16, compiled)
    fixed = activations - device_batch_size * per_sequence  # eager bf16's weight copies
    largest = {gb: max(0, int((0.9 * gb * 1e9 - static - fixed) // per_sequence)) for gb in gpu_gb}
    return {"weights": weights, "grads": weights, "ddp_buckets": weights, "optimizer": optimizer_bytes,
            "activations": activations, "total": static + activations, "largest_batch": largest}


def largest_divisor(sequences, at_most):
    """The largest device batch of at most at_most that divides a process's `sequences`, or None."""
    return max((size for size in range(1, min(at_most, sequences) + 1) if sequences % size == 0), default=None)


def choose_device_batch(model, args, device, sequences, optimizer_bytes):
    """--device_batch_size, or the largest divisor of a process's `sequences` that fits in 90% of the GPU's free
    memory (at most 32 on a CPU)."""
    given, bf16, compiled = args.device_batch_size, args.dtype == "bfloat16", bool(args.compile)
    if device.type == "cuda":  # what is free now, since another process may hold some of the GPU
        free, total = (gb / 1e9 for gb in torch.cuda.mem_get_info(device))
        gpus, gpu = (free,), f"the {free:.1f} GB free of this {torch.cuda.get_device_name(device)}'s {total:.1f} GB"
    else:  # no GPU memory to plan for, so the plans for the two GPUs the paper's runs are sized for
        gpus, gpu = (80, 141), None
    plan = memory_plan(model, given or 1, bf16, optimizer_bytes, gpus, compiled)
    most = plan["largest_batch"]
    if gpu:
        fitting = largest_divisor(sequences, most[gpus[0]])
        if most[gpus[0]] < (given or 1):
            raise ValueError(f"{f'--device_batch_size={given}' if given else 'one sequence per GPU'} plans "
                             f"{plan['total'] / 1e9:.1f} GB, over 90% of {gpu}; "
                             + (f"the largest device batch that fits is {fitting}" if fitting
                                else "free the GPU, or train a smaller --depth"))
        how = f"whose memory plan fits in 90% of {gpu}"
    else:
        fitting = largest_divisor(sequences, 32)
        how = "up to 32 (no GPU; a GPU would get " + ", ".join(
            f"{largest_divisor(sequences, most[gb])} in {gb} GB" for gb in gpus) + ")"
    size = given or fitting
    plan = memory_plan(model, size, bf16, optimizer_bytes, gpus, compiled)
    if gpu or args.dry_run:
        print0(f"memory per GPU (GB): weights {plan['weights'] / 1e9:.1f} + grads {plan['grads'] / 1e9:.1f} "
               f"+ DDP buckets {plan['ddp_buckets'] / 1e9:.1f} + optimizer {plan['optimizer'] / 1e9:.1f} + "
               f"activations {plan['activations'] / 1e9:.1f} ({size} x {args.seq_len} backpropagating up to "
               f"{model.config.backprop_depth} steps, {args.dtype}, {'compiled' if compiled else 'eager'}) = "
               f"{plan['total'] / 1e9:.1f} | largest device batch: "
               + ", ".join(f"{n} in {gb:.4g} GB" for gb, n in plan["largest_batch"].items())
               + " | an estimate until a GPU measures it (runs/gpu_check.sh)")
    print0(f"device batch: {size}, " + ("as given" if given else
           f"the largest divisor of the {sequences} sequences a process runs per step {how}"))
    return size

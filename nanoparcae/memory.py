"""
nanoparcae/memory.py: the device batch, picked from a training run's memory plan per GPU.
The plan counts weights, gradients, DDP's buckets, the optimiser's state and saved activations.
It needs nothing built. It is an estimate until a GPU measures it (runs/gpu_check.sh compares the two).
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from nanoparcae.common import print0


def activation_bytes(model, batch_size, bf16=True):
    """Bytes saved for backward by a training forward of batch_size sequences.
    Each backpropagates through mu_bwd loop steps, the most any can.
    So memory follows mu_bwd, not the sampled depth. Per token, from eager saved tensors:

    - each block run with grad: 80 d bytes in float32, 56 d under bf16 autocast.
    - a value embedding: 4 d.
    - the loop: 4 (4 + mu_bwd) d (prelude norm, B, A_bar h per step, C_proj).
    - the head: 12 d, and the float32 log-softmax 4 vocab.

    bf16 also keeps one bf16 copy of every matrix (autocast's weight cache)."""
    c = model.config
    d = c.d_model
    looped = model.injection is not None

    def runs(i):  # how many times layer i runs with grad in one forward
        return c.mu_bwd if looped and c.n_prelude <= i < c.n_prelude + c.n_recur else 1

    block_runs = sum(runs(i) for i in range(c.n_layer))
    per_token = (block_runs * (56 if bf16 else 80) * d + sum(runs(i) for i in model.ve_layers) * 4 * d
                 + (4 * (4 + c.mu_bwd) * d if looped else 0) + 12 * d + 4 * c.vocab_size)
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.ndim == 2 and not name.startswith("value_embeds"))  # embeddings are read, not cast
    return batch_size * c.seq_len * per_token + (2 * matrices if bf16 else 0)


def memory_plan(model, device_batch_size, bf16, optimizer_bytes, gpu_gb=(80, 141)):
    """Estimated bytes per GPU of training at device_batch_size sequences. It counts:

    - float32 weights and gradients, and DDP's gradient buckets (another copy).
    - the optimiser's state (optim.optimizer_state_bytes).
    - activations at mu_bwd (activation_bytes).

    "largest_batch" maps each gb of gpu_gb to the most sequences per GPU within 90% of it.
    The rest is left for the backward's transient buffers, the CUDA context and fragmentation.
    0: not even one fits."""
    weights = 4 * model.num_params()
    static = 3 * weights + optimizer_bytes
    per_sequence = activation_bytes(model, 2, bf16) - activation_bytes(model, 1, bf16)
    activations = activation_bytes(model, device_batch_size, bf16)
    fixed = activations - device_batch_size * per_sequence  # bf16's weight copies
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
    bf16 = args.dtype == "bfloat16"
    gpu, gpu_gb = None, None
    if device.type == "cuda":  # what is free now: another process may hold some of the GPU
        free, total = (gb / 1e9 for gb in torch.cuda.mem_get_info(device))
        if dist.is_initialized():  # every rank must pick the same batch: the least free GPU decides
            least = torch.tensor([free, total], device=device)
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
            free, total = least.tolist()
        gpu_gb = free
        gpus, gpu = (gpu_gb,), (f"the {free:.1f} GB free of this GPU's {total:.1f} GB "
                                f"({torch.cuda.get_device_name(device)})")
    else:  # no GPU memory to plan for: the plans for the two GPUs the paper's runs are sized for
        gpus = (80, 141)
    plan = memory_plan(model, given or 1, bf16, optimizer_bytes, gpus)  # its largest_batch holds at any size
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
        plan = memory_plan(model, size, bf16, optimizer_bytes, gpus)
    if device.type == "cuda" or args.dry_run:
        print0(f"memory per GPU (GB): weights {plan['weights'] / 1e9:.1f} + grads {plan['grads'] / 1e9:.1f} "
               f"+ DDP buckets {plan['ddp_buckets'] / 1e9:.1f} + optimizer {plan['optimizer'] / 1e9:.1f} + "
               f"activations {plan['activations'] / 1e9:.1f} ({size} x {seq_len} at mu_bwd "
               f"{model.config.mu_bwd}, {args.dtype}) = {plan['total'] / 1e9:.1f} | largest device batch: "
               + ", ".join(f"{n} in {gb:.4g} GB" for gb, n in plan["largest_batch"].items())
               + " | an estimate until a GPU measures it (runs/gpu_check.sh)")
    print0(f"device batch: {size}, " + ("as given" if given else
           f"the largest divisor of the {sequences} sequences a process runs per step {how}"))
    return SimpleNamespace(size=size, given=given, sequences=sequences, world=world, plan=plan,
                           fitting=fitting, gpu=gpu, gpu_gb=gpu_gb)

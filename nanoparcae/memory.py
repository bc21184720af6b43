"""
nanoparcae/memory.py: the memory plan of a training run, per GPU: weights, gradients, DDP's buckets, the
optimiser's state and the activations saved for backward, to pick the device batch before anything is built.
An estimate until a GPU measures it (runs/gpu_check.sh compares the two).
"""


def activation_bytes(model, batch_size, bf16=True):
    """Bytes saved for backward by a training forward of batch_size sequences that all backpropagate
    through mu_bwd loop steps (the most any can: memory follows mu_bwd, not the sampled depth). Per
    token, counted from eager saved tensors: each block run with grad saves 80 d bytes in float32 and 56 d
    under bf16 autocast; a value embedding 4 d; the loop 4 (4 + mu_bwd) d (prelude norm, B, A_bar h per step,
    C_proj); the head 12 d and the float32 log-softmax 4 vocab. bf16 also keeps one bf16 copy of every matrix
    (autocast's weight cache)."""
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
    """Estimated bytes per GPU of training at device_batch_size sequences: float32 weights and gradients, DDP's
    gradient buckets (another copy), the optimiser's state (optim.optimizer_state_bytes) and activations at
    mu_bwd (activation_bytes). An estimate until a GPU measures it (runs/gpu_check.sh compares the two).
    "largest_batch": {gb: the most sequences per GPU that fit in 90% of gb GB} for each of gpu_gb, the rest
    left for the backward's transient buffers, the CUDA context and fragmentation (0: not even one)."""
    weights = 4 * model.num_params()
    static = 3 * weights + optimizer_bytes
    per_sequence = activation_bytes(model, 2, bf16) - activation_bytes(model, 1, bf16)
    activations = activation_bytes(model, device_batch_size, bf16)
    fixed = activations - device_batch_size * per_sequence  # bf16's weight copies
    largest = {gb: max(0, int((0.9 * gb * 1e9 - static - fixed) // per_sequence)) for gb in gpu_gb}
    return {"weights": weights, "grads": weights, "ddp_buckets": weights, "optimizer": optimizer_bytes,
            "activations": activations, "total": static + activations, "largest_batch": largest}


def largest_fitting_batch(model, sequences, gpu_gb, bf16, optimizer_bytes):
    """The device batch for a GPU of gpu_gb GB: the largest divisor of `sequences` (the sequences
    one process runs per optimiser step, so that gradient accumulation keeps the batch whole) whose
    memory_plan fits in 90% of it; None when not even one sequence does."""
    most = memory_plan(model, 1, bf16, optimizer_bytes, (gpu_gb,))["largest_batch"][gpu_gb]
    return largest_divisor(sequences, most)


def largest_divisor(sequences, at_most):
    """The largest device batch of at most at_most sequences that divides `sequences`, each process's share of
    an optimiser step (gradient accumulation keeps the batch whole); None when at_most < 1."""
    return max((size for size in range(1, min(at_most, sequences) + 1) if sequences % size == 0), default=None)

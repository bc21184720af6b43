"""
faulty_train.py: train.py with faults injected from outside, for the tests of what train.py does about them.

    python tests/faulty_train.py nan_step=2,nan_steps=3 [train.py flags]      # steps 3-5's gradients non-finite
    torchrun --nproc_per_node=2 --max_restarts=1 tests/faulty_train.py kill_step=6 [train.py flags]

nan_step=N: the gradients of nan_steps steps (default 1) from step index N (the Nth step is index N-1) are made
non-finite just before train.py clips them. kill_step=N: the last rank SIGKILLs itself once it reaches the clip of
the step after step N, as a node fault or the OOM killer would, in torchrun's first attempt only. drift_step=N: the
last rank adds 1e-3 to its first weight tensor at that clip, so its replica drifts from the others' (a fault DDP
never sees). pause_step=N: the process waits there for a SIGUSR1 (one sent earlier waits, blocked, until then).
pause_lock=1: the process waits so for a SIGUSR1 once its checks are done, before it takes the run's lock.
rank_order=R: rank R reads each epoch's chunks in reverse order (GPU_CHECK_FAULT=rank_order's fault, at R = 1).
collectives=1: rank 0 prints the calls into torch.distributed (and DDP's set-up, one) made before step 1's clip.
Steps are counted from this process's first; then train.py runs as `python train.py` would run it.
"""

import functools
import os
import runpy
import signal
import sys
from pathlib import Path

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # before any thread starts: each inherits the mask
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
faults = dict(nan_step=-1, nan_steps=1, kill_step=-1, drift_step=-1, pause_step=-1, rank_order=-1,
              pause_lock=-1, collectives=-1)
for item in filter(None, sys.argv[1].split(",")):
    name, _, value = item.partition("=")
    if name not in faults or not value.isdigit():
        sys.exit(f"faulty_train.py: {item!r} is not one of {', '.join(f'{name}=N' for name in faults)}")
    faults[name] = int(value)
last_rank = int(os.environ.get("RANK", 0)) == int(os.environ.get("WORLD_SIZE", 1)) - 1
first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
clip_grad_norm = torch.nn.utils.clip_grad_norm_
steps, collectives = 0, []


def faulty_clip_grad_norm(parameters, *args, **kwargs):
    """train.py clips once a step, after the backward: the step's gradients are all there."""
    global steps
    parameters = list(parameters)
    if steps == faults["kill_step"] and last_rank and first_attempt:
        os.kill(os.getpid(), signal.SIGKILL)
    if 0 <= steps - faults["nan_step"] < faults["nan_steps"]:
        parameters[0].grad.fill_(float("nan"))
    if steps == faults["drift_step"] and last_rank:
        with torch.no_grad():
            parameters[0].add_(1e-3)
    if steps == faults["pause_step"]:
        signal.sigwait({signal.SIGUSR1})
    if steps == 0 and faults["collectives"] > 0 and int(os.environ.get("RANK", 0)) == 0:
        print(f"collectives before step 1: {len(collectives)} ({', '.join(collectives)})", flush=True)
    steps += 1
    return clip_grad_norm(parameters, *args, **kwargs)


torch.nn.utils.clip_grad_norm_ = faulty_clip_grad_norm
if faults["collectives"] > 0:
    import torch.distributed as dist  # noqa: E402
    from torch.nn.parallel import DistributedDataParallel  # noqa: E402

    def counted(name, call):
        @functools.wraps(call)  # DDP's signature stays readable (ranks.no_buffer_sync)
        def count(*args, **kwargs):
            collectives.append(name)
            return call(*args, **kwargs)
        return count

    for name in ("init_process_group", "new_group", "barrier", "monitored_barrier", "all_gather_object", "all_gather",
                 "all_reduce", "broadcast", "broadcast_object_list", "gather_object", "scatter_object_list"):
        setattr(dist, name, counted(name, getattr(dist, name)))
    DistributedDataParallel.__init__ = counted("DDP", DistributedDataParallel.__init__)
sys.path.insert(0, str(ROOT))
if faults["pause_lock"] >= 0:
    import nanoparcae.run as run_module  # noqa: E402
    claim = run_module.claim

    def paused_claim(*args):
        signal.sigwait({signal.SIGUSR1})
        return claim(*args)

    run_module.claim = paused_claim
if faults["rank_order"] >= 0:
    from experiments.gpu_check import reverse_chunk_order
    reverse_chunk_order(faults["rank_order"])
sys.argv = [str(ROOT / "train.py"), *sys.argv[2:]]
runpy.run_path(str(ROOT / "train.py"), run_name="__main__")

"""The memory plan of a training run (memory.memory_plan, optim.optimizer_state_bytes): its activation estimate
(memory.activation_bytes) against the bytes a training forward really saves for backward, measured with
saved-tensor hooks on small CPU models, and its sum.

Run as a script, this file prints the bytes each compiled model saves (compiled_runs' process):

    python tests/test_memory.py
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script too
from conftest import awaited, beforehand, python  # noqa: E402
from model import Parcae, ParcaeConfig, poisson_tail  # noqa: E402
from nanoparcae.memory import activation_bytes, memory_plan  # noqa: E402
from optim import optimizer_state_bytes  # noqa: E402


def saved_bytes(model, batch_size, bf16):
    """Bytes of every distinct storage saved for backward, parameters excluded, at T = mu_rec >= mu_bwd."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (batch_size, model.config.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        model(x, x, T=model.config.mu_rec, h0_generator=torch.Generator().manual_seed(0))
    return sum(storages.values())


SIZES = [(3, 64, 500, 5, "diagonal"), (9, 64, 320, 4, "concat"), (6, 128, 320, 2, "none")]
# compiled, in bf16: the looped and the unlooped model at depth 3, each a layer per region, as dynamo's tracing takes
# long (concat's adapter is one more matrix)
COMPILED = [(3, *size[1:], True, True) for size in SIZES if size[4] != "concat"]


def tiny_model(depth, d_model, vocab, mu_rec, injection):
    config = ParcaeConfig.from_depth(depth, d_model=d_model, head_dim=32, vocab_size=vocab, seq_len=32,
                                     mu_rec=mu_rec, injection=injection)
    torch.manual_seed(0)
    return Parcae(config).train()


def measured_bytes(model, bf16, compiled):
    """The bytes the model's forward saves at 2 and 4 sequences (saved_bytes). Compiled: model.compile_regions under
    inductor's partitioner and decompositions, without its code generation."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(optimize_ddp=True, recompile_limit=torch._dynamo.config.recompile_limit), \
            torch.fx.experimental._config.patch(backed_size_oblivious=False):  # compile_regions sets them
        if compiled:
            model.compile_regions(backend="aot_eager_decomp_partition")
        measured = [saved_bytes(model, batch, bf16) for batch in (2, 4)]
    torch._dynamo.reset()
    return measured


def compiled_runs(folder):
    """measured_bytes of each COMPILED size's model, in a process of its own beside the tests -> {size: bytes}."""
    result = python([__file__])
    assert result.returncode == 0, result.stderr[-3000:]
    return {tuple(size): measured for size, measured in json.loads(result.stdout)}


@pytest.mark.parametrize("depth,d_model,vocab,mu_rec,injection,bf16,compiled",
                         [(*size, bf16, False) for size in SIZES for bf16 in (False, True)]
                         + [pytest.param(*size, marks=[pytest.mark.slow, beforehand(compiled_runs)])  # compiles
                            for size in COMPILED])
def test_activation_estimate_within_2_percent_of_the_saved_tensors(depth, d_model, vocab, mu_rec, injection, bf16,
                                                                   compiled):
    """Compiled: the bytes compiled_runs measured in a process of its own."""
    model = tiny_model(depth, d_model, vocab, mu_rec, injection)
    size = (depth, d_model, vocab, mu_rec, injection, bf16, compiled)
    measured = awaited(compiled_runs)[size] if compiled else measured_bytes(model, bf16, compiled)
    # per sequence: the growth from 2 to 4 sequences, so fixed costs (bf16 weight copies) cancel
    estimated = [activation_bytes(model, batch, bf16, compiled) for batch in (2, 4)]
    assert (estimated[1] - estimated[0]) / 2 == pytest.approx((measured[1] - measured[0]) / 2, rel=0.02)
    assert estimated[1] == pytest.approx(measured[1], rel=0.04)  # the fixed part too
    assert (activation_bytes(model, 1, bf16, compiled) > (estimated[1] - estimated[0]) / 2) == bf16


def test_the_plan_is_at_the_samplers_most_backpropagated_steps():
    """poisson_unbounded's k reaches 2 mu_bwd; poisson_full's k ~ max(1, Poisson(8)) passes 23 once in 10^6 draws."""
    depths = {sampling: ParcaeConfig(sampling=sampling, mu_rec=8).backprop_depth
              for sampling in ("per_sequence", "per_batch", "fixed", "poisson_fill", "poisson_unbounded",
                               "poisson_full")}
    assert depths == {"per_sequence": 4, "per_batch": 4, "fixed": 4, "poisson_fill": 4, "poisson_unbounded": 8,
                      "poisson_full": depths["poisson_full"]}
    k = depths["poisson_full"]
    assert poisson_tail(8, k + 1) < 1e-6 <= poisson_tail(8, k)
    with torch.device("meta"):
        plans = {s: activation_bytes(Parcae(ParcaeConfig.from_depth(6, sampling=s)), 8)
                 for s in ("per_sequence", "poisson_unbounded", "poisson_full")}
    assert plans["per_sequence"] < plans["poisson_unbounded"] < plans["poisson_full"]


@pytest.mark.parametrize("bf16", [False, True])
def test_memory_plan_adds_up_and_its_largest_batch_is_the_largest_that_fits(bf16):
    """The paper's 1.3B (depth 24, mu_rec 8) on the meta device: float32 weights 5.4 GB, each copy of them
    (gradients, DDP buckets) as large, MuonAdamW's state 8.0 GB; one more sequence than "largest_batch" would
    pass 90% of the GPU's memory."""
    with torch.device("meta"):
        model = Parcae(ParcaeConfig.from_depth(24, mu_rec=8))
    optimizer_bytes = optimizer_state_bytes(model)
    assert optimizer_bytes < optimizer_state_bytes(model, muon=False)  # Muon's second moment is factored
    plan = memory_plan(model, 32, bf16, optimizer_bytes)
    assert round(plan["weights"] / 1e9, 1) == 5.4 and round(plan["optimizer"] / 1e9, 1) == 8.0
    assert plan["weights"] == plan["grads"] == plan["ddp_buckets"] == 4 * model.num_params()
    assert plan["activations"] == activation_bytes(model, 32, bf16, compiled=True)  # train.py's default
    assert plan["total"] == 3 * plan["weights"] + plan["optimizer"] + plan["activations"]
    for gb, largest in plan["largest_batch"].items():
        assert memory_plan(model, largest, bf16, optimizer_bytes)["total"] <= 0.9 * gb * 1e9
        assert memory_plan(model, largest + 1, bf16, optimizer_bytes)["total"] > 0.9 * gb * 1e9
    assert 0 < plan["largest_batch"][80] < plan["largest_batch"][141]


if __name__ == "__main__":  # compiled_runs' process
    print(json.dumps([[size, measured_bytes(tiny_model(*size[:5]), *size[5:])] for size in COMPILED]))

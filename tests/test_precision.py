"""Mixed precision, checked on a CPU: under bf16 autocast (every GPU run; train.py --dtype=bfloat16) the
residual stream stays float32 at every stage, every RMSNorm gets a float32 input for its float32 weight (the
fused kernel), eval and sampling run, and the compiled blocks compile no more graphs than in float32.
Training under bf16 against float32 is in tests/test_train.py."""

from contextlib import nullcontext

import pytest
import torch
import torch._dynamo
import torch.nn as nn

from data import evaluate_bpb
from model import split_depths
from model import Parcae, ParcaeConfig, initial_state
from engine import generate

BF16 = dict(device_type="cpu", dtype=torch.bfloat16)


def tiny(injection="diagonal", **overrides):
    torch.manual_seed(0)
    config = ParcaeConfig.from_depth(3, d_model=64, head_dim=32, vocab_size=257, seq_len=32, mu_rec=3,
                                     injection=injection, **overrides)
    return Parcae(config)


class ByteTokenizer:
    token_bytes = torch.tensor([1] * 256 + [0], dtype=torch.int32)


def record_dtypes(model):
    """-> {module kind: set of input dtypes} for every RMSNorm (with its weight's dtype) and every block."""
    seen = {"norm": set(), "norm_weight": set(), "block": set(), "linear_out": set()}

    def norm_hook(module, args):
        seen["norm"].add(args[0].dtype)
        seen["norm_weight"].add(module.weight.dtype)

    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.register_forward_pre_hook(norm_hook)
        elif isinstance(module, nn.Linear):
            module.register_forward_hook(lambda m, args, out: seen["linear_out"].add(out.dtype))
    for block in [*model.prelude, *model.recur, *model.coda]:
        block.register_forward_pre_hook(lambda m, args: seen["block"].add(args[0].dtype))
    return seen


def test_logits_are_float32_or_the_models_wider_dtype():
    """bf16 autocast and a float32 model give float32 logits; a float64 model gives float64 logits that carry
    more than float32's digits (a float32 cast on the way would bottom out a float64 check near 1e-7)."""
    model = tiny().eval()
    x = torch.randint(0, 257, (2, 32))
    h0 = torch.randn(2, 32, 64) * 0.1
    with torch.autocast(**BF16):
        assert model(x, h0=h0).dtype == torch.float32
    assert model(x, h0=h0).dtype == torch.float32
    logits = model.to(torch.float64)(x, h0=h0)
    assert logits.dtype == torch.float64
    assert not torch.equal(logits, logits.float().double())


@pytest.mark.parametrize("injection", ["diagonal", "concat", "add", "none"])
def test_the_stream_and_every_norm_stay_float32_under_bf16_autocast(injection):
    model = tiny(injection)
    seen = record_dtypes(model)
    x = torch.randint(0, 257, (3, 32))
    with torch.autocast(**BF16):
        loss = model(x, x, h0_generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert seen["linear_out"] == {torch.bfloat16}  # the matmuls did run in bf16
    assert seen["norm"] == seen["norm_weight"] == {torch.float32}  # the fused path, no mismatch
    assert seen["block"] == {torch.float32}  # prelude, loop state and coda
    assert loss.dtype == torch.float32
    if injection == "diagonal":
        A_bar, delta = model.injection.discretize()
        assert A_bar.dtype == delta.dtype == torch.float32


def test_bf16_forward_tracks_float32():
    model = tiny().eval()
    x = torch.randint(0, 257, (2, 32))
    h0 = initial_state((2, 32, 64))
    reference = model(x, x, T=4, h0=h0)
    with torch.autocast(**BF16):
        bf16 = model(x, x, T=4, h0=h0)
    assert bf16.item() != reference.item()
    assert bf16.item() == pytest.approx(reference.item(), rel=1e-2)


def test_eval_and_sampling_run_under_cpu_bf16_autocast():
    model = tiny()
    seen = record_dtypes(model)
    torch.manual_seed(1)
    batches = [(x[:, :-1], x[:, 1:]) for x in torch.randint(0, 256, (2, 4, 33))]
    loss_f32, bpb_f32 = evaluate_bpb(model, ByteTokenizer(), batches, T=3)
    with torch.autocast(**BF16):  # evaluate_bpb keeps a caller's CPU autocast
        loss_bf16, bpb_bf16 = evaluate_bpb(model, ByteTokenizer(), batches, T=3)
    assert loss_bf16 != loss_f32 and loss_bf16 == pytest.approx(loss_f32, rel=1e-2)
    assert bpb_bf16 == pytest.approx(bpb_f32, rel=1e-2)
    model.eval()
    with torch.autocast(**BF16):
        for T in (3, "auto"):
            generator = torch.Generator().manual_seed(0)
            out = [ids for ids, _ in generate(model, [5, 6, 7], 6, T=T, temperature=1.0, generator=generator)]
            assert len(out) == 6 and all(0 <= int(ids) < 257 for ids in out)
    assert torch.bfloat16 in seen["linear_out"]
    assert seen["norm"] == {torch.float32} and seen["block"] == {torch.float32}


def compiled_graphs(model, depths, autocast, reset=True):
    """Graphs dynamo has compiled for the regions after training steps at the given per-sequence depths."""
    if reset:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.compile_regions(backend="eager")  # dynamo's tracing and guards, without code generation
    x = torch.randint(0, 257, (4, 32))
    for T in depths:
        with autocast:
            depths = split_depths(torch.tensor(T), model.config.mu_bwd, training=True)
            loss = model(x, x, depths=depths, h0_generator=torch.Generator().manual_seed(0))
        loss.backward()
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_regions_do_not_recompile_under_autocast():
    model = tiny(mu_bwd=2).train()
    # with mu_bwd 2, the no-grad and the grad steps each see the full batch, a prefix of 2 and a prefix of 1
    depths = [[3, 3, 3, 3], [4, 4, 1, 1], [4, 1, 1, 1]]
    float32 = compiled_graphs(model, depths, nullcontext())
    bf16 = compiled_graphs(model, depths, torch.autocast(**BF16))
    assert bf16 == float32 > 0
    again = compiled_graphs(model, [[5, 3, 2, 1], [2, 2, 2, 2]], torch.autocast(**BF16), reset=False)
    assert again == bf16  # new depths compile nothing new
    torch._dynamo.reset()

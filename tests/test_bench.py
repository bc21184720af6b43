"""Tests for bench.py's helpers, the masked reference recurrence and the executed-pass counter, and through
them the claim that model.py's prefix recurrence gives the masked loop's loss and gradients; then row 3's two
batch sizes; row 9's profile, memory and the row itself; and the benchmarks' command lines refusing bad sizes and
abbreviated flags."""

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import awaited, beforehand, python, raises_naming
from model import split_depths
from experiments import decoding, gpu_check
from experiments.bench import (STEP_MODELS, PassCounter, busy_time, depth_schedule, main, masked_reference_loss,
                               model_loss, peak_memory, profile_steps, sampled_flops_per_token)
from model import Parcae, ParcaeConfig

DEPTHS = split_depths(torch.tensor([1, 5, 2, 8]), 3, training=True)  # mu_bwd 3: n = [0, 2, 0, 5], k = [1, 3, 2, 3]
UNIFORM = split_depths(torch.tensor([4, 4, 4, 4]), 3, training=True)


def tiny_model(injection="diagonal"):
    torch.manual_seed(0)
    config = ParcaeConfig(vocab_size=97, seq_len=16, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=4, mu_bwd=3, injection=injection)
    model = Parcae(config).train()
    with torch.no_grad():  # non-zero output projections, or the recurrence would not reach the loss
        for block in [*model.prelude, *model.recur, *model.coda]:
            block.attn.c_proj.weight.normal_(std=0.05)
            block.mlp.c_proj.weight.normal_(std=0.05)
    x, y = torch.randint(0, 97, (4, 16)), torch.randint(0, 97, (4, 16))
    return model, x, y


def loss_and_grads(loss_fn, model, x, y, depths):
    loss = loss_fn(model, x, y, depths, torch.Generator().manual_seed(1))  # the same h0 draw for both
    return loss, torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)


PER_BATCH = (torch.tensor([4, 4, 4, 4]), torch.tensor([3, 3, 3, 3]))  # an (n, k) draw of --depth_sampling=per_batch


@pytest.mark.parametrize("depths", [DEPTHS, UNIFORM, PER_BATCH])
@pytest.mark.parametrize("injection", ["diagonal", "concat"])
def test_masked_reference_equals_the_model(injection, depths):
    model, x, y = tiny_model(injection)
    loss, grads = loss_and_grads(model_loss, model, x, y, depths)
    ref_loss, ref_grads = loss_and_grads(masked_reference_loss, model, x, y, depths)
    torch.testing.assert_close(ref_loss, loss, rtol=1e-6, atol=1e-6)
    for (name, _), g, g_ref in zip(model.named_parameters(), grads, ref_grads):
        assert (g is None) == (g_ref is None), name
        if g is not None:
            torch.testing.assert_close(g_ref, g, rtol=1e-5, atol=1e-6, msg=name)


def test_pass_counter_counts_sequences_through_the_recurrent_block():
    model, x, y = tiny_model()
    with PassCounter(model) as masked:
        masked_reference_loss(model, x, y, DEPTHS, torch.Generator()).backward()
    assert masked.passes == 4 * (5 + 3)  # every sequence runs max(n) + max(k) steps
    with PassCounter(model) as ours:
        model_loss(model, x, y, DEPTHS, torch.Generator()).backward()
    assert ours.passes == int(sum(DEPTHS).sum())  # model.py runs each sequence its own T_i steps
    with PassCounter(model) as uniform:
        model_loss(model, x, y, split_depths(torch.tensor([3, 3, 3, 3]), 3, training=True), torch.Generator())
    assert uniform.passes == 12
    model(x, T=2, h0_generator=torch.Generator())  # outside the context the hook is gone
    assert uniform.passes == 12


@pytest.mark.parametrize("injection", ["diagonal", "none"])
def test_sampled_flops_are_the_matmul_flops_the_steps_execute(injection):
    """bench's FLOP/s numerator over a schedule of per-sequence draws is FlopCounterMode's count of those
    forward + backward passes (attention on SDPA's math path, counted in full, as matmul_flops_per_token)."""
    model, x, y = tiny_model(injection)
    schedule = depth_schedule(model.config, 4, 3, seed=2)
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        for depths in schedule:
            model_loss(model, x, y, depths, torch.Generator()).backward()
    executed = sampled_flops_per_token(model.config, schedule)
    assert counter.get_total_flops() == pytest.approx(executed * 3 * x.numel(), rel=1e-12)


@pytest.mark.slow
def test_row_3_at_the_batch_size_given_and_at_the_papers_32(tmp_path, capsys):
    """Row 3 prints 3a at --batch_size and 3b at 32 sequences per micro-batch; --json's sampling_overhead is 3b's."""
    main(["--rows", "3", "--depth", "3", "--d_model", "64", "--head_dim", "32", "--vocab_size", "97", "--seq_len", "16",
          "--batch_size", "4", "--steps", "1", "--repeats", "1", "--json", str(tmp_path / "bench.json")])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 3")]
    assert [row[0] for row in rows] == ["| 3a", "| 3b"]
    assert "4 sequences per micro-batch" in rows[0][1] and "32 sequences per micro-batch" in rows[1][1]
    written = json.loads((tmp_path / "bench.json").read_text())
    assert f"overhead {written['figures']['sampling_overhead']:+.1%}" == rows[1][3]


def test_busy_time_is_the_union_of_the_intervals():
    assert busy_time([(5, 6), (0, 2), (1, 3), (1.5, 2.5)]) == 4
    assert busy_time([]) == 0


def test_profile_steps_counts_the_operators_of_a_step_on_a_cpu():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    ops, idle = profile_steps(lambda: torch.mm(a + b, b).sum(), 3, torch.device("cpu"))
    assert ops == 3 and idle is None  # add, mm, sum: their inner calls are not counted


def test_peak_memory_is_the_peak_over_what_was_allocated_before(monkeypatch):
    """On CUDA, with torch.cuda patched: the peak is reset before the step, so an earlier higher one does not count."""
    memory = {"allocated": 100, "peak": 900}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: memory.update(peak=memory["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory["peak"])

    def step():
        memory["peak"] = max(memory["peak"], 350)

    assert peak_memory(step, torch.device("cuda")) == 250
    assert peak_memory(step, torch.device("cpu")) is None


def row_9(folder):
    """bench.py's row 9 on a tiny model, as a command of its own -> the folder, its finished process."""
    return folder, python(["-m", "experiments.bench", "--rows", "9", "--depth", "3", "--d_model", "64", "--head_dim",
                           "32", "--vocab_size", "97", "--seq_len", "16", "--batch_size", "4", "--steps", "2",
                           "--repeats", "1", "--compile_backend", "eager", "--json", str(folder / "bench.json")])


@pytest.mark.slow
@beforehand(row_9)
def test_row_9_times_the_step_of_each_model_and_puts_per_sequence_against_fixed_depth():
    folder, result = awaited(row_9)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row[0][2:]: row[1:] for row in (line.split(" | ") for line in result.stdout.splitlines()
                                             if line.startswith("| 9"))}
    assert list(rows) == ["9", "9a", "9b", "9c"]
    step = json.loads((folder / "bench.json").read_text())["figures"]["step"]
    for name, number in zip(STEP_MODELS, ("9a", "9b", "9c")):
        assert rows[number][0].startswith(name)
        figures = step[name]
        assert figures["tokens_per_s"] > 0 and figures["kernels_per_step"] > 0 and figures["peak_memory"] is None
        assert figures["mfu_measured"] == pytest.approx(figures["flops"] / step["matmul_rate"])
    per_seq, fixed = step["Parcae per-sequence"], step["Parcae fixed depth"]
    assert step["overhead"] == pytest.approx(fixed["flops"] / per_seq["flops"] - 1)
    assert f"time per FLOP {step['overhead']:+.1%}" in rows["9a"][2]


@pytest.mark.parametrize("cli, argv", [
    (main, ["--step", "1"]), (decoding.main, ["--max_new", "8"]),
    (gpu_check.main, ["table", ".", ".", "--gpus", "1", "--memory", "1", "--tin", "x"])])
def test_an_abbreviated_flag_is_unknown(cli, argv):
    with raises_naming(ValueError, argv[-2]):
        cli(argv)

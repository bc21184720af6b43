"""Tests for engine.py and sample.py: cached decoding equals recomputation, sampling, adaptive depth, the command
line."""

import argparse
import copy
import io
import math
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import sample
from nanoparcae.checkpoint import save_checkpoint
from conftest import carries, python, raises_naming
from nanoparcae.command import run_command
from experiments import decoding
from engine import KVCache, decode_step, generate, relative_change, sample_next, teacher_forced
from model import Parcae, ParcaeConfig, Slot, initial_state
from nanoparcae.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def tiny_model(seed=0, **overrides):
    """A small Parcae with every weight non-trivial (the zero-init projections would hide cache bugs)."""
    kw = dict(vocab_size=97, seq_len=32, n_prelude=1, n_recur=2, n_coda=1, d_model=64, head_dim=32, mu_rec=3)
    torch.manual_seed(seed)
    model = Parcae(ParcaeConfig(**{**kw, **overrides}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name in ("injection.A_log", "injection.dt_bias") else 1 / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    return model.eval()


def run(model, prompt, n, seed=0, **kw):
    """-> (tokens (B, n), steps (B, n)) of generate with a generator seeded `seed` (or a list of seeds)."""
    seeds = seed if isinstance(seed, list) else [seed]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    gens = gens if isinstance(seed, list) else gens[0]
    out = list(generate(model, prompt, n, generator=gens, **kw))
    return torch.stack([ids for ids, _ in out], dim=1), torch.stack([steps for _, steps in out], dim=1)


PROMPT = [[5, 17, 42, 8, 91, 3, 60]]

# -----------------------------------------------------------------------------
# Fixed depth

@pytest.mark.parametrize("T", [1, 3, 8])
def test_cached_greedy_equals_full_recompute(T):
    model = tiny_model()
    n = 12
    tokens, steps = run(model, PROMPT, n, T=T, temperature=0)
    # the reference: the whole sequence through the model for every token, the same h0 for every position
    seq = torch.tensor(PROMPT)
    h0 = initial_state((1, seq.size(1) + n, 64), "cpu", torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq, T=T, h0=h0[:, :seq.size(1)])
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert tokens.tolist() == seq[:, len(PROMPT[0]):].tolist()
    assert (steps == T).all()
    uncached, _ = run(model, PROMPT, n, T=T, temperature=0, use_cache=False)
    assert torch.equal(uncached, tokens)
    assert len(set(tokens[0].tolist())) > 1  # not a degenerate repeat that any bug would reproduce


def test_depth_changes_the_output():
    model = tiny_model()
    assert not torch.equal(run(model, PROMPT, 12, T=1, temperature=0)[0], run(model, PROMPT, 12, T=8, temperature=0)[0])


def test_top_k_1_equals_greedy_and_sampling_is_seeded():
    model = tiny_model()
    greedy, _ = run(model, PROMPT, 12, temperature=0)
    assert torch.equal(run(model, PROMPT, 12, temperature=1.5, top_k=1)[0], greedy)
    sampled, _ = run(model, PROMPT, 12, seed=1, temperature=1.5)
    assert torch.equal(run(model, PROMPT, 12, seed=1, temperature=1.5)[0], sampled)
    assert not torch.equal(run(model, PROMPT, 12, seed=2, temperature=1.5)[0], sampled)


def test_top_k_draws_follow_the_renormalised_top_k_distribution():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0, -2.0, 0.0, 2.5]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.cat([sample_next(logits, 0.7, 3, [generator]) for _ in range(4000)])
    top = [3, 7, 0]  # the three largest logits
    assert set(draws.tolist()) == set(top)
    expected = (logits[0, top] / 0.7).softmax(dim=-1)
    observed = torch.stack([(draws == i).float().mean() for i in top])
    torch.testing.assert_close(observed, expected, atol=0.025, rtol=0)


@pytest.mark.parametrize("T, exit, threshold", [(3, "state", None), ("auto", "kl", 1e-4), ("auto", "state", 0.15)])
def test_batched_samples_equal_each_sample_alone(T, exit, threshold):
    model = tiny_model()
    seeds = [10, 11, 12]
    kw = dict(T=T, temperature=1.0, top_k=20, exit=exit, exit_threshold=threshold, T_max=6)
    batched, batched_steps = run(model, PROMPT * 3, 10, seed=seeds, **kw)
    for i, seed in enumerate(seeds):
        alone, alone_steps = run(model, PROMPT, 10, seed=[seed], **kw)
        assert torch.equal(batched[i:i + 1], alone) and torch.equal(batched_steps[i:i + 1], alone_steps)
    assert len({tuple(row) for row in batched.tolist()}) == 3
    if T == "auto":  # rows stopped at different steps, so the per-row masking was exercised
        assert len(batched_steps.unique()) > 1


def test_long_prompt_is_cropped_from_the_left_with_a_warning():
    model = tiny_model()
    prompt = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning) as warned:
        cropped, _ = run(model, prompt, 6, temperature=0)
    assert carries(str(warned[0].message), "40", "seq_len=32"), warned[0].message  # the prompt's length, the crop
    assert torch.equal(run(model, prompt[:, -32:], 6, temperature=0)[0], cropped)


def test_too_many_positions_is_a_clear_error():
    model = tiny_model()
    with raises_naming(ValueError, "320", "max_new_tokens"):  # the RoPE table's length, and the fix
        next(generate(model, PROMPT, 320))

# -----------------------------------------------------------------------------
# Adaptive depth

def test_auto_with_threshold_zero_equals_fixed_T_max():
    model = tiny_model()
    fixed, _ = run(model, PROMPT, 12, T=5, temperature=0)
    auto, steps = run(model, PROMPT, 12, T="auto", T_max=5, exit_threshold=0.0, temperature=0)
    assert torch.equal(auto, fixed) and (steps == 5).all()
    one_token, _ = run(model, [PROMPT[0][:1]], 12, T="auto", T_max=5, exit_threshold=0.0, temperature=0)
    assert torch.equal(one_token, run(model, [PROMPT[0][:1]], 12, T=5, temperature=0)[0])


def prefilled(model, T=4):
    """The tiny model with PROMPT in a KV cache sized for one more position, and h0 for all 8."""
    cache = KVCache(max_len=8, loop_steps=T)
    h0 = initial_state((1, 8, 64), "cpu", torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(torch.tensor(PROMPT), T=T, h0=h0[:, :7], cache=cache)
    return cache, h0


@pytest.mark.parametrize("exit", ["state", "kl"])
def test_auto_exit_predicts_like_the_shallower_depth_and_fills_skipped_slots(exit):
    model = tiny_model()
    cache, h0 = prefilled(model)
    shallow = copy.deepcopy(cache)
    with torch.no_grad():
        expected = model(torch.tensor([[11]]), T=2, h0=h0[:, 7:], cache=shallow)
        logits, steps = decode_step(model, torch.tensor([[11]]), cache, h0[:, 7:], 4, exit, threshold=math.inf)
    assert steps.tolist() == [2]  # the first step that has a previous one to compare with
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert cache.pos == 8
    for slot in shallow.slots:  # what the exit computed is what fixed T=2 caches, the coda's slot included
        end = -1 if slot.part == "recur" and slot.step >= 2 else None  # but the skipped steps' new entry: below
        for ours, ref in zip(cache.slots[slot], shallow.slots[slot]):
            torch.testing.assert_close(ours[:, :, :end], ref[:, :, :end], rtol=1e-5, atol=1e-5, msg=str(slot))
    for i in range(2):
        k1, v1 = cache.slots[Slot("recur", i, step=1)]
        for s in (2, 3):
            k, v = cache.slots[Slot("recur", i, step=s)]
            assert torch.equal(k[:, :, -1], k1[:, :, -1]) and torch.equal(v[:, :, -1], v1[:, :, -1])
            assert not torch.equal(k[:, :, -2], k1[:, :, -2])  # the prompt's entries ran all 4 steps


def test_state_exit_stops_at_the_first_small_relative_change():
    model = tiny_model()
    cache, h0 = prefilled(model, T=6)
    idx = torch.tensor([[11]])
    with torch.no_grad():  # the full-depth trajectory of the new position's state, step by step
        reference = copy.deepcopy(cache)
        Bbar_e, ves, cos, sin = model.run_prelude(idx, reference)
        states = [h0[:, 7:]]
        for step in range(6):
            u = model.injection(states[-1], Bbar_e)
            states.append(model.recurrent_block(u, step, ves, cos, sin, reference))
    changes = [float(relative_change(new, old)) for old, new in zip(states[1:], states[2:])]  # at t = 2..6
    assert len(set(changes)) == 5
    for threshold in sorted(changes)[1:4]:
        expected = next(t for t, change in enumerate(changes, start=2) if change < threshold)
        _, steps = decode_step(model, idx, copy.deepcopy(cache), h0[:, 7:], 6, "state", threshold)
        assert steps.tolist() == [expected]


def test_teacher_forced_loss_is_the_cross_entropy_of_the_recomputed_sequence():
    model = tiny_model()
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(3))
    generator = torch.Generator().manual_seed(0)  # teacher_forced's: the rows draw their h0 from it in turn
    h0 = torch.cat([initial_state((1, 20, 64), "cpu", generator) for _ in range(2)])
    with torch.no_grad():
        expected = model(ids[:, :-1], ids[:, 1:].clone().masked_fill_(torch.arange(19) < 5, -1), T=3,
                         h0=h0[:, :19])
    for use_cache in (True, False):
        loss, steps = teacher_forced(model, ids, 6, T=3, use_cache=use_cache)
        assert steps == 3 and loss == pytest.approx(expected.item(), rel=1e-5)
    auto_loss, auto_steps = teacher_forced(model, ids, 6, T="auto", T_max=6, exit="state", exit_threshold=0.25)
    assert 2 <= auto_steps < 6 and auto_loss != loss


def test_auto_steps_follow_the_threshold():
    model = tiny_model()
    _, always_two = run(model, PROMPT, 6, T="auto", T_max=6, exit_threshold=math.inf, temperature=0)
    assert (always_two == 2).all()
    _, at_most_one = run(model, PROMPT, 6, T="auto", T_max=1, temperature=0)
    assert (at_most_one == 1).all()
    with raises_naming(ValueError, "T='auto'", "use_cache=False"):
        next(generate(model, PROMPT, 4, T="auto", use_cache=False))

# -----------------------------------------------------------------------------
# The command line

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny checkpoint and its tokenizer under a base dir of their own: base/runs/tiny/ckpt_000005.pt."""
    base = tmp_path_factory.mktemp("base")
    text = [f"The {w} of the {v} is a {u} thing, said the {w}.\n" for w in ("cat", "dog", "sun", "tree")
            for v in ("house", "river", "garden") for u in ("small", "bright", "quiet")]
    tokenizer = Tokenizer.train(iter(text * 5), vocab_size=300)
    tokenizer.save(base / "tokenizer")
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    save_checkpoint(base / "runs" / "tiny" / "ckpt_000005.pt", model, step=5, tokenizer_dir=str(base / "tokenizer"))
    return base


def test_cli_streams_each_sample(checkpoint, monkeypatch, capsys):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(checkpoint))
    sample.main(["--T=auto", "--T_max=4", "--prompt=The cat", "--num_samples=2", "--max_new_tokens=8"])
    out, err = capsys.readouterr()
    assert out.count("The cat") == 2 and "--- sample 2/2" in out
    assert "ckpt_000005.pt" in err and err.count("recurrent steps per token") == 2
    sample.main(["--T=3", "--prompt=The cat", "--num_samples=2", "--max_new_tokens=8"])
    second = capsys.readouterr().out
    assert out != second  # the depth changed the text
    sample.main(["--T=3", "--prompt=The cat", "--max_new_tokens=8"])
    first_of_two, second_of_two = second.replace("--- sample 1/2", "").split("--- sample 2/2")
    assert first_of_two.strip() == capsys.readouterr().out.strip()  # sample 1 does not depend on num_samples
    sample.main(["--T=3", "--prompt=The cat", "--max_new_tokens=8", "--seed=43"])  # sample i is seeded --seed + i
    assert second_of_two.strip() == capsys.readouterr().out.strip() != first_of_two.strip()


def test_cli_interactive_loop_when_stdin_is_a_terminal(checkpoint, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    prompts = iter(["The dog", "The sun"])

    def fake_input(_):
        try:
            return next(prompts)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(checkpoint))
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr("builtins.input", fake_input)
    sample.main(["--max_new_tokens=4"])
    out, err = capsys.readouterr()
    assert "The dog" in out and "The sun" in out and err.count("tokens/s") == 2


def test_decoding_benchmark_cli(checkpoint, monkeypatch, capsys):
    """python -m experiments.decoding on the checkpoint: both rows, every mode named, and the three caches' losses
    (preallocated, concatenating, recomputed) those of one model."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(checkpoint))
    decoding.main(["--T=2", "--max_new_tokens=6", "--repeats=1"])
    out = capsys.readouterr().out
    depth_row, cache_row = [line for line in out.splitlines() if line.startswith("| 5")]
    for name in ("T=2:", "T=6:", f"auto (state < {decoding.EXIT_THRESHOLDS['state']}):", "auto (kl < 0.0005):"):
        assert name in depth_row
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", cache_row)]
    assert len(losses) == 3 and max(losses) - min(losses) < 1e-4


def test_decoding_row_signs_the_time_of_auto_against_T_max(monkeypatch):
    """auto slower than T_max (its exit tests cost more than the steps they skip) reads "time +25%", faster
    "time -20%": never "--25%". The seconds are made up; the steps and losses are the tiny model's own."""
    model, ids = tiny_model(), torch.tensor([[5, 17, 42, 8, 91, 3, 60, 11, 2, 7, 30, 19]])
    for auto_seconds, expected in ((2.5, "time +25%"), (1.6, "time -20%")):
        seconds = {"T=3": 1.0, "T=6": 2.0}  # mu_rec and T_max = 2 mu_rec; the rest 1 s, auto's auto_seconds
        monkeypatch.setattr(decoding, "median_seconds", lambda fns, *_, **__: {
            name: auto_seconds if name.startswith("auto") else seconds.get(name, 1.0) for name in fns})
        depth_row, _ = decoding.decoding_rows(model, ids, 4, repeats=1)
        result = depth_row[3]
        assert result.startswith(f"auto (state) vs T=6: {expected}, steps "), result
        assert re.match(r"auto \(state\) vs T=6: time [+-]\d+%, steps [+-]\d+%; loss vs T=3 [+-]\d", result), result


def test_parse_depth():
    assert sample.parse_depth("auto") == "auto" and sample.parse_depth("12") == 12
    for bad in ("0", "-3", "2.5", "deep"):
        with raises_naming(argparse.ArgumentTypeError, "--T", repr(bad)):
            sample.parse_depth(bad)


def test_a_seed_beyond_64_bits_is_refused_in_one_line_naming_seed(checkpoint, monkeypatch, capsys):
    """torch's generators take 64-bit seeds: a larger --seed said "Overflow when unpacking long long", naming no flag.
    Signed seeds reach every generator state, the largest with room for --seed + i."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(checkpoint))
    for seed in (2**64, -99999999999999999999, 2**63):
        with pytest.raises(SystemExit) as exit_info:
            run_command(sample.main, ["--prompt=The cat", "--max_new_tokens=2", f"--seed={seed}"])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert carries(err, "--seed", str(seed), "-2**63", "2**63"), err
    for seed in (2**63 - 1, -2**63):
        sample.main(["--prompt=The cat", "--max_new_tokens=2", "--num_samples=2", f"--seed={seed}"])
    assert capsys.readouterr().out.count("The cat") == 4


def one_line_error(base, *args):
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(base)}
    result = python(["sample.py", "--prompt=hi", *args], env)
    assert result.returncode != 0
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.stderr


@pytest.mark.slow
def test_missing_or_corrupt_checkpoint_gives_one_clear_line(tmp_path, checkpoint):
    """Each case under a base folder of its own, so that the four commands run two at a time (one thread each); a
    base folder with no run at all: test_errors.py."""
    early, runs = tmp_path / "early", tmp_path / "runs"
    (early / "runs" / "tiny").mkdir(parents=True)  # a run folder with no checkpoint yet
    save_checkpoint(runs / "tiny" / "ckpt_000005.pt", tiny_model(), tokenizer_dir=str(tmp_path / "gone"))
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    no_tokenizer = tmp_path / "no_tokenizer.pt"
    save_checkpoint(no_tokenizer, tiny_model(), tokenizer_dir=str(tmp_path / "gone"))
    cases = [(early, [f"--ckpt={early / 'runs'}"]), (tmp_path, [f"--ckpt={runs / 'tiny'}"]),
             (tmp_path, [f"--ckpt={tmp_path / 'bad.pt'}"]), (tmp_path, [f"--ckpt={no_tokenizer}"])]
    with ThreadPoolExecutor(2) as pool:
        empty, gone, bad, lacking = pool.map(lambda case: one_line_error(case[0], *case[1]), cases)
    assert carries(empty, str(early / "runs"))
    assert carries(gone, str(runs / "tiny" / "ckpt_000005.pt"), "tiny")  # the folder's newest checkpoint, and its run
    assert carries(bad, str(tmp_path / "bad.pt"), "nanoparcae", "checkpoint") and "remove" not in bad  # not ours
    assert carries(lacking, str(no_tokenizer), "python -m nanoparcae.tokenizer")


@pytest.mark.slow
def test_truncated_checkpoint_gives_one_whole_line_with_the_fix(tmp_path):
    whole = tmp_path / "whole.pt"
    save_checkpoint(whole, tiny_model(), tokenizer_dir=str(tmp_path))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(whole.read_bytes()[:whole.stat().st_size // 2])
    message = one_line_error(tmp_path, f"--ckpt={truncated}").strip()
    # the file, torch's cause cut to its first sentence, then the fix
    assert carries(message, str(truncated), "truncated", "RuntimeError"), message


def test_transformer_baseline_decodes_once_per_token_and_refuses_auto():
    model = tiny_model(injection="none")
    prompt = [1, 5, 9, 2]
    tokens, steps = run(model, prompt, 6, temperature=0)
    reference, _ = run(model, prompt, 6, temperature=0, use_cache=False)
    assert torch.equal(tokens, reference) and (steps == 1).all()
    with raises_naming(ValueError, "T='auto'"):
        run(model, prompt, 2, T="auto")

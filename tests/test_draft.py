"""Tests for self-speculative decoding (engine.drafted) against plain decoding at the same T: the same greedy
tokens, the same cache after a rollback, batches whose rows accept different runs, the same distribution of
sampled tokens; what it refuses; and decoding's memory plan and tiny temperatures."""

import copy
import resource
from types import SimpleNamespace

import pytest
import torch

import engine
import sample
from conftest import awaited, beforehand, carries, raises_naming, train, write_corpus
from engine import Decoder, Draft, Pace, Sampling, drafted, generate
from model import from_weights
from nanoparcae.checkpoint import load_run
from nanoparcae.command import run_command
from test_sample import checkpoint, tiny_model  # noqa: F401 (checkpoint: a fixture)

PROMPTS = [[7], [5, 17, 42, 8, 91, 3, 60], [11, 2, 7, 30, 19, 44, 80, 1, 9, 64, 23, 5]]


def float64_model():
    """A tiny random model in float64 whose greedy text varies (the drafts then disagree at times)."""
    return tiny_model(1, n_recur=1).double()


def tokens(model, prompt, n, seeds=None, **kw):
    """-> (B, n) tokens of generate, row r's h0 and draws from a generator seeded seeds[r] (default r)."""
    generators = [torch.Generator().manual_seed(seed) for seed in seeds or range(len(prompt))]
    return torch.stack([ids for ids, _ in generate(model, prompt, n, generator=generators, **kw)], dim=1)


def spy_on_accept(monkeypatch):
    """-> the list that gets each verify pass's (drafts accepted per row, tokens the batch kept, positions
    drafted, whether a row had tokens verified ahead)."""
    calls = []

    def spied(*args):
        ids, agreed = accept(*args)
        k = ids.size(1)
        calls.append((agreed.tolist(), min(int(agreed.min()) + 1, k), k, bool(args[-1].any())))
        return ids, agreed

    accept = engine.accept
    monkeypatch.setattr(engine, "accept", spied)
    return calls

# -----------------------------------------------------------------------------
# Greedy: the tokens of plain decoding at T

@pytest.mark.parametrize("T, depth, length", [(2, 1, 1), (2, 1, 4), (5, 1, 3), (5, 2, 8), (5, 4, 2), (9, 3, 5)])
def test_greedy_drafted_tokens_equal_plain_decoding(T, depth, length, monkeypatch):
    model, calls = float64_model(), spy_on_accept(monkeypatch)
    for prompt in PROMPTS:
        for n in (1, length + 1, 23):
            plain = tokens(model, [prompt], n, T=T, temperature=0)
            assert torch.equal(tokens(model, [prompt], n, T=T, temperature=0, draft=Draft(depth, length)), plain)
    assert len(set(plain[0].tolist())) > 3  # a varied text, not a repeat any bug would reproduce
    if length > 1:  # drafts both accepted and rejected
        kept = [taken for _, taken, _, _ in calls]
        assert min(kept) < length and max(kept) > 1, kept


def test_rows_that_accept_different_runs_stay_exact(monkeypatch):
    """B = 8 rows of different prompts: each row's greedy tokens are plain decoding's, while in some pass rows
    accepted runs of different lengths, and in some the tokens a row verified ahead of the batch were drafted.
    Each pass drafts the draft's length: paced would mostly decode these disagreeing rows plainly."""
    model, calls = float64_model(), spy_on_accept(monkeypatch)
    monkeypatch.setattr(engine, "paced", lambda pace, most, *_: pace._replace(length=most))
    prompts = torch.randint(0, 97, (8, 6), generator=torch.Generator().manual_seed(4)).tolist()
    plain = tokens(model, prompts, 20, T=6, temperature=0)
    assert torch.equal(tokens(model, prompts, 20, T=6, temperature=0, draft=Draft(2, 4)), plain)
    assert any(min(agreed) != max(agreed) for agreed, _, _, _ in calls), calls
    assert any(ahead for _, _, _, ahead in calls), calls
    for row in (0, 5):  # and each row is what it is alone
        assert torch.equal(tokens(model, [prompts[row]], 20, [row], T=6, temperature=0)[0], plain[row])


@pytest.mark.parametrize("cost", ["calls", "positions"])
def test_paced_drafts_stay_exact_as_k_changes_and_drafting_falls_back(cost, monkeypatch):
    """engine.paced times passes with a clock that counts loop steps: per call (a small model, where a pass over
    k positions costs one position's time), or per position (a large one, where a pass over k costs k). Per call,
    drafting pays, and k grows and shrinks with the acceptance; per position, it cannot pay, so it falls back to
    plain decoding and probes again. Either way the greedy tokens are plain decoding's."""
    model, calls, work = float64_model(), spy_on_accept(monkeypatch), [0]
    loop_step = model.loop_step

    def counted(h, *args):
        work[0] += 1 if cost == "calls" else h.size(1)
        return loop_step(h, *args)

    plain = [tokens(model, [prompt], 60, T=9, temperature=0) for prompt in PROMPTS]
    monkeypatch.setattr(model, "loop_step", counted)
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: work[0]))
    counts = {}
    for prompt, ids in zip(PROMPTS, plain):
        assert torch.equal(tokens(model, [prompt], 60, T=9, temperature=0, draft=Draft(3, 16), counts=counts), ids)
    lengths = [k for _, _, k, _ in calls]
    if cost == "calls":  # k doubles to 16 and halves again
        assert 16 in lengths and any(1 < b < a for a, b in zip(lengths, lengths[1:])), lengths
    else:  # plainly for pauses of 16 and more tokens, a one-position probe after each
        assert counts["plain"] > 100 and lengths.count(1) > 3, (lengths, counts)


def test_a_seeds_sampled_text_does_not_depend_on_how_long_passes_take(monkeypatch):
    """Sampled, drafting is paced by acceptance alone: a clock that makes drafting pay and one that makes it lose
    give the same tokens for the same seeds, as a user rerunning `sample.py --seed=7` expects."""
    model, texts = float64_model(), []
    for per_position in (False, True):
        work = [0]

        def counted(h, *args, loop_step=model.loop_step):
            work[0] += h.size(1) if per_position else 1
            return loop_step(h, *args)

        monkeypatch.setattr(model, "loop_step", counted)
        monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: work[0]))
        texts.append(tokens(model, [PROMPTS[1]] * 2, 40, T=9, temperature=0.8, draft=Draft(3, 16)))
        monkeypatch.undo()
    assert torch.equal(*texts)


def test_the_cache_after_a_rollback_is_plain_decodings(monkeypatch):
    """After every verify pass, the cache's entries of every slot (the coda's overwritten at T included) equal
    those of plain decoding fed the same tokens; at least one pass rolled back past rejected drafts."""
    model, calls = float64_model(), spy_on_accept(monkeypatch)
    ours, plain = (Decoder(model, PROMPTS[1], 24, T=5, generators=[torch.Generator().manual_seed(0)])
                   for _ in range(2))
    compared = []
    for ids, _ in drafted(ours, 24, Draft(2, 5), Sampling(0, None, [None], None), pace=Pace(length=5)):
        plain.next_logits()
        plain.append(ids)
        if plain.length == ours.length:  # the pass's tokens all out: compare
            assert ours.cache.pos == plain.cache.pos == ours.length - 1
            assert torch.equal(ours.tokens[:, :ours.length], plain.tokens[:, :plain.length])
            assert ours.cache.slots.keys() == plain.cache.slots.keys()
            for slot, buffers in plain.cache.slots.items():
                for mine, theirs in zip(ours.cache.slots[slot], buffers):
                    torch.testing.assert_close(mine[:, :, :plain.cache.pos], theirs[:, :, :plain.cache.pos],
                                               rtol=1e-12, atol=1e-12, msg=str(slot))
            compared.append(len(calls))
    rolled_back = [i + 1 for i, (_, taken, k, _) in enumerate(calls) if taken < k]
    assert set(rolled_back) & set(compared), (calls, compared)

# -----------------------------------------------------------------------------
# Sampling: the distribution of plain decoding

def chi_square(counts, expected):
    """Pearson's test of counts (..., cells) against expected (cells,), the cells expecting fewer than 5 pooled
    into one -> (statistics (...), p-values (...), degrees of freedom)."""
    small = expected < 5
    counts = torch.cat([counts[..., ~small], counts[..., small].sum(-1, keepdim=True)], dim=-1)
    expected = torch.cat([expected[~small], expected[small].sum(-1, keepdim=True)])
    keep = expected > 0
    statistic = ((counts[..., keep] - expected[keep]) ** 2 / expected[keep]).sum(-1)
    df = int(keep.sum()) - 1
    return statistic, torch.special.gammaincc(torch.tensor(df / 2, dtype=statistic.dtype), statistic / 2), df


def test_sampled_tokens_are_distributed_as_plain_decodings(monkeypatch):
    """The first two tokens sampled with drafts of two, at temperature 0.3 on a 4-token vocabulary: their joint
    distribution over 16 cells is plain decoding's, computed exactly from its logits (chi-square, 1,000 samples,
    500 batches of two rows with one h0, so that a row's second token is at times one it verified ahead). Power:
    the same test rejects a sampler that always accepts the draft (the drafts' own distribution) with probability
    >= 0.99 at the 0.001 level, estimated from 2,000 draws of that distribution."""
    model, temperature, n = tiny_model(1, vocab_size=4, d_model=32, head_dim=16, n_recur=1), 0.3, 1000
    calls = spy_on_accept(monkeypatch)
    prefilled = Decoder(model, [[1, 2, 3]] * 2, 2, T=4, generators=[torch.Generator().manual_seed(0) for _ in "ab"])

    def fresh():
        decoder = copy.copy(prefilled)  # the model and h0 shared, the cache and tokens its own
        decoder.cache, decoder.tokens = copy.deepcopy(prefilled.cache), prefilled.tokens.clone()
        return decoder

    def chain(logits):  # P(x0, x1) = p(x0) p(x1 | x0) of logits(decoder) (1, V), flattened to 16 cells
        def p(*prefix):
            decoder = fresh()
            for x in prefix:
                logits(decoder)
                decoder.append(torch.tensor([x]))
            return engine.probabilities(logits(decoder), temperature, None)[0].double()
        return torch.cat([p()[x0] * p(x0) for x0 in range(4)])

    expected = chain(lambda decoder: decoder.next_logits()[0])
    always_accepted = chain(lambda decoder: engine.draft_logits(decoder, 1)[0])
    counts = torch.zeros(16, dtype=torch.float64)
    for i in range(n // 2):
        generators = [torch.Generator().manual_seed(seed + i) for seed in (1000, 5000)]
        x0, x1 = drafted(fresh(), 2, Draft(1, 2), Sampling(temperature, None, generators, None), pace=Pace(length=2))
        counts.index_add_(0, 4 * x0[0] + x1[0], torch.ones(2, dtype=torch.float64))
    assert any(ahead for _, _, _, ahead in calls)
    statistic, p_value, df = chi_square(counts, n * expected)
    assert p_value > 1e-3, (statistic, df, counts.tolist(), (n * expected).tolist())
    torch.manual_seed(0)  # the test's power against always accepting, by simulation
    _, p_values, _ = chi_square(torch.distributions.Multinomial(n, always_accepted).sample((2000,)), n * expected)
    assert (p_values < 1e-3).double().mean() >= 0.99

# -----------------------------------------------------------------------------
# What drafting refuses, and the command line

def test_drafting_refuses_what_it_cannot_make_exact():
    model = float64_model()
    for kw, named in [(dict(T="auto"), ["T='auto'"]), (dict(kv="shared"), ["kv='shared'"]),
                      (dict(use_cache=False), ["use_cache=False"]), (dict(T=3, draft=Draft(3, 4)), ["3", "T=3"])]:
        with raises_naming(ValueError, *named):
            next(generate(model, PROMPTS[1], 4, **{"draft": Draft(1, 4), **kw}))
    with raises_naming(ValueError, "Transformer"):
        next(generate(tiny_model(injection="none"), PROMPTS[1], 4, draft=Draft(1, 4)))


def test_sample_py_drafts_token_for_token_and_refuses_in_one_line(checkpoint, monkeypatch, capsys):  # noqa: F811
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(checkpoint))
    texts = {}
    for draft in ("off", "2,3", "1,8"):
        sample.main(["--T=5", "--prompt=The cat", "--max_new_tokens=20", "--temperature=0", f"--draft={draft}"])
        texts[draft], err = capsys.readouterr()
    assert texts["off"] == texts["2,3"] == texts["1,8"] and "accepted" in err
    sample.main(["--T=5", "--prompt=The cat", "--max_new_tokens=8", "--num_samples=2", "--draft=2,3"])
    assert capsys.readouterr().out.count("The cat") == 2
    for flags, named in [(["--T=auto", "--draft=2,3"], ["T='auto'"]), (["--kv=shared", "--draft=2,3"], ["kv='shared'"]),
                         (["--T=2", "--draft=2,3"], ["T=2"]), (["--draft=0,3"], ["--draft", "'0,3'"]),
                         (["--draft=4"], ["--draft", "'4'"])]:
        with pytest.raises(SystemExit) as exit_info:
            run_command(sample.main, ["--prompt=The cat", "--max_new_tokens=4", *flags])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and carries(err, *named), err


def test_auto_drafts_only_where_it_can_pay():
    model = float64_model()  # mu_rec 3
    assert engine.auto_draft(model, 1) is None and engine.auto_draft(model, None) is None
    assert engine.auto_draft(model, 4 * 3 - 1) is None and engine.auto_draft(model, 4 * 3) is not None
    deep = engine.auto_draft(model, 32)
    assert deep is not None and 1 <= deep.depth < 32
    assert engine.auto_draft(tiny_model(injection="none"), 32) is None

# -----------------------------------------------------------------------------
# Decoding's plan: memory before the cache, temperatures float32 cannot divide by

def test_a_cache_that_cannot_fit_is_refused_before_it_is_allocated(monkeypatch):
    model = float64_model()
    monkeypatch.setattr(engine, "free_memory", lambda device: 10**8)
    monkeypatch.setattr(engine.KVCache, "__init__", lambda *_: pytest.fail("allocated"))
    for kw, named in [(dict(T=10**6), ["T=1000000"]), (dict(T="auto", T_max=10**6), ["T=1000000"])]:
        with raises_naming(ValueError, *named):
            next(generate(model, PROMPTS[1], 4, **kw))
    needs = engine.decoding_bytes(model, 1, 11, 10**6, "steps")
    assert needs == ((1 + 1 + 10**6) * 2 * 8 + 4) * 11 * 64  # slots x (k, v) x float64, then h0's float32
    assert engine.decoding_bytes(model, 1, 11, 10**6, "shared") == (3 * 2 * 8 + 4) * 11 * 64


def test_the_memory_plan_sees_an_address_space_limit(monkeypatch):
    """Under `ulimit -v` an allocation fails long before the system's memory runs out, so the plan takes what the
    limit leaves, the limit less the address space in use: T = 10^5 (about 1.1 GB) is refused with 100 MB left."""
    with open("/proc/self/status") as status:
        used = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    getrlimit = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda which: (used + 10**8, resource.RLIM_INFINITY)
                        if which == resource.RLIMIT_AS else getrlimit(which))
    assert 0.9e8 < engine.free_memory(torch.device("cpu")) <= 1.1e8
    monkeypatch.setattr(engine.KVCache, "__init__", lambda *_: pytest.fail("allocated"))
    with raises_naming(ValueError, "T=100000", "--kv=shared"):
        next(generate(float64_model(), PROMPTS[1], 4, T=10**5))


def test_sample_py_refuses_a_depth_beyond_memory_in_one_line(checkpoint, monkeypatch, capsys):  # noqa: F811
    """At T = 10^6 the tiny model's cache of a few positions needs gigabytes: refused with 1 GB free."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(checkpoint))
    monkeypatch.setattr(engine, "free_memory", lambda device: 10**9)
    for flags in (["--T=1000000"], ["--T=auto", "--T_max=1000000"]):
        with pytest.raises(SystemExit) as exit_info:
            run_command(sample.main, ["--prompt=The cat", "--max_new_tokens=4", *flags])
        label, *refusal = [line for line in capsys.readouterr().err.splitlines() if line]
        assert exit_info.value.code == 2 and len(refusal) == 1 and refusal[0].startswith("error: "), refusal
        assert carries(refusal[0], "T=1000000", "--kv=shared") and "parameters" in label, refusal


def test_a_temperature_below_float32s_reach_is_greedy():
    model = tiny_model(1, n_recur=1)
    greedy = tokens(model, [PROMPTS[1]], 10, T=3, temperature=0)
    for temperature in (1e-30, 1e-40, 1e-50):
        assert torch.equal(tokens(model, [PROMPTS[1]], 10, T=3, temperature=temperature, top_k=5), greedy)
        assert torch.equal(tokens(model, [PROMPTS[1]], 10, T=3, temperature=temperature, draft=Draft(1, 3)), greedy)
        if not engine.greedy(temperature):  # divided by, yet every logit but the largest overflows
            probs = engine.probabilities(torch.tensor([[3.0, 1.0, 3.0 - 1e-6]]), temperature, None)
            assert not probs.isnan().any() and probs[0, 0] == 1


# -----------------------------------------------------------------------------
# A trained model in float32

def drafted_run(folder):
    """A small model trained on the tiny corpus in folder, 65,536 tokens -> its newest checkpoint."""
    write_corpus(folder / "corpus.txt")
    train(folder, "--max_tokens=65536", "--total_batch_size=512", "--device_batch_size=16", "--run=drafted")
    return max((folder / "base" / "runs" / "drafted").glob("ckpt_*.pt"))


@pytest.mark.slow
@beforehand(drafted_run)
def test_a_trained_model_drafts_256_greedy_tokens_of_plain_decoding():
    """A small model trained on the tiny corpus, float32: 256 greedy tokens at T = 32 drafted at depth 3 (its
    mu_rec), 8 at a time, are plain decoding's; most drafts are accepted."""
    ckpt, tokenizer, _ = load_run(ckpt=awaited(drafted_run))
    model = from_weights(ckpt["config"], ckpt["model"])
    prompt = tokenizer.encode("the loop", prepend_bos=True)
    counts = {}
    plain = tokens(model, [prompt], 256, T=32, temperature=0)
    assert torch.equal(tokens(model, [prompt], 256, T=32, temperature=0, draft=Draft(3, 8), counts=counts), plain)
    assert counts["agreed"] > counts["drafted"] / 2, counts
    assert len(set(plain[0].tolist())) > 10

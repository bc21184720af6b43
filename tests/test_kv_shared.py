"""Tests for engine.py's shared KV cache (kv="shared"): exact at T = 1, and beyond it equal to the rule written
plainly, each earlier position seen at the recurrent layers through the keys and values of its last step."""

import pytest
import torch

from engine import Decoder, KVCache, forced_logits, generate
from experiments import decoding
from model import initial_state
from test_sample import tiny_model

IDS = torch.tensor([[5, 17, 42, 8, 91, 3, 60, 11, 29, 74, 2, 88, 40, 19, 63, 7]])
PROMPT = 6  # tokens of IDS given as the prompt; the rest are fed back teacher-forced


class FinalStepKV:
    """The shared cache's rule without KVCache: per layer, a list of each position's keys and values. A forward
    over new positions replaces their entries at every call, so a recurrent layer's entry ends at its last step."""

    def __init__(self):
        self.entries, self.pos = {}, 0  # (part, layer) -> [(k, v) of one position, (B, H, 1, D) each]

    def claim(self, length):
        self.pos += length

    def update(self, slot, k, v):
        entries = self.entries.setdefault((slot.part, slot.layer), [])
        del entries[self.pos - k.size(2):]
        entries += [(k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(k.size(2))]
        return torch.cat([k for k, _ in entries], dim=2), torch.cat([v for _, v in entries], dim=2)


def h0_of(ids):
    """The h0 Decoder draws for ids (B, S) with one generator seeded 0, row after row."""
    generator = torch.Generator().manual_seed(0)
    return initial_state((*ids.shape, 64), "cpu", [generator] * ids.size(0))


@torch.no_grad()
def final_step_reference(model, ids, T, h0=None, depths=None):
    """Logits of ids (1, S) past PROMPT by the rule: the prompt but its last token in one forward into a
    FinalStepKV, then one position at a time, the i-th at depths[i] steps (default T). -> (1, S - PROMPT, V)."""
    cache, h0 = FinalStepKV(), h0_of(ids) if h0 is None else h0
    model(ids[:, :PROMPT - 1], T=T, h0=h0[:, :PROMPT - 1], cache=cache)
    logits = []
    for i, p in enumerate(range(PROMPT - 1, ids.size(1) - 1)):
        depth = T if depths is None else int(depths[i])
        logits.append(model(ids[:, p:p + 1], T=depth, h0=h0[:, p:p + 1], cache=cache)[:, -1])
    return torch.stack(logits, dim=1)


def cached(model, ids, T, kv, **decoding):
    """engine.forced_logits of ids past PROMPT -> (logits (B, S - PROMPT, V), steps (B, S - PROMPT))."""
    out = list(forced_logits(model, ids, PROMPT, T, kv=kv, **decoding))
    return torch.stack([logits for logits, _ in out], dim=1), torch.stack([steps for _, steps in out], dim=1)


@pytest.mark.parametrize("kv", ["steps", "shared"])
def test_at_T_1_both_caches_equal_full_recomputation(kv):
    model = tiny_model()
    with torch.no_grad():
        full = model(IDS[:, :-1], T=1, h0=h0_of(IDS)[:, :-1])[:, PROMPT - 1:]
    logits, _ = cached(model, IDS, 1, kv)
    torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)
    # greedy decoding: each token against the whole sequence recomputed
    tokens = torch.stack([ids for ids, _ in generate(model, IDS[:, :PROMPT], 10, T=1, temperature=0,
                                                      generator=torch.Generator().manual_seed(0), kv=kv)], 1)
    seq, h0 = IDS[:, :PROMPT], h0_of(IDS)
    with torch.no_grad():
        for _ in range(10):
            seq = torch.cat([seq, model(seq, T=1, h0=h0[:, :seq.size(1)])[:, -1:].argmax(-1)], dim=1)
    assert tokens.tolist() == seq[:, PROMPT:].tolist() and len(set(tokens[0].tolist())) > 1


@pytest.mark.parametrize("T", [3, 8])
def test_shared_equals_the_final_step_rule(T):
    model = tiny_model()
    shared, _ = cached(model, IDS, T, "shared")
    reference = final_step_reference(model, IDS, T)
    torch.testing.assert_close(shared, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(shared.argmax(-1), reference.argmax(-1))
    # beyond T = 1 the rule is not the exact cache's, so agreement above is not the exact cache's either
    exact, _ = cached(model, IDS, T, "steps")
    assert (shared - exact).abs().max() > 1e-3


def test_shared_at_T_auto_leaves_each_position_at_the_step_it_stopped():
    model = tiny_model()
    shared, steps = cached(model, IDS, "auto", "shared", T_max=6, exit_threshold=0.25)
    assert 1 < len(set(steps[0].tolist())) and steps.max() <= 6  # positions stopped at different steps
    reference = final_step_reference(model, IDS, 6, depths=steps[0])
    torch.testing.assert_close(shared, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(shared.argmax(-1), reference.argmax(-1))


def test_shared_at_T_auto_rows_in_a_batch_equal_each_row_alone():
    """A row that stopped keeps its entry at its own last step while the batch's other rows loop on."""
    model = tiny_model()
    ids = torch.cat([IDS, IDS.flip(1)])
    batch, steps = cached(model, ids, "auto", "shared", T_max=6, exit_threshold=0.25)
    assert (steps[0] != steps[1]).any()
    h0 = h0_of(ids)
    for r in range(2):
        reference = final_step_reference(model, ids[r:r + 1], 6, h0[r:r + 1], depths=steps[r])
        torch.testing.assert_close(batch[r:r + 1], reference, rtol=1e-5, atol=1e-5)


def test_shared_cache_holds_T_1s_memory_whatever_T():
    model = tiny_model()  # 1 prelude, 2 recurrent and 1 coda layer

    def cache_of(T, kv, **decoding):
        decoder = Decoder(model, IDS[0, :PROMPT], 4, T, kv=kv, **decoding)
        decoder.next_logits()
        return decoder.cache

    one = cache_of(1, "steps").nbytes()
    assert one == 4 * 2 * IDS[0, :PROMPT + 4].numel() * 64 * 4  # 4 slots of k and v, float32
    assert cache_of(8, "steps").nbytes() == (2 + 2 * 8) / 4 * one
    for T in (1, 8, "auto"):
        cache = cache_of(T, "shared", T_max=8)
        assert cache.nbytes() == one and not cache.stacks
    assert isinstance(cache, KVCache) and cache.shared


def test_kv_comparison_rows_and_figure(monkeypatch, tmp_path):
    """experiments.decoding --kv on the tiny model: bytes counted equal to kv_bytes' count, a loss row per T with its
    interval around its mean, and the figure written. The timings are made up."""
    monkeypatch.setattr(decoding, "median_seconds", lambda fns, *_, **__: {name: 1.0 for name in fns})
    monkeypatch.setattr(decoding, "LOSS_TS", (4, "auto"))
    model = tiny_model(seq_len=64)
    docs = torch.randint(0, 97, (3, decoding.PROMPT + 6), generator=torch.Generator().manual_seed(0))
    rows, data = decoding.kv_rows(model, docs, 8, repeats=1)
    assert rows[0][4].endswith(": met") and data["bytes"][64, "steps"] == (2 + 2 * 64) / 4 * data["bytes"][1, "steps"]
    for T in decoding.LOSS_TS:
        mean, lo, hi = data["loss"][T]
        assert lo < mean < hi
        assert any(row[0] == f"kv-loss T={T}" and f"{mean:+.2e}" in row[3] for row in rows)
    decoding.save_png(decoding.draw_kv(data, "tiny"), tmp_path / "kv.png")
    assert (tmp_path / "kv.png").stat().st_size > 10_000

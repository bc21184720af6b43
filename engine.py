"""
engine.py: decoding, the model of METHOD.md §1 run one position at a time, for sample.py.

    for ids, steps in generate(model, tokens, 64, T="auto", top_k=50):   # token after token
        ...
    loss, steps_per_token = teacher_forced(model, ids, prompt_len, T=8)  # loss on known text
"""

import math
import resource
import time
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from model import initial_state
from nanoparcae.command import size

# -----------------------------------------------------------------------------
# The KV cache, and the memory it is planned against

KV_CACHES = ("steps", "shared")


class KVCache:
    """Keys and values written in place (as nanochat), a pair of buffers per model.Slot.
    shared=True gives a recurrent layer one slot for all its steps, exact only at T = 1, since
    earlier positions are then seen at their last step. With `loop_steps` a layer's steps view
    one tensor, so one copy fills the steps an early exit skipped."""

    def __init__(self, max_len, loop_steps=None, shared=False):
        self.max_len, self.loop_steps, self.shared = max_len, loop_steps, shared
        self.slots = {}  # model.Slot -> (k, v) buffers, each (B, H, max_len, D)
        self.stacks = {}  # recurrent layer i -> (loop_steps, 2, B, H, max_len, D), when given
        self.pos = 0  # positions claimed so far, those of the forward under way included
        self.frozen = None  # shared, the rows (B, 1, 1, 1) whose entries stay at their last step

    def claim(self, length):
        """Claim the next forward's `length` positions, before any layer writes."""
        if self.pos + length > self.max_len:
            raise ValueError(f"{self.pos + length} positions exceed the KV cache's {self.max_len}; "
                             f"size it for the prompt and every new token")
        self.pos += length

    def buffers(self, slot, like):
        """The slot's (k, v) buffers, allocated like `like` at the first call."""
        if self.shared:
            slot = slot._replace(step=0)
        if slot not in self.slots:
            shape = (*like.shape[:2], self.max_len, like.size(3))  # (B, H, max_len, D)
            if slot.part == "recur" and slot.step < (self.loop_steps or 0):
                if slot.layer not in self.stacks:
                    self.stacks[slot.layer] = like.new_zeros(self.loop_steps, 2, *shape)
                self.slots[slot] = tuple(self.stacks[slot.layer][slot.step])
            else:
                self.slots[slot] = tuple(like.new_zeros(shape) for _ in range(2))
        return self.slots[slot]

    def update(self, slot, k, v):
        """Write the newest positions' k and v, and return every cached position's as views.
        A frozen row's recurrent entries keep what they hold."""
        k_buf, v_buf = self.buffers(slot, k)
        new = slice(self.pos - k.size(2), self.pos)
        if self.frozen is not None and slot.part == "recur":
            k = torch.where(self.frozen, k_buf[:, :, new], k)
            v = torch.where(self.frozen, v_buf[:, :, new], v)
        k_buf[:, :, new], v_buf[:, :, new] = k, v
        return k_buf[:, :, :self.pos], v_buf[:, :, :self.pos]

    def nbytes(self):
        """Bytes held by the cache's buffers, each storage counted once."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for kv in self.slots.values() for t in kv}
        return sum(storages.values())


def decoding_bytes(model, rows, positions, depth, kv):
    """Bytes decoding allocates, for the KV cache's buffers at `depth` loop steps and every h0.
    Under autocast the keys and values take its dtype, else the weights'."""
    c, device = model.config, model.wte.weight.device
    itemsize = (torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type)
                else model.wte.weight.dtype).itemsize
    looped_slots = 1 if kv == "shared" or model.injection is None else depth
    slots = c.n_prelude + c.n_coda + c.n_recur * looped_slots
    return (slots * 2 * itemsize + 4) * rows * positions * c.d_model


def free_memory(device):
    """Bytes the device can still allocate. On the CPU that is the system's available memory,
    or less where an address-space limit (ulimit -v) leaves this process less."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo, open("/proc/self/status") as status:
            kb = dict(line.split()[:2] for line in [*meminfo, *status] if len(line.split()) > 1)
        available, used = int(kb["MemAvailable:"]) * 1024, int(kb["VmSize:"]) * 1024
    except (OSError, KeyError):  # not Linux, so nothing to plan against
        return math.inf
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    return available if limit == resource.RLIM_INFINITY else min(available, limit - used)

# -----------------------------------------------------------------------------
# One token from the logits

def greedy(temperature):
    """Whether temperature samples greedily, being 0 or too small for float32 to divide by."""
    return temperature < torch.finfo(torch.float32).tiny


def top_probabilities(logits, temperature, top_k):
    """logits (..., V) -> (probabilities of the top_k ids, those ids), all V and None without top_k.
    The largest logit is subtracted first, so a small temperature overflows to no NaN."""
    ids = None
    if top_k is not None:
        logits, ids = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    return scaled.softmax(dim=-1), ids


def draw(probs, generators):
    """One id per row of probs (B, V), row r drawn with generators[r]."""
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


def sample_next(logits, temperature, top_k, generators):
    """logits (B, V) -> ids (B,), the argmax at temperature 0, else a draw among the top_k.
    Drawing among the top_k alone is far cheaper than over the vocabulary (as nanochat)."""
    if greedy(temperature):
        return logits.argmax(dim=-1)
    probs, ids = top_probabilities(logits, temperature, top_k)
    choice = draw(probs, generators)  # (B,)
    return choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)


class Sampling(NamedTuple):
    """How generate picks each row's token from its logits, with one generator per row."""
    temperature: float
    top_k: int | None
    generators: list
    allowed: torch.Tensor | None  # a bool mask of the ids that may be sampled

    def masked(self, logits):
        return logits if self.allowed is None else logits.masked_fill(~self.allowed, -math.inf)

    def pick(self, logits):  # masked logits (B, V) -> ids (B,)
        return sample_next(logits, self.temperature, self.top_k, self.generators)

# -----------------------------------------------------------------------------
# One new position: the recurrence at a fixed depth, or stopped per row when it settles

EXITS = ("state", "kl")
# T="auto"'s default thresholds, chosen by hand, not swept. On the CPU default checkpoint,
# "state" 0.15 keeps the teacher-forced loss within 0.01% of fixed T = mu_rec (docs/performance.md)
EXIT_THRESHOLDS = {"state": 0.15, "kl": 5e-4}


def relative_change(new, old):
    """||h_t - h_{t-1}|| / ||h_t|| per row."""
    return (new - old).norm(dim=(1, 2)) / new.norm(dim=(1, 2))


def decode_step(model, idx, cache, h0, T, exit=None, threshold=0.0, A_bar=None):
    """Run idx (B, 1), the position after the cached ones -> (logits (B, 1, V), steps (B,)).
    exit=None runs T steps. Otherwise row r stops after step t >= 2 once its test falls under
    threshold, while the others run on. The "state" test (relative_change) costs far less than
    a step, so the coda runs once. The "kl" test, KL(p_t || p_{t-1}), runs it every step."""
    Bbar_e, ves, cos, sin = model.run_prelude(idx, cache)
    A_bar = model.injection.A_bar() if A_bar is None else A_bar
    h, B = h0.to(Bbar_e.dtype), idx.size(0)
    if exit is None:  # fixed depth: T steps, then the coda
        for step in range(T):
            h = model.loop_step(h, Bbar_e, A_bar, step, ves, cos, sin, cache)
        return model.run_coda(h, ves, cos, sin, cache), torch.full((B,), T)
    # adaptive depth. Python lists, because at B = 1 a tensor op costs as much as a small matmul
    steps, done, logits, prev_logp = [T] * B, [False] * B, None, None
    for step in range(T):
        stepped = model.loop_step(h, Bbar_e, A_bar, step, ves, cos, sin, cache)
        change = relative_change(stepped, h) if exit == "state" and step > 0 else None
        h = (torch.where(torch.tensor(done, device=h.device)[:, None, None], h, stepped)
             if any(done) else stepped)
        if exit == "kl":  # the coda's slot, rewritten each step, ends at each row's last state
            logits = model.run_coda(h, ves, cos, sin, cache)
            logp = logits[:, -1].log_softmax(dim=-1)
            if prev_logp is not None:  # clamped at 0 (rounding), so threshold 0 never exits
                change = (logp.exp() * (logp - prev_logp)).sum(dim=-1).clamp(min=0)
            prev_logp = logp
        if change is not None:  # stop the rows whose test fell under the threshold
            for r, value in enumerate(change.tolist()):
                if not done[r] and value < threshold:
                    done[r], steps[r] = True, step + 1
            if all(done):
                break
            if cache is not None and cache.shared and any(done):
                cache.frozen = torch.tensor(done, device=h.device)[:, None, None, None]
    # after an early exit the shared cache unfreezes, and the steps cache fills what was skipped
    if cache is not None and cache.shared:
        cache.frozen = None
    elif cache is not None and any(done):
        fill_skipped_steps(cache, steps, T)
    return ((model.run_coda(h, ves, cos, sin, cache) if logits is None else logits),
            torch.tensor(steps))


def fill_skipped_steps(cache, steps, T_max):
    """Copy each row's last step into the steps it skipped, which later tokens read."""
    if cache.loop_steps is None or cache.loop_steps < T_max:
        raise ValueError(f"an early exit fills the steps it skipped in the cache's stacks, so "
                         f"build the cache as KVCache(max_len, loop_steps={T_max})")
    for r, ran in enumerate(steps):
        for stack in cache.stacks.values():  # (loop_steps, 2, B, H, max_len, D)
            stack[ran:T_max, :, r, :, cache.pos - 1] = stack[ran - 1, :, r, :, cache.pos - 1]

# -----------------------------------------------------------------------------
# Decoding: the prompt but its last token prefilled, then one position at a time

class Decoder:
    """Next-token logits for a batch of prompts, one position per call; append() feeds a token back.
    T is an int >= 1, None for mu_rec, or "auto" (up to T_max, default 2 mu_rec).
    use_cache=False recomputes the sequence for every token, the reference at a fixed T."""

    def __init__(self, model, tokens, max_new_tokens, T=None, generators=(None,), exit="state",
                 exit_threshold=None, T_max=None, use_cache=True, kv="steps"):
        c, device = model.config, model.wte.weight.device
        idx = torch.atleast_2d(torch.as_tensor(tokens, dtype=torch.long, device=device))  # (B, S)
        if idx.size(1) > c.seq_len:
            warnings.warn(f"the prompt's {idx.size(1)} tokens exceed seq_len={c.seq_len}, so it "
                          f"is cropped from the left to the last {c.seq_len}")
            idx = idx[:, -c.seq_len:]
        # the options and the memory, checked before anything is allocated
        adaptive, positions = T == "auto", idx.size(1) + max_new_tokens
        if adaptive and (not use_cache or model.injection is None):
            raise ValueError(f"T='auto' needs the KV cache and a looped model (here "
                             f"use_cache={use_cache}, injection={c.injection!r})")
        if exit not in EXITS or kv not in KV_CACHES:
            raise ValueError(f"exit={exit!r} and kv={kv!r} must be in {EXITS} and {KV_CACHES}")
        if positions > model.rope_cos.size(1):
            raise ValueError(f"{positions} positions (prompt + max_new_tokens) exceed the "
                             f"RoPE table's {model.rope_cos.size(1)}; lower max_new_tokens")
        self.model, self.T = model, (T_max or 2 * c.mu_rec) if adaptive else (T or c.mu_rec)
        needs, free = decoding_bytes(model, len(idx), positions, self.T, kv), free_memory(device)
        if use_cache and needs > free:
            raise ValueError(f"decoding at T={self.T} needs {size(needs)} for its KV cache "
                             f"({len(idx)} rows of {positions} positions), more than the "
                             f"{size(free)} free on {device}; lower --T or --T_max, "
                             f"or use --kv=shared")
        self.exit = exit if adaptive else None
        self.threshold = EXIT_THRESHOLDS[exit] if exit_threshold is None else exit_threshold
        # every position's h0 drawn up front, so it does not depend on the tokens sampled
        self.generators = list(generators) * (len(idx) // len(generators))  # one per row
        self.h0 = initial_state((len(idx), positions, c.d_model), device, self.generators)
        self.tokens = torch.zeros(len(idx), positions, dtype=torch.long, device=device)
        self.tokens[:, :idx.size(1)], self.length = idx, idx.size(1)
        # stacked steps only for T="auto" on the steps cache, whose early exits fill those skipped
        loop_steps = self.T if adaptive and kv == "steps" else None
        self.cache = KVCache(positions, loop_steps, kv == "shared") if use_cache else None
        # eager even under compiled regions (model.compile_regions), as each token's cache is new
        with torch.inference_mode(), torch.compiler.set_stance("force_eager"):
            # A_bar does not change while decoding, so it is formed once
            self.A_bar = model.injection.A_bar() if model.injection is not None else None
            # prefill the prompt but its last token, which next_logits runs like any new token
            if self.cache is not None and self.length > 1:
                model(idx[:, :-1], T=self.T, h0=self.h0[:, :self.length - 1], cache=self.cache)

    @torch.inference_mode()
    def next_logits(self):
        """-> (logits (B, V) of the next position, recurrent steps (B,) each row took)."""
        with torch.compiler.set_stance("force_eager"):  # as the prefill
            n, model, B = self.length, self.model, self.tokens.size(0)
            if self.cache is not None and model.injection is not None:
                logits, steps = decode_step(model, self.tokens[:, n - 1:n], self.cache,
                                            self.h0[:, n - 1:n], self.T, self.exit,
                                            self.threshold, self.A_bar)
                return logits[:, -1], steps
            start = n - 1 if self.cache is not None else 0  # without the cache, all of it again
            logits = model(self.tokens[:, start:n], T=self.T, h0=self.h0[:, start:n],
                           cache=self.cache)
            return logits[:, -1], torch.full((B,), self.T if model.injection is not None else 1)

    def append(self, ids):
        """ids (B,) holds the next token of every row."""
        self.tokens[:, self.length] = ids
        self.length += 1


def generate(model, tokens, max_new_tokens, T=None, temperature=1.0, top_k=None, generator=None,
             exit="state", exit_threshold=None, T_max=None, use_cache=True, allowed=None,
             kv="steps", draft=None, counts=None):
    """Yield (ids (B,), steps (B,)) per new token, each row's token and its recurrent steps.
    tokens is a list of ids or a (B, S) tensor. generator is one, or one per row (None for the
    global RNG). allowed is a bool mask of the ids that may be sampled. The rest are Decoder's.
    A draft decodes self-speculatively (drafted, the last section), and counts gets its tallies."""
    generators = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    decoder = Decoder(model, tokens, max_new_tokens, T, generators, exit, exit_threshold, T_max,
                      use_cache, kv)
    sampling = Sampling(temperature, top_k, decoder.generators, allowed)
    if draft is not None:  # plain decoding's distribution, several positions a pass
        check_draft(model, T, kv, use_cache, draft)
        yield from drafted(decoder, max_new_tokens, draft, sampling, counts)
        return
    for _ in range(max_new_tokens):
        logits, steps = decoder.next_logits()
        next_ids = sampling.pick(sampling.masked(logits))
        yield next_ids, steps
        decoder.append(next_ids)


def forced_logits(model, ids, prompt_len, T=None, seed=0, **decoding):
    """Yield (logits (B, V), steps (B,)) of each position of ids (B, S) from prompt_len on.
    They are decoded as generate decodes them (with Decoder's options), fed the true tokens."""
    generator = torch.Generator(model.wte.weight.device).manual_seed(seed)
    decoder = Decoder(model, ids[:, :prompt_len], ids.size(1) - prompt_len, T, [generator],
                      **decoding)
    for p in range(prompt_len, ids.size(1)):
        yield decoder.next_logits()
        decoder.append(ids[:, p])


def teacher_forced(model, ids, prompt_len, T=None, seed=0, **decoding):
    """forced_logits -> (mean cross-entropy, mean recurrent steps per token)."""
    losses, steps = [], []
    for p, (logits, ran) in enumerate(forced_logits(model, ids, prompt_len, T, seed, **decoding),
                                      prompt_len):
        losses.append(F.cross_entropy(logits.float(), ids[:, p], reduction="none"))
        steps.append(ran)
    return torch.cat(losses).mean().item(), torch.cat(steps).float().mean().item()

# -----------------------------------------------------------------------------
# Drafting (beyond the paper): the looped model drafts for itself, several positions a pass.

class Draft(NamedTuple):
    """Up to `length` positions a pass drafted at `depth` loop steps (paced picks how many)."""
    depth: int
    length: int


# auto's draft, from a sweep of depth and length on the CPU checkpoint (docs/sampling.md).
# Depth mu_rec - 1, up to 32 positions a pass, where T >= 4 mu_rec; at 2 mu_rec drafting lost.
DRAFT_LENGTH, DRAFT_MIN_RATIO = 32, 4


def auto_draft(model, T=None, kv="steps"):
    """sample.py's --draft=auto at depth T (None for mu_rec), or None to decode plainly.
    It drafts where drafting is exact and T >= DRAFT_MIN_RATIO mu_rec, where it paid."""
    mu_rec = model.config.mu_rec
    if (model.injection is None or T == "auto" or kv != "steps"
            or (T or mu_rec) < DRAFT_MIN_RATIO * mu_rec):
        return None
    return Draft(max(1, mu_rec - 1), DRAFT_LENGTH)


def check_draft(model, T, kv, use_cache, draft):
    """Refuse a draft that cannot be exact, as it must continue a fixed-depth loop's exact cache."""
    if model.injection is None:
        raise ValueError("drafting needs a looped model; this is the fixed-depth Transformer")
    if T == "auto" or kv != "steps" or not use_cache:
        raise ValueError(f"drafting is exact only at a fixed T through the exact cache "
                         f"(kv='steps'), not at T={T!r}, kv={kv!r}, use_cache={use_cache}")
    T = T or model.config.mu_rec
    if not (1 <= draft.depth < T and draft.length >= 1):
        raise ValueError(f"a draft of depth {draft.depth} and length {draft.length} needs "
                         f"1 <= depth < T={T} and length >= 1")


class Pace(NamedTuple):
    """drafted's plan for its next pass, and what it measured so far (running means)."""
    length: int = 0  # the positions the next pass drafts, 0 to decode one token plainly
    wait: int = 1  # plain tokens left before drafting again, so the first one is timed
    pause: int = 16  # the plain tokens after the next failure, doubled at each
    plain: float = math.nan  # seconds per plain token
    speedup: float = math.nan  # tokens per second drafting over plain decoding's, since a probe


def mean(old, new):
    """A running mean that halves the weight of the past at each new value."""
    return new if math.isnan(old) else (old + new) / 2


def paced(pace, most, accepted, seconds):
    """The Pace after a pass of pace.length drafts (0 for a plain token) in `seconds`, of which
    every row accepted `accepted`. It picks how many positions to draft, never a token, so that
    drafting goes on only while it pays (the rule is docs/sampling.md's)."""
    k = pace.length
    if k == 0:  # a plain token, timed; after the wait, a probe
        return pace._replace(length=int(pace.wait == 1), wait=pace.wait - 1, speedup=math.nan,
                             plain=mean(pace.plain, seconds))
    # a probe keeps one token at any rate, so only its acceptance counts (nan until a plain token)
    speedup = pace.speedup if k == 1 else mean(pace.speedup, min(accepted + 1, k) * pace.plain
                                                / seconds)
    if (accepted == 0 if k == 1 else speedup < 1):  # drafting does not pay: plainly for a while
        return pace._replace(length=0, wait=pace.pause, pause=2 * pace.pause)
    length = min(2 * k, most) if accepted == k else k // 2 if 2 * accepted < k else k
    return pace._replace(length=length, speedup=speedup,
                         pause=pace.pause if k == 1 else Pace().pause)


def drafted(decoder, max_new_tokens, draft, sampling, counts=None, pace=Pace()):
    """generate's tokens at depth T, up to `draft.length` positions per pass (docs/sampling.md). A
    position's first t loop steps do not depend on T, so a draft at depth t is the first t steps of
    the target. Sampled, only the acceptance paces k, so a seed's text never depends on time. A
    batch keeps the run every row keeps, and a row's further tokens, verified already, wait in
    `ahead` for the next pass. counts gets "passes", "drafted", "agreed" (drafts a row accepted
    before its first rejection) and "plain" tokens."""
    B = decoder.tokens.size(0)
    steps, made, ahead = torch.full((B,), decoder.T), 0, [[] for _ in range(B)]
    counts, timed = {} if counts is None else counts, greedy(sampling.temperature)
    while made < max_new_tokens:
        k, start = min(pace.length, max_new_tokens - made), decoder.length
        began = time.perf_counter()
        if k == 0:  # one position at depth T, as generate decodes without a draft
            ids = ahead_of(sampling.pick(sampling.masked(decoder.next_logits()[0])), ahead, 0)
            decoder.append(ids)
            ids, accepted, tallies = ids[:, None], 0, {"plain": 1}
            ahead = [run[1:] for run in ahead]
        else:
            # 1. draft, each position's token drawn as plain decoding draws it, from the draft's
            states, shallow = [], []  # each position's state, and its logits at depth t
            for i in range(k):
                logits, state = draft_logits(decoder, draft.depth)
                states.append(state)
                shallow.append(sampling.masked(logits))
                decoder.append(ahead_of(sampling.pick(shallow[-1]), ahead, i))
            # 2. verify, the k positions run on to T together
            target = sampling.masked(verify_logits(decoder, states, draft.depth))
            # 3. accept, keep the run every row keeps, then roll back past the rest
            known = torch.tensor([[i < len(run) for i in range(k)] for run in ahead],
                                 device=target.device)
            own, agreed = accept(torch.stack(shallow, dim=1), target,
                                 decoder.tokens[:, start:start + k], sampling, known)
            rows_kept, accepted = (agreed + 1).clamp(max=k).tolist(), int(agreed.min())
            ids = own[:, :min(rows_kept)]
            ahead = [own[r, ids.size(1):rows_kept[r]].tolist() + run[k:]
                     for r, run in enumerate(ahead)]
            decoder.tokens[:, start:start + ids.size(1)] = ids
            decoder.length = start + ids.size(1)  # and the cache the positions before the last
            decoder.cache.pos = decoder.length - 1
            guided = int(known.sum())  # positions whose tokens were verified already
            tallies = {"passes": 1, "drafted": B * k - guided, "agreed": int(agreed.sum()) - guided}
        seconds = time.perf_counter() - began if timed else math.nan  # nan, so no speed-up rule
        pace = paced(pace._replace(length=k), draft.length, accepted, seconds)
        made += ids.size(1)
        for name, value in tallies.items():
            counts[name] = counts.get(name, 0) + value
        for next_ids in ids.unbind(dim=1):
            yield next_ids, steps


@torch.inference_mode()
def draft_logits(decoder, depth):
    """Run the next position through `depth` loop steps and the coda -> (logits (B, V), state).
    verify_logits goes on from the state. The coda's cache entry is the draft's until then."""
    with torch.compiler.set_stance("force_eager"):  # as the prefill
        n, model, cache = decoder.length, decoder.model, decoder.cache
        Bbar_e, ves, cos, sin = model.run_prelude(decoder.tokens[:, n - 1:n], cache)
        h = decoder.h0[:, n - 1:n].to(Bbar_e.dtype)
        for step in range(depth):
            h = model.loop_step(h, Bbar_e, decoder.A_bar, step, ves, cos, sin, cache)
        return model.run_coda(h, ves, cos, sin, cache)[:, -1], (h, Bbar_e, ves, cos, sin)


@torch.inference_mode()
def verify_logits(decoder, states, depth):
    """The last k = len(states) positions, drafted at `depth`, run on together to T, causal
    among themselves -> logits (B, k, V). Their coda entries overwrite the drafts'."""
    with torch.compiler.set_stance("force_eager"):
        model, cache = decoder.model, decoder.cache
        h, Bbar_e, cos, sin = (torch.cat(parts, dim=1) for parts in zip(
            *[(h, Bbar_e, cos, sin) for h, Bbar_e, _, cos, sin in states]))
        ves = {i: torch.cat([state[2][i] for state in states], dim=1) for i in states[0][2]}
        for step in range(depth, decoder.T):
            h = model.loop_step(h, Bbar_e, decoder.A_bar, step, ves, cos, sin, cache)
        return model.run_coda(h, ves, cos, sin, cache)


def ahead_of(ids, ahead, i):
    """ids (B,), each row's replaced by the i-th of its tokens verified ahead, if it has one."""
    if all(len(run) <= i for run in ahead):
        return ids
    return torch.tensor([run[i] if i < len(run) else x for run, x in zip(ahead, ids.tolist())],
                        device=ids.device)


def probabilities(logits, temperature, top_k):
    """logits (..., V) -> sample_next's distribution over all V ids, 0 outside the top_k."""
    probs, ids = top_probabilities(logits, temperature, top_k)
    return probs if ids is None else torch.zeros_like(logits).scatter_(-1, ids, probs)


def accept(shallow, target, guesses, sampling, known):
    """Speculative sampling's rule (Leviathan et al., 2023) on k drafted tokens per row.
    A row accepts draft token x with probability min(1, p(x) / q(x)) (target p, draft q).
    At its first rejection it draws from max(0, p - q), normalised. Greedy, x must be p's argmax.
    known (B, k) marks the drafts verified already, accepted as they are. -> (ids (B, k), valid
    up to and with each row's first rejection's draw; the drafts each row accepted before it)."""
    k = guesses.size(1)
    if greedy(sampling.temperature):
        best = torch.where(known, guesses, target.argmax(dim=-1))  # (B, k)
        return best, (guesses == best).cumprod(dim=1).sum(dim=1)
    p, q = (probabilities(logits, sampling.temperature, sampling.top_k)
            for logits in (target, shallow))  # (B, k, V) each
    p_x, q_x = (probs.gather(-1, guesses[..., None])[..., 0] for probs in (p, q))
    u = torch.stack([torch.rand(k, generator=g, device=p.device) for g in sampling.generators])
    agreed = ((u * q_x < p_x) | known).cumprod(dim=1).sum(dim=1)  # u < p(x) / q(x)
    ids = guesses.clone()
    for row, at in enumerate(agreed.tolist()):  # each rejecting row's draw at its rejection
        if at < k:
            residual = (p[row, at] - q[row, at]).clamp(min=0)
            ids[row, at] = draw(residual[None], sampling.generators[row:row + 1])[0]
    return ids, agreed

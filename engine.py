"""
engine.py: decoding (METHOD.md §1's model run one position at a time): the KV cache, one new position at a
fixed or adaptive depth, and the loop that samples token after token. sample.py is its command line.

    decoder = Decoder(model, tokens, max_new_tokens, T=8)              # the prompt prefilled into a KV cache
    for ids, steps in generate(model, tokens, 64, T="auto", top_k=50):  # token after token
        ...
    loss, steps_per_token = teacher_forced(model, ids, prompt_len, T=8)   # decoding's loss on known text

The prompt is prefilled in one pass into a KV cache with a slot per prelude/coda layer and per (recurrent
layer, loop step), each slot one buffer sized for prompt + max_new_tokens and written in place; each new
token then costs one position per layer and step.

T="auto" (beyond the paper) stops each new token's recurrence once it settles, after step t >= 2 or at
T_max: by default when the state's relative change ||h_t - h_{t-1}|| / ||h_t|| falls under the threshold,
a test far cheaper than a step, so the coda and the head run once per token; with exit="kl" when
KL(p_t || p_{t-1}) of successive predictions does, which runs the coda and head every step. The cache
slots of the steps a token skipped hold its last computed step's keys and values, so later tokens still
see it at every depth.

Row i of a batch uses its own generator for its h0 draws and its sampling: a sample does not depend on how
many others are drawn, or on whether generate() runs them in one batch.
"""

import warnings

import torch
import torch.nn.functional as F

from model import decoding_initial_state

# -----------------------------------------------------------------------------
# The KV cache

class KVCache:
    """Keys and values for decoding, one slot per attention call site: a prelude or coda layer, or a
    recurrent layer at one loop step (METHOD.md §1 loops the same weights, but each step sees other inputs).

    Each slot is one buffer per keys and values, (B, H, max_len, D), allocated at its first write and
    written in place: a new position never copies what is cached (nanochat's engine does the same).
    With `depth`, the slots of recurrent layer i at steps 0..depth-1 are views of one tensor, stacks[i]
    (depth, 2, B, H, max_len, D), so that one copy can write a position into every step at once (a token
    that stops its recurrence early: fill_skipped_steps)."""

    def __init__(self, max_len, depth=None):
        self.max_len, self.depth = max_len, depth
        self.slots = {}  # model.Slot -> (k, v) buffers, each (B, H, max_len, D)
        self.stacks = {}  # recurrent layer i -> (depth, 2, B, H, max_len, D), when depth is given
        self.pos = 0  # positions claimed so far, those of the forward under way included

    def claim(self, length):
        """The next forward's `length` positions (run_prelude calls it before any layer writes)."""
        if self.pos + length > self.max_len:
            raise ValueError(f"{self.pos + length} positions exceed the KV cache's {self.max_len}; "
                             f"size the cache for the prompt plus every new token")
        self.pos += length

    def buffers(self, slot, like):
        """The slot's (k, v) buffers, allocated like `like` (B, H, S, D) at the first call."""
        if slot not in self.slots:
            B, H, _, D = like.shape
            if slot.part == "recur" and self.depth is not None and slot.step < self.depth:
                if slot.layer not in self.stacks:
                    self.stacks[slot.layer] = like.new_zeros(self.depth, 2, B, H, self.max_len, D)
                self.slots[slot] = tuple(self.stacks[slot.layer][slot.step])
            else:
                self.slots[slot] = tuple(like.new_zeros(B, H, self.max_len, D) for _ in range(2))
        return self.slots[slot]

    def update(self, slot, k, v):
        """Write the newest k.size(2) positions' keys and values; -> every cached position's, as views."""
        k_buf, v_buf = self.buffers(slot, k)
        start = self.pos - k.size(2)
        k_buf[:, :, start:self.pos] = k
        v_buf[:, :, start:self.pos] = v
        return k_buf[:, :, :self.pos], v_buf[:, :, :self.pos]

# -----------------------------------------------------------------------------
# One token from the logits

def sample_next(logits, temperature, top_k, generators):
    """logits (B, V) -> (B,) ids: argmax when temperature is 0, else a draw from the top_k most likely, over
    those k alone (as nanochat's engine does: far cheaper than a multinomial over the whole vocabulary)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    ids = None
    if top_k is not None:
        logits, ids = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)  # (B, k) each
    probs = (logits / temperature).softmax(dim=-1)
    choice = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])  # (B,)
    return choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)


# -----------------------------------------------------------------------------
# One new position: the recurrence at a fixed depth, or stopped per row when it settles

EXITS = ("state", "kl")
# --T=auto's default thresholds. "state" (the recurrent state's relative change): the largest that keeps the CPU
# default checkpoint's teacher-forced loss within 0.5% of fixed T = mu_rec (docs/performance.md)
EXIT_THRESHOLDS = {"state": 0.15, "kl": 5e-4}


def relative_change(new, old):
    """||h_t - h_{t-1}|| / ||h_t|| per row, for one position: (B, 1, d) twice -> (B,)."""
    return torch.linalg.vector_norm(new - old, dim=(1, 2)) / torch.linalg.vector_norm(new, dim=(1, 2))


def decode_step(model, idx, cache, h0, T, exit=None, threshold=0.0, A_bar=None):
    """idx (B, 1), the position after those in `cache` -> (logits (B, 1, V), steps (B,)), the coda run once.

    With exit=None every row runs T recurrent steps. With exit="state" row r stops after step t >= 2 once
    relative_change(h_t, h_{t-1}) < threshold: four small ops on the state and one read of B floats per
    step, far cheaper than the step. With exit="kl" it stops once KL(p_t || p_{t-1}) < threshold, which runs
    the coda and the head after every step. A stopped row's state stays put while the others run on; the
    bookkeeping is Python lists, not tensor ops, since every op costs as much as a small matmul at B = 1.
    Cached keys and values are written in place, so the coda's slot, rewritten after every step under "kl",
    ends up holding each row's final state's. A_bar: the injection's A_bar(), when the caller has it.
    """
    e, ves, cos, sin = model.run_prelude(idx, cache)
    A_bar = model.injection.A_bar() if A_bar is None else A_bar
    Bbar_e = model.injection.Bbar_e(e)
    h, B = h0.to(e.dtype), idx.size(0)
    if exit is None:
        for step in range(T):
            h = model.loop_step(h, Bbar_e, A_bar, step, ves, cos, sin, cache)
        return model.run_coda(h, ves, cos, sin, cache), torch.full((B,), T)
    steps, done, logits, prev_logp = [T] * B, [False] * B, None, None
    for step in range(T):
        stepped = model.loop_step(h, Bbar_e, A_bar, step, ves, cos, sin, cache)
        change = relative_change(stepped, h) if exit == "state" and step > 0 else None
        h = torch.where(torch.tensor(done, device=h.device)[:, None, None], h, stepped) if any(done) else stepped
        if exit == "kl":
            logits = model.run_coda(h, ves, cos, sin, cache)
            logp = logits[:, -1].log_softmax(dim=-1)
            if prev_logp is not None:  # rounding can take the KL below 0: clamped, so threshold 0 never exits
                change = (logp.exp() * (logp - prev_logp)).sum(dim=-1).clamp(min=0)
            prev_logp = logp
        if change is not None:
            for r, value in enumerate(change.tolist()):
                if not done[r] and value < threshold:
                    done[r], steps[r] = True, step + 1
            if all(done):
                break
    if cache is not None and any(done):
        fill_skipped_steps(cache, steps, T)
    return (model.run_coda(h, ves, cos, sin, cache) if logits is None else logits), torch.tensor(steps)


def fill_skipped_steps(cache, steps, T_max):
    """The newest position's recurrent slots at the steps a row skipped take its last computed step's keys
    and values, so later tokens see it at every depth (steps: the steps each row ran). One copy per row and
    recurrent layer: the cache holds each layer's steps in one tensor (KVCache's depth)."""
    if cache.depth is None or cache.depth < T_max:
        raise ValueError(f"an early exit fills the steps it skipped in the cache's stacks: build the cache as "
                         f"KVCache(max_len, depth={T_max})")
    p = cache.pos - 1
    for r, ran in enumerate(steps):
        for stack in cache.stacks.values():  # (depth, 2, B, H, max_len, D)
            stack[ran:T_max, :, r, :, p] = stack[ran - 1, :, r, :, p]

# -----------------------------------------------------------------------------
# Decoding: the prompt prefilled, then one position at a time

class Decoder:
    """Next-token logits for a batch of prompts, one position per call, the token fed back by append().

    T: an int >= 1, None for mu_rec, or "auto" (up to T_max, default 2 * mu_rec, stopped per row by `exit`).
    use_cache: True prefills the prompt into a KVCache sized for prompt + max_new_tokens; False recomputes
    the whole sequence for every token (fixed T only: the reference). Prompts longer than seq_len are
    cropped from the left.
    """

    def __init__(self, model, tokens, max_new_tokens, T=None, generators=(None,), exit="state",
                 exit_threshold=None, T_max=None, use_cache=True):
        c = self.config = model.config
        device = model.wte.weight.device
        idx = torch.as_tensor(tokens, dtype=torch.long, device=device)
        idx = idx[None] if idx.dim() == 1 else idx
        if idx.size(1) > c.seq_len:
            warnings.warn(f"the prompt's {idx.size(1)} tokens exceed seq_len={c.seq_len}: "
                          f"cropped from the left to the last {c.seq_len}")
            idx = idx[:, -c.seq_len:]
        adaptive = T == "auto"
        if adaptive and use_cache is False:
            raise ValueError("T='auto' decodes through the KV cache; use_cache=False needs a fixed T")
        if adaptive and model.injection is None:
            raise ValueError("T='auto' needs a looped model; this is the fixed-depth Transformer baseline")
        if exit not in EXITS:
            raise ValueError(f"exit={exit!r} is not one of {EXITS}")
        num_positions = idx.size(1) + max_new_tokens
        if num_positions > model.rope_cos.size(1):
            raise ValueError(f"prompt + max_new_tokens = {num_positions} positions exceed the model's RoPE table of "
                             f"{model.rope_cos.size(1)}; lower max_new_tokens")
        self.model, self.T = model, (T_max or 2 * c.mu_rec) if adaptive else (T or c.mu_rec)
        self.exit = exit if adaptive else None
        self.threshold = EXIT_THRESHOLDS[exit] if exit_threshold is None else exit_threshold
        # h0 for every position up front, one draw per row: a run's initial states do not depend on the tokens it
        # samples (greedy and top-k 1 see the same h0)
        rows = list(generators) * (idx.size(0) // len(generators))
        self.h0 = decoding_initial_state((len(rows), num_positions, c.d_model), device, rows)
        self.tokens = torch.zeros(idx.size(0), num_positions, dtype=torch.long, device=device)
        self.tokens[:, :idx.size(1)], self.length = idx, idx.size(1)
        # depth for --T=auto alone: its early exits fill the skipped steps' slots (fill_skipped_steps)
        self.cache = KVCache(num_positions, depth=self.T if adaptive else None) if use_cache else None
        with torch.inference_mode():
            self.A_bar = model.injection.A_bar() if model.injection is not None else None  # once per run
            if self.cache is not None and self.length > 1:  # the prompt but its last token, decoded like any
                model(idx[:, :-1], T=self.T, h0=self.h0[:, :self.length - 1], cache=self.cache)

    @torch.inference_mode()
    def next_logits(self):
        """-> (logits (B, V) for the position after the last token, recurrent steps (B,) each row took)."""
        n, model, B = self.length, self.model, self.tokens.size(0)
        depth = self.T if model.injection is not None else 1
        if self.cache is None:
            logits = model(self.tokens[:, :n], T=self.T, h0=self.h0[:, :n])
        elif model.injection is None:
            logits = model(self.tokens[:, n - 1:n], cache=self.cache)
        else:
            logits, steps = decode_step(model, self.tokens[:, n - 1:n], self.cache, self.h0[:, n - 1:n], self.T,
                                        self.exit, self.threshold, self.A_bar)
            return logits[:, -1], steps
        return logits[:, -1], torch.full((B,), depth)

    def append(self, ids):
        """ids (B,): the next token of every row."""
        self.tokens[:, self.length] = ids
        self.length += 1


def generate(model, tokens, max_new_tokens, T=None, temperature=1.0, top_k=None, generator=None, exit="state",
             exit_threshold=None, T_max=None, use_cache=True, allowed=None):
    """Yield (ids (B,), steps (B,)) for each new token: the token of every row and the recurrent steps it took.

    tokens: a list of ids or a (B, S) tensor. T, exit, exit_threshold, T_max, use_cache: see Decoder.
    generator: a torch.Generator on the model's device, or one per row; None uses the global RNG.
    allowed: None, or a (vocab_size,) bool mask of the ids that may be sampled (Tokenizer.known_ids).
    """
    generators = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    decoder = Decoder(model, tokens, max_new_tokens, T, generators, exit, exit_threshold, T_max, use_cache)
    generators = generators * (decoder.tokens.size(0) // len(generators))
    for _ in range(max_new_tokens):
        logits, steps = decoder.next_logits()
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        next_ids = sample_next(logits, temperature, top_k, generators)
        yield next_ids, steps
        decoder.append(next_ids)


def teacher_forced(model, ids, prompt_len, T=None, seed=0, **decoding):
    """Decode ids (B, S) after its first prompt_len tokens as generate does, feeding each true next token
    instead of a sampled one -> (mean cross-entropy of ids[:, prompt_len:], mean recurrent steps per token).
    decoding: Decoder's exit, exit_threshold, T_max, use_cache."""
    generator = torch.Generator(model.wte.weight.device).manual_seed(seed)
    decoder = Decoder(model, ids[:, :prompt_len], ids.size(1) - prompt_len, T, [generator], **decoding)
    losses, steps = [], []
    for p in range(prompt_len, ids.size(1)):
        logits, ran = decoder.next_logits()
        losses.append(F.cross_entropy(logits.float(), ids[:, p], reduction="none"))
        steps.append(ran)
        decoder.append(ids[:, p])
    return torch.cat(losses).mean().item(), torch.cat(steps).float().mean().item()

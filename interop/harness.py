"""
harness.py: nanoparcae as a model of EleutherAI's lm-evaluation-harness, at a chosen recurrence depth T.
Every task of the harness runs on it.
The authors evaluate LAMBADA this way, and the paper reports WikiText perplexity (§5.1).

    pip install -r requirements-eval.txt                    # lm-eval is optional: not in requirements.txt
    python -m interop.harness --tasks lambada_openai,wikitext --T 8       # the latest checkpoint, or --ckpt / --run
    python -m interop.harness --from SandyResearch/parcae-140m --tasks lambada_openai --T 8

From Python, the harness's own evaluator runs it so.

    import lm_eval
    from interop import harness
    lm = harness.HarnessLM(model, tokenizer, T=8)   # from hub.load_pretrained, or model.from_weights
    results = lm_eval.simple_evaluate(model=lm, tasks=["lambada_openai", "wikitext"])

The harness downloads each task's data set on first use (Hugging Face datasets, cached under ~/.cache/huggingface).
Requests are scored as eval_core scores CORE, many rows per forward.
A row holds at most seq_len tokens, BOS first, cropped from the left; its last token is only a target.
One seeded h0 serves every row, so a score does not depend on the batch.
Generation is engine.py's greedy decoding, as sample.py runs it.
"""

import itertools

import torch

import eval_core
from nanoparcae.checkpoint import load_run
from nanoparcae.command import (EnvironmentFailure, comma_list, command_parser, first_sentence, run_command)
from nanoparcae.ranks import print0, rank_and_world
from nanoparcae.command import listed, positive
from nanoparcae.results import check_results_folder, keep_results
from nanoparcae.core_tasks import Row, common_length, crop_left
from engine import generate
from data import bf16_autocast
from eval_core import score_rows
from interop.hub import SOURCE_HELP, load_pretrained, local_dir
from model import evaluation_initial_state, from_weights

NO_LM_EVAL = "lm-eval is not installed; run `pip install -r requirements-eval.txt`"
try:
    import lm_eval
    from lm_eval.api.model import LM
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, make_table
except ImportError:
    if __name__ != "__main__":  # an importer gets the error; the command, one line from main
        raise ImportError(NO_LM_EVAL) from None
    lm_eval, LM = None, object


class HarnessLM(LM):
    """The harness's LM interface over a nanoparcae model at recurrence depth T (None for mu_rec).
    batch_size is the sequences of seq_len tokens per forward, and seed draws h0 and seeds each generation."""

    def __init__(self, model, tokenizer, T=None, batch_size=8, seed=1234, max_gen_toks=256):
        super().__init__()
        self.model, self.tokenizer, self.T = model.eval(), tokenizer, T
        self.seed, self.max_gen_toks = seed, max_gen_toks
        self.seq_len = model.config.seq_len
        self.batch_tokens = batch_size * self.seq_len
        self._device = next(model.parameters()).device
        self.h0_table = evaluation_initial_state(model.config.d_model, self.seq_len, seed, self._device)
        allowed = tokenizer.known_ids(model.config.vocab_size)
        self.allowed = None if allowed is None else allowed.to(self._device)

    def score(self, rows, count):
        """-> per request (sum of the log-probabilities of its rows' spans, whether greedy decoding gives them)."""
        losses, exact = score_rows(self.model, rows, self.T, self.h0_table, self.batch_tokens)
        totals = [[0.0, True] for _ in range(count)]
        for row, loss, hit in zip(rows, losses, exact):
            totals[row.example][0] -= loss * (row.end - row.start)
            totals[row.example][1] &= hit
        return [tuple(total) for total in totals]

    def loglikelihood(self, requests):
        """(context, continuation) -> (log p(continuation | BOS, context), greedy). As in eval_core's LM tasks, the
        continuation is what the joint text's tokens hold after those of the context alone."""
        pairs = [request.args for request in requests]
        encoded = self.tokenizer.encode([context for context, _ in pairs] + [c + x for c, x in pairs])
        rows = []
        for i, (context_ids, whole) in enumerate(zip(encoded[:len(pairs)], encoded[len(pairs):])):
            tokens = [self.tokenizer.bos_id, *whole]
            rows.append(Row(*crop_left(tokens, 1 + common_length([context_ids, whole]), len(tokens), self.seq_len), i))
        return self.score(rows, len(requests))

    def loglikelihood_rolling(self, requests):
        """Score (text,) -> log p(text | BOS), every token once.
        Tokens go in the harness's disjoint windows, each a row of at most seq_len tokens.
        Each later window starts from the token before it."""
        rows = []
        for i, request in enumerate(requests):
            ids = self.tokenizer.encode(request.args[0])
            windows = get_rolling_token_windows(ids, self.tokenizer.bos_id, self.seq_len - 1, context_len=1)
            for context, predicted in map(make_disjoint_window, windows):
                rows.append(Row(context + predicted, len(context), len(context) + len(predicted), i))
        return [logprob for logprob, _ in self.score(rows, len(requests))]

    def generate_until(self, requests):
        """(context, {"until": [...], "max_gen_toks": n}) -> the greedy continuation of BOS + context, cut before
        the first stop string, ended at BOS (a new document) or after n tokens. Prompts of one length decode in
        one batch, each row with its own generator seeded `seed`, which makes a row what sample.py
        --temperature=0 --seed=<seed> prints for it."""
        jobs = []
        for i, request in enumerate(requests):
            context, kwargs = request.args
            until = kwargs.get("until") or []
            stops = [stop for stop in ([until] if isinstance(until, str) else until) if stop]
            new = min(int(kwargs.get("max_gen_toks", self.max_gen_toks)), self.seq_len - 1)
            ids = [self.tokenizer.bos_id, *self.tokenizer.encode(context)][-(self.seq_len - new):]
            jobs.append(((len(ids), new), i, ids, stops))
        outputs = [""] * len(requests)
        jobs.sort(key=lambda job: job[:2])
        for (_, new), group in itertools.groupby(jobs, key=lambda job: job[0]):
            _, indices, prompts, stops = zip(*group)
            for i, text in zip(indices, self.decode_greedy(prompts, new, stops)):
                outputs[i] = text
        return outputs

    def decode_greedy(self, prompts, max_new_tokens, stops):
        """Equal-length prompts -> one text each, decoded until every row has hit BOS or a stop string."""
        generators = [torch.Generator(self._device).manual_seed(self.seed) for _ in prompts]
        new_ids, done = [[] for _ in prompts], [False] * len(prompts)
        with bf16_autocast(self._device):
            for next_ids, _ in generate(self.model, torch.tensor(prompts), max_new_tokens, self.T, temperature=0,
                                        generator=generators, allowed=self.allowed):
                for r, token in enumerate(next_ids.tolist()):
                    done[r] = done[r] or token == self.tokenizer.bos_id
                    if not done[r]:
                        new_ids[r].append(token)
                        done[r] = any(stop in self.tokenizer.decode(new_ids[r]) for stop in stops[r])
                if all(done):
                    break
        texts = [self.tokenizer.decode(ids) for ids in new_ids]
        return [min((text.split(stop)[0] for stop in row_stops), key=len, default=text)
                for text, row_stops in zip(texts, stops)]


def run_harness(model, tokenizer, tasks, Ts, batch_size=8, limit=None):
    """The harness's tasks (names separated by commas) at each T, tables printed -> the tasks, the Ts and, by T,
    the harness's results per task. limit caps the documents per task (None for all)."""
    names = [name.strip() for name in comma_list(tasks, str)]  # ValueError naming the text when it has none
    if tasks in ("core", "extended"):
        raise ValueError(f"--tasks={tasks} is eval_core.py's; give the harness's task names, e.g. lambada_openai")
    if rank_and_world()[1] > 1:
        raise ValueError("the harness runs in one process; start it with python, not torchrun")
    task_manager = TaskManager()
    unknown = [name for name in names if name not in task_manager.all_tasks]
    if unknown:
        raise ValueError(f"the harness has no task {', '.join(unknown)}; `lm-eval ls tasks` lists them")
    out = {"tasks": names, "T": Ts, "results": {}}
    for T in Ts:
        print0(f"--- T = {T}")
        try:
            results = lm_eval.simple_evaluate(model=HarnessLM(model, tokenizer, T, batch_size), tasks=names,
                                              limit=limit, log_samples=False, task_manager=task_manager)
        except (ConnectionError, OSError) as err:
            raise ValueError(f"the harness could not fetch its data ({first_sentence(err)}); it downloads each task's "
                             f"data set on first use, so check the network") from None
        print0(make_table(results))
        out["results"][T] = results["results"]
    return out


def main(argv=None):
    parser = command_parser(__doc__)
    parser.prog = "python -m interop.harness"
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--ckpt", help="a checkpoint file (default: the latest of --run)")
    which.add_argument("--run", help="a run under <base dir>/runs (default: the most recently written)")
    which.add_argument("--from", dest="from_", help="the authors' release: " + SOURCE_HELP)
    parser.add_argument("--tasks", required=True, help="the harness's task names, e.g. lambada_openai,wikitext")
    parser.add_argument("--T", type=listed(positive(int)), default=None,
                        help="test-time recurrence(s), e.g. 8 or 1,4,8 (default: mu_rec)")
    parser.add_argument("--batch_size", type=positive(int), default=8, help="sequences of seq_len tokens per forward")
    parser.add_argument("--max_per_task", type=eval_core.items_or_all, default=-1, help="documents per task (-1: all)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    args = parser.parse_args(argv)
    if lm_eval is None:
        raise EnvironmentFailure(NO_LM_EVAL)
    device = eval_core.start_device(args)
    if args.from_:
        model, tokenizer = load_pretrained(args.from_, device, need_tokenizer=True)
        ckpt, ckpt_path = {}, local_dir(args.from_) / "authors"
    else:
        ckpt, tokenizer, ckpt_path = load_run(args.run, args.ckpt)
        model = from_weights(ckpt["config"], ckpt["model"], device)
    Ts = args.T or [model.config.mu_rec]
    check_results_folder(ckpt_path, "harness", Ts)
    out = run_harness(model, tokenizer, args.tasks, Ts, args.batch_size,
                      args.max_per_task if args.max_per_task > 0 else None)
    keep_results(out, args, ckpt, ckpt_path, Ts, "harness")


if __name__ == "__main__":
    run_command(main)

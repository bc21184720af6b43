"""Tests of eval_core.py and nanoparcae/core_tasks.py: the eval bundle download and safe extraction, CORE scoring with a
model whose preferences are known (all three task types), centered accuracy, the LM prompt strip, left cropping,
batched = one item per forward, one rank = two ranks, bits per byte, and the test-time scaling fit."""

import csv
import io
import json
import math
import os
import socket
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanoparcae import core_tasks  # noqa: E402
import eval_core  # noqa: E402
from nanoparcae.core_tasks import (CORE_TASKS, EXTENDED_TASKS, LM, Task, crop_left,  # noqa: E402
                                   render_prompts, scored_spans)
from nanoparcae.download import download_eval_bundle, extract_zip_safely  # noqa: E402
from data import evaluate_bpb  # noqa: E402
from nanoparcae.files import get_base_dir  # noqa: E402
from eval_core import centered_accuracy, evaluate_core, evaluate_ppl, fit_test_time_scaling  # noqa: E402
from model import Parcae, ParcaeConfig, evaluation_initial_state  # noqa: E402
from conftest import carries, raises_naming  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls: on a shared 2-core machine, intra-op threads only wait on each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

# -----------------------------------------------------------------------------
# A byte tokenizer and a bigram model whose preferences are set by hand

BOS = 256


class ByteTokenizer:
    bos_id = BOS
    vocab_size = 257
    token_bytes = torch.tensor([1] * 256 + [0], dtype=torch.int32)

    def encode(self, text, prepend_bos=False):
        if not isinstance(text, str):
            return [self.encode(t, prepend_bos) for t in text]
        return [BOS] * prepend_bos + list(text.encode("utf-8"))


class BigramModel(nn.Module):
    """logits[b, s] = table[idx[b, s]]: what comes next depends only on the current byte. Preferences:
    ':' -> ' ', ' ' -> 'b' (then 'a'), 'b' -> 'c', 'g' -> ' '; every other next byte scores 0 (argmax: byte 0)."""

    def __init__(self, seq_len=4096):
        super().__init__()
        self.config = SimpleNamespace(seq_len=seq_len, d_model=8, mu_rec=3)
        table = torch.zeros(257, 257)
        for prev, nxt, logit in [(":", " ", 3.0), (" ", "b", 4.0), (" ", "a", 2.0), ("b", "c", 4.0), ("g", " ", 3.0)]:
            table[ord(prev), ord(nxt)] = logit
        self.table = nn.Parameter(table)
        self.widths = []  # the padded width of every forward

    def forward(self, idx, targets=None, T=None, h0=None, reduction="mean", diagnostics=None):
        assert h0 is not None and h0.shape[:2] == idx.shape
        self.widths.append(idx.size(1))
        logits = self.table[idx]
        if targets is None:
            return logits
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1,
                                           reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss

# -----------------------------------------------------------------------------
# A bundle in the real layout: eval_bundle/{core.yaml, eval_meta_data.csv, eval_data/<category>/<task>.jsonl}


def mc(query, choices, gold):
    return {"query": query, "choices": choices, "gold": gold}


# the bigram model picks the choice "b" (lowest loss after " "), the context option ending in "g" (" " follows it),
# and reproduces a continuation iff it is "bc" (" " -> b -> c), after a context ending in ":"
FIXTURE = {
    "copa": [mc("Q1:", ["a", "b"], 1), mc("Q2:", ["b", "a"], 0), mc("Q3:", ["c", "b"], 1),
             mc("Q4:", ["a", "b"], 0), mc("Q5:", ["b", "c"], 1)],  # 3/5 right
    "arc_easy": [mc("Which? :", ["a", "b", "c", "d"], 1), mc("Why? :", ["b", "a", "c", "d"], 2),
                 mc("How? :", ["a", "c", "b", "d"], 0),
                 mc("Who? :", ["d", "c", "a", "b"], 0)],  # 1/4, 10 shots > 3 others
    "winograd": [{"context_options": ["the cat", "the dog"], "continuation": "ran:", "gold": 1},
                 {"context_options": ["a big dog", "a big cow"], "continuation": "sat.", "gold": 0},
                 {"context_options": ["my hat", "my bag"], "continuation": "fell", "gold": 0}],  # 2/3
    "lambada_openai": [{"context": "  The end is:  ", "continuation": "bc"}, {"context": "Next:", "continuation": "bc"},
                       {"context": "Then:", "continuation": "bd"}, {"context": "Last:", "continuation": "a"}],  # 2/4
    "jeopardy": [{"context": "HISTORY: who was first", "continuation": "bc"},
                 {"context": "SCIENCE: what is it", "continuation": "bc"},
                 {"context": "WORDS: which word", "continuation": "bc"},
                 {"context": "ART: who painted it", "continuation": "cb"}],  # 3/4
}
EXPECTED_ACCURACY = {"copa": 3 / 5, "arc_easy": 1 / 4, "winograd": 2 / 3, "lambada_openai": 2 / 4, "jeopardy": 3 / 4}
BASELINES = {"copa": 50, "arc_easy": 25, "winograd": 50, "lambada_openai": 0, "jeopardy": 0}
FIXTURE_TASKS = [task for task in CORE_TASKS if task.label in FIXTURE]


def bundle_zip_bytes(extra_members=()):
    by_label = {task.label: task for task in CORE_TASKS}
    meta = io.StringIO()
    writer = csv.writer(meta)
    writer.writerow(["Eval Task", "Task Category", "Task Type", "#shots", "#datapoints", "Random baseline",
                     "Centered Metric?", "Description"])
    for label, baseline in BASELINES.items():
        writer.writerow([label, "x", "y", by_label[label].shots, len(FIXTURE[label]), baseline, "",
                         f"About {label}, quoted"])
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("eval_bundle/core.yaml", "icl_tasks:\n- label: copa\n")
        archive.writestr("eval_bundle/eval_meta_data.csv", meta.getvalue())
        for label, records in FIXTURE.items():
            archive.writestr(f"eval_bundle/eval_data/{by_label[label].path}",
                             "".join(json.dumps(r) + "\n" for r in records))
        for name, text in extra_members:
            archive.writestr(name, text)
    return buffer.getvalue()


@pytest.fixture
def bundle(server):
    (server.root / "eval_bundle.zip").write_bytes(bundle_zip_bytes())
    return download_eval_bundle(f"{server.url}/eval_bundle.zip")

# -----------------------------------------------------------------------------
# The bundle


def test_download_and_extract(server):
    (server.root / "eval_bundle.zip").write_bytes(bundle_zip_bytes())
    base = get_base_dir()
    bundle_dir = download_eval_bundle(f"{server.url}/eval_bundle.zip")
    assert bundle_dir == base / "eval_bundle"
    assert (bundle_dir / "core.yaml").is_file()
    lines = (bundle_dir / "eval_data" / "language_understanding" / "winograd_wsc.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == FIXTURE["winograd"]
    assert core_tasks.read_random_baselines(bundle_dir) == {k: float(v) for k, v in BASELINES.items()}
    assert sorted(p.name for p in base.iterdir()) == ["eval_bundle"]  # no zip, no temporary left behind
    assert len(server.requests) == 1
    download_eval_bundle(f"{server.url}/eval_bundle.zip")  # cached: no second download
    assert len(server.requests) == 1


def test_member_escaping_the_folder_is_refused(tmp_path, server):
    (server.root / "eval_bundle.zip").write_bytes(bundle_zip_bytes(extra_members=[("../x", "pwned")]))
    base = get_base_dir()
    with raises_naming(ValueError, "'../x'"):
        download_eval_bundle(f"{server.url}/eval_bundle.zip")
    assert not (tmp_path / "x").exists()
    assert list(base.iterdir()) == []  # nothing extracted, the bad zip deleted
    for name in ["/tmp/abs_member_x", "eval_bundle/../../y"]:
        archive = tmp_path / "bad.zip"
        with zipfile.ZipFile(archive, "w") as z:
            z.writestr("eval_bundle/ok.txt", "fine")
            z.writestr(zipfile.ZipInfo(name), "pwned")
        with raises_naming(ValueError, str(archive), repr(name)):
            extract_zip_safely(archive, tmp_path / "target")
        assert not (tmp_path / "target").exists() and not (tmp_path / "y").exists()


def test_task_table():
    assert len(CORE_TASKS) == 22 and len(EXTENDED_TASKS) == 46
    assert len({t.label for t in EXTENDED_TASKS}) == 46
    assert all(t.kind in ("multiple_choice", "schema", "language_modeling") for t in EXTENDED_TASKS)
    with raises_naming(ValueError, "not_a_task", "--tasks"):
        core_tasks.select_tasks("copa,not_a_task")

# -----------------------------------------------------------------------------
# Scoring


def test_centered_accuracy():
    assert centered_accuracy(0.75, 25) == pytest.approx(2 / 3)
    assert centered_accuracy(0.25, 25) == pytest.approx(0.0)
    assert centered_accuracy(1.0, 62) == pytest.approx(1.0)
    assert centered_accuracy(0.0, 50) == pytest.approx(-1.0)


def test_scores_match_hand_computed_accuracy(bundle):
    model = BigramModel()
    result = evaluate_core(model, ByteTokenizer(), bundle)
    assert result["accuracy"] == pytest.approx(EXPECTED_ACCURACY)
    expected_centered = {k: centered_accuracy(EXPECTED_ACCURACY[k], BASELINES[k]) for k in FIXTURE}
    assert result["centered"] == pytest.approx(expected_centered)
    assert result["core"] == pytest.approx(sum(expected_centered.values()) / len(FIXTURE))
    assert result["core_extended"] is None
    assert len(result["skipped"]) == 22 - len(FIXTURE) and "hellaswag" in result["skipped"]  # absent: named, skipped
    assert result["T"] == 3  # mu_rec when T is None
    # extended: the 24 extra tasks are all absent, so Core-Extended averages what ran
    result = evaluate_core(model, ByteTokenizer(), bundle, tasks="extended")
    assert len(result["skipped"]) == 46 - len(FIXTURE)
    with torch.no_grad():  # a loss that is NaN scores no item: the accuracy is NaN, never a guess
        model.table.fill_(math.nan)
    assert all(map(math.isnan, evaluate_core(model, ByteTokenizer(), bundle)["accuracy"].values()))


def test_language_modelling_prompt_strip():
    task = Task("lm", "x.jsonl", LM, 1, "\nAnswer: ")
    shot = {"context": " Q0 ", "continuation": "zero"}
    without, full = render_prompts(task, {"context": "  The capital is  ", "continuation": "Paris"}, [shot])
    assert without == "Q0\nAnswer: zero\n\nThe capital is\nAnswer:"
    assert full == "Q0\nAnswer: zero\n\nThe capital is\nAnswer: Paris"
    tokens = ByteTokenizer().encode([without, full], prepend_bos=True)
    (sequence,), ((start, end),) = scored_spans(task, tokens)
    assert bytes(sequence[start:end]).decode() == " Paris" and sequence[0] == BOS


def test_scored_spans_cover_exactly_the_answer():
    tokenizer = ByteTokenizer()
    choice = Task("mc", "x.jsonl", "multiple_choice", 0, " ")
    prompts = render_prompts(choice, {"query": "Q:", "choices": ["a", "bb"], "gold": 0}, [])
    sequences, spans = scored_spans(choice, tokenizer.encode(prompts, prepend_bos=True))
    assert [bytes(seq[s:e]).decode() for seq, (s, e) in zip(sequences, spans)] == ["a", "bb"]
    schema = Task("schema", "x.jsonl", "schema", 0, " ")
    prompts = render_prompts(schema, {"context_options": ["the cat", "a dog"], "continuation": "ran", "gold": 0}, [])
    sequences, spans = scored_spans(schema, tokenizer.encode(prompts, prepend_bos=True))
    assert [bytes(seq[s:e]).decode() for seq, (s, e) in zip(sequences, spans)] == [" ran", " ran"]


def test_left_cropping_keeps_the_continuation(bundle):
    tokens = [BOS] + list(range(20))
    cropped, start, end = crop_left(tokens, 15, 21, max_len=8)
    assert cropped == tokens[-8:] and cropped[start:end] == tokens[15:21]
    cropped, start, end = crop_left(tokens, 3, 21, max_len=8)  # a span longer than the window keeps what fits
    assert (start, end) == (1, 8)
    # end to end: 30 tokens of context are far shorter than the prompts, the accuracies do not change
    model = BigramModel(seq_len=30)
    result = evaluate_core(model, ByteTokenizer(), bundle, tasks="jeopardy,lambada_openai,copa,winograd")
    assert max(model.widths) == 30
    assert result["accuracy"] == pytest.approx({k: EXPECTED_ACCURACY[k] for k in result["accuracy"]})


def tiny_parcae(vocab_size=257):
    torch.manual_seed(0)
    model = Parcae(ParcaeConfig(vocab_size=vocab_size, seq_len=128, n_prelude=1, n_recur=1, n_coda=1, d_model=64,
                                head_dim=32, mu_rec=2))
    with torch.no_grad():  # the zero-init output projections would make every position alike
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5 / math.sqrt(p.size(1)))
    return model.eval()


def test_batched_equals_one_item_per_forward(bundle):
    model = BigramModel()
    batched = evaluate_core(model, ByteTokenizer(), bundle)
    n_batched, model.widths = len(model.widths), []
    single = evaluate_core(model, ByteTokenizer(), bundle, one_per_forward=True)
    assert single["accuracy"] == batched["accuracy"]
    assert n_batched < len(model.widths)
    # a real looped model: the same per-sequence losses batched or one item per forward, and a repeatable score
    model = tiny_parcae()
    tokenizer = ByteTokenizer()
    rows = [row for task in FIXTURE_TASKS for row in core_tasks.build_rows(
        task, core_tasks.load_task_data(bundle, task, -1), range(len(FIXTURE[task.label])), tokenizer, 1234, 128)]
    h0 = evaluation_initial_state(model.config.d_model, 128, 1234, "cpu")
    batched = eval_core.score_rows(model, rows, 2, h0, batch_tokens=512)
    single = eval_core.score_rows(model, rows, 2, h0, one_per_forward=True)
    assert batched[0] == pytest.approx(single[0], abs=1e-5) and batched[1] == single[1]
    first = evaluate_core(model, tokenizer, bundle, T=2)
    assert evaluate_core(model, tokenizer, bundle, T=2)["accuracy"] == first["accuracy"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_rank_worker(rank, port, bundle_dir, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = tiny_parcae()
    core = evaluate_core(model, ByteTokenizer(), bundle_dir, T=2)
    batches = val_batches_for_test()
    loss, bpb = evaluate_bpb(model, ByteTokenizer(), batches[rank::2], T=2)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"core": core["accuracy"], "loss": loss, "bpb": bpb}))
    dist.destroy_process_group()


def val_batches_for_test():
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        x = torch.randint(0, 257, (2, 16), generator=gen)
        y = torch.roll(x, -1, dims=1)
        y[:, -1] = -1
        batches.append((x, y))
    return batches


@pytest.mark.slow
def test_one_rank_equals_two_ranks(bundle, tmp_path):
    model = tiny_parcae()
    core = evaluate_core(model, ByteTokenizer(), bundle, T=2)
    loss, bpb = evaluate_bpb(model, ByteTokenizer(), val_batches_for_test(), T=2)
    mp.start_processes(two_rank_worker, args=(free_port(), str(bundle), str(tmp_path)), nprocs=2,
                       start_method="forkserver")  # forked from the server conftest started
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["core"] == core["accuracy"]
        assert got["loss"] == pytest.approx(loss, rel=1e-6) and got["bpb"] == pytest.approx(bpb, rel=1e-6)

# -----------------------------------------------------------------------------
# Bits per byte and the test-time scaling law


def test_bits_per_byte_by_hand():
    from nanoparcae.tokenizer import Tokenizer
    text = "the quick brown fox jumps over the lazy dog. " * 40 + "héllo wörld ünïcode — ✓ " * 20
    tokenizer = Tokenizer.train(iter([text]), 300)
    ids = tokenizer.encode(["the lazy fox héllo ✓", "over the dog — wörld"], prepend_bos=True)
    width = min(map(len, ids))
    x = torch.tensor([row[:width] for row in ids])
    y = torch.roll(x, -1, dims=1)
    y[0, -1] = -1
    y[1, -1] = tokenizer.bos_id  # a special target: it counts in the loss, not in bits per byte
    model = tiny_parcae(tokenizer.vocab_size)
    loss, bpb = evaluate_bpb(model, tokenizer, [(x, y)], T=2)
    h0 = evaluation_initial_state(model.config.d_model, width, 1234, "cpu").expand(2, -1, -1)
    nats = model(x, targets=y, T=2, h0=h0, reduction="none")
    total_nats, total_bytes, byte_nats = 0.0, 0, 0.0
    for b in range(2):
        for s in range(width):
            target = y[b, s].item()
            if target < 0:
                continue
            total_nats += nats[b, s].item()
            if target != tokenizer.bos_id:
                byte_nats += nats[b, s].item()
                total_bytes += len(tokenizer.enc.decode_single_token_bytes(target))
    assert loss == pytest.approx(total_nats / (2 * width - 1), rel=1e-5)
    assert bpb == pytest.approx(byte_nats / (math.log(2) * total_bytes), rel=1e-5)


def test_per_document_perplexity_by_hand():
    """The authors' protocol: each document alone in one forward, no BOS, cropped to seq_len + 1 tokens,
    nats averaged over the targets that carry bytes, bits per byte over their bytes."""
    from nanoparcae.tokenizer import Tokenizer
    text = "the quick brown fox jumps over the lazy dog. " * 40 + "héllo wörld ünïcode — ✓ " * 20
    tokenizer = Tokenizer.train(iter([text]), 300)
    model = tiny_parcae(tokenizer.vocab_size)
    model.config.seq_len = 12  # the document cap: the long document below is cropped
    docs = ["the lazy fox héllo ✓ over the dog — wörld and the quick brown fox jumps over it again",
            "a", "wörld ✓ dog", "the fox"]
    shapes = []
    hook = model.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    loss, bpb, num_docs, tokens = evaluate_ppl(model, tokenizer, docs, T=2)
    hook.remove()
    h0 = evaluation_initial_state(model.config.d_model, 12, 1234, "cpu")
    nats, count, num_bytes, expected_shapes = 0.0, 0, 0, []
    for doc in docs:
        ids = tokenizer.encode(doc)[:13]  # no BOS
        if len(ids) < 2:
            continue
        x, y = torch.tensor([ids[:-1]]), torch.tensor([ids[1:]])
        expected_shapes.append(tuple(x.shape))
        doc_nats = model(x, targets=y, T=2, h0=h0[:, :x.size(1)], reduction="none")[0]
        for target, n in zip(ids[1:], doc_nats.tolist()):
            nats, count = nats + n, count + 1
            num_bytes += len(tokenizer.enc.decode_single_token_bytes(target))
    assert len(tokenizer.encode(docs[0])) > 13 and len(tokenizer.encode(docs[1])) < 2  # cropped; skipped
    assert shapes == expected_shapes  # one document per forward, as long as its own tokens (no BOS, no padding)
    assert (num_docs, tokens) == (3, count)
    assert num_bytes > count  # multi-byte tokens, so the byte weighting matters
    assert loss == pytest.approx(nats / count, rel=1e-6)
    assert bpb == pytest.approx(nats / (math.log(2) * num_bytes), rel=1e-6)
    assert evaluate_ppl(model, tokenizer, docs, T=1)[0] != pytest.approx(loss, rel=1e-4)  # T reaches the model


def test_fit_recovers_the_law():
    gen = torch.Generator().manual_seed(0)
    Ts = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    L_inf, Z, z = 2.95, 1.8, 0.35
    losses = [L_inf + Z * math.exp(-z * T) + 1e-4 * torch.randn((), generator=gen).item() for T in Ts]
    fit = fit_test_time_scaling(Ts, losses)
    assert fit["L_inf"] == pytest.approx(L_inf, abs=2e-3)
    assert fit["Z"] == pytest.approx(Z, rel=2e-2)
    assert fit["z"] == pytest.approx(z, rel=2e-2)
    assert fit["rms"] < 3e-4 and not fit["at_edge"]
    with raises_naming(ValueError, "[1, 2]", "--T"):
        fit_test_time_scaling([1, 2], [3.0, 2.9])


def test_a_prefix_of_a_flag_is_not_taken_for_it(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path))
    with raises_naming(ValueError, "--batch=4"):  # a prefix of --batch_size is not taken for it
        eval_core.main(["--eval", "bpb", "--batch=4"])


def tiny_run(tmp_path, overflow=False, huge=False):
    """Run "tiny": a 1-1-1 Parcae at step 7 on a corpus and tokenizer of its own -> (its checkpoint, its corpus).
    overflow: its coda's MLP weights times 1e30, finite, but every forward overflows to NaN.
    huge: its final norm's weight times 1e4, so every loss is finite but past 709 nats, whose exp overflows."""
    from nanoparcae.checkpoint import run_dir, save_checkpoint
    from nanoparcae.dataset import data_key
    from nanoparcae.tokenizer import Tokenizer
    from conftest import write_corpus
    ours = write_corpus(tmp_path / "ours.txt")
    Tokenizer.train(iter([ours.read_text()]), vocab_size=260).save(tmp_path / "tok")
    torch.manual_seed(0)
    model = Parcae(ParcaeConfig(vocab_size=260, seq_len=32, n_prelude=1, n_recur=1, n_coda=1, d_model=64,
                                head_dim=32, mu_rec=3))
    with torch.no_grad():
        model.coda[0].mlp.c_fc.weight.mul_(1e30 if overflow else 1)
        model.norm_f.weight.mul_(1e4 if huge else 1)
    path = run_dir("tiny") / "ckpt_000007.pt"
    save_checkpoint(path, model, step=7, args={"data": str(ours)}, run={"data": data_key(str(ours))},
                    tokenizer_dir=str(tmp_path / "tok"))
    return path, ours


def test_an_eval_on_other_data_or_fewer_tokens_never_replaces_the_runs_own(tmp_path, capsys):
    """The run's own result beside its checkpoint, which the report card reads, is replaced only by an eval on the
    run's own data measuring at least as many tokens; one on --data=OTHER, or with fewer --val_tokens, goes to the
    run's evals/ folder, named after what it measured."""
    from nanoparcae.dataset import data_key
    from experiments.report import read_run
    path, ours = tiny_run(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text(ours.read_text().replace("loop", "ring"))
    own, evals = path.with_name("ckpt_000007_bpb_T1.json"), path.parent / "evals"

    def evaluate(*flags):
        eval_core.main(["--eval=bpb", f"--ckpt={path}", "--T=1", "--batch_size=2", "--device=cpu", *flags])
        return json.loads(own.read_text())["measured"]

    assert evaluate("--val_tokens=256") == {"data": data_key(str(ours)), "amount": 256}
    kept = own.read_bytes()
    evaluate("--val_tokens=64")
    evaluate(f"--data={other}", "--val_tokens=512")
    assert own.read_bytes() == kept and carries(capsys.readouterr().out, str(own))
    assert sorted(p.name for p in evals.iterdir()) == sorted([f"ckpt_000007_bpb_T1_{data_key(str(ours))}_64.json",
                                                               f"ckpt_000007_bpb_T1_{data_key(str(other))}_512.json"])
    assert read_run(path.parent)["bpb"]["measured"]["amount"] == 256
    assert evaluate(f"--data={ours}", "--val_tokens=512")["amount"] == 512  # the same files, more tokens
    assert read_run(path.parent)["bpb"]["measured"]["amount"] == 512


def test_results_are_checked_for_their_size_before_the_work_and_kept_when_the_write_fails(tmp_path, monkeypatch,
                                                                                       capsys):
    """A disk with less room than the result: refused before any depth is scored. A write refused after the work
    (ENOSPC while free space shows, as a quota does): the results kept as a JSON line on stdout, said so."""
    import errno
    import shutil
    from nanoparcae import files
    from nanoparcae.command import EnvironmentFailure
    path, _ = tiny_run(tmp_path)
    flags = ["--eval=bpb", f"--ckpt={path}", "--T=1,2,4", "--batch_size=2", "--val_tokens=128", "--device=cpu"]
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda folder: usage._replace(free=2000))
    with raises_naming(EnvironmentFailure, str(path.parent)):
        eval_core.main(flags)
    assert "T =" not in capsys.readouterr().out  # nothing scored
    monkeypatch.undo()

    write_text = type(path).write_text

    def quota(self, text):
        if self.parent == path.parent:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(self, text)
    monkeypatch.setattr(type(path), "write_text", quota)
    with pytest.raises(EnvironmentFailure) as refused:
        eval_core.main(flags)
    kept = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert carries(str(refused.value), str(path.with_name("ckpt_000007_bpb_T1-2-4.json")), "JSON"), refused.value
    assert kept["T"] == [1, 2, 3, 4] and not list(path.parent.glob("*.json*"))


def test_results_that_are_not_finite_are_refused_not_kept(tmp_path, monkeypatch, capsys):
    """Finite weights that overflow: every loss is NaN. The eval ends in one line with a diverged run's status, 3, and
    leaves no result as the run's own."""
    from conftest import run_here
    path, _ = tiny_run(tmp_path, overflow=True)
    result = run_here(["eval_core.py", "--eval=bpb", f"--ckpt={path}", "--T=1,2,4", "--batch_size=2",
                       "--val_tokens=128", "--device=cpu"], monkeypatch, capsys)
    assert result.returncode == 3 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert carries(result.stderr, str(path), "loss[0]") and not list(path.parent.glob("*.json"))


def test_a_fit_at_the_edge_of_its_search_says_so(capsys):
    """Losses near 2.75 that rise at large T: z ends at its smallest rate and L_inf far above every loss."""
    fit = eval_core.fit_line([1, 2, 4, 8, 16, 32], [2.76, 2.75, 2.745, 2.75, 2.76, 2.78], 8)
    assert fit["at_edge"] and fit["L_inf"] > 3
    assert carries(capsys.readouterr().out, "warning:", f"z = {fit['z']:g}")


EVAL_FLAGS = ["--eval=bpb", "--T=1,2", "--batch_size=2", "--val_tokens=64", "--device=cpu"]


@pytest.mark.parametrize("there", ["a folder", "a list"])
def test_a_result_name_held_by_a_folder_or_a_list_is_refused_before_the_work(tmp_path, monkeypatch, capsys, there):
    """Probes: eval_core computed every depth, then failed on a result name that is a folder (IsADirectoryError), or
    on an earlier eval JSON that holds a list (AttributeError), and the results were lost. Both are refused in one
    line naming that path before any depth is scored, and the path is left as it was."""
    from conftest import refused, run_here
    path, _ = tiny_run(tmp_path)
    own = path.with_name("ckpt_000007_bpb_T1-2.json")
    own.mkdir() if there == "a folder" else own.write_text("[1, 2]")
    result = run_here(["eval_core.py", f"--ckpt={path}", *EVAL_FLAGS], monkeypatch, capsys)
    assert carries(refused(result), str(own)) and "T =" not in result.stdout, result
    assert own.is_dir() if there == "a folder" else own.read_text() == "[1, 2]"


def test_no_usable_temporary_folder_is_said_so_not_blamed_on_the_checkpoint(tmp_path, monkeypatch, capsys):
    """Probe: with every temporary location full, eval_core said the checkpoint "is not a nanoparcae checkpoint (...
    No usable temporary directory ...)". Sizing the model imports torch's compiler, which wants a temporary folder:
    that error, as tempfile raises it, is the line."""
    from conftest import run_here
    path, _ = tiny_run(tmp_path)

    def no_temporary_folder(model):
        raise FileNotFoundError(2, "No usable temporary directory found in ['/tmp', '/var/tmp', '/usr/tmp']")
    monkeypatch.setattr(Parcae, "init_weights", no_temporary_folder)
    result = run_here(["eval_core.py", f"--ckpt={path}", *EVAL_FLAGS], monkeypatch, capsys)
    assert result.returncode != 0 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "No usable temporary directory" in result.stderr and "checkpoint" not in result.stderr, result.stderr


def test_a_finite_loss_too_large_for_its_perplexity_prints_inf(tmp_path, monkeypatch, capsys):
    """Probe: `OverflowError: math range error` printing the perplexity of a finite loss past 709 nats. --eval bpb
    prints ppl inf and keeps its finite results; --eval ppl, whose results would hold inf, is refused in one line
    with a diverged run's status, 3."""
    from conftest import run_here
    path, corpus = tiny_run(tmp_path, huge=True)
    result = run_here(["eval_core.py", f"--ckpt={path}", *EVAL_FLAGS], monkeypatch, capsys)
    assert result.returncode == 0 and "ppl inf" in result.stdout, result
    losses = json.loads(path.with_name("ckpt_000007_bpb_T1-2.json").read_text())["loss"]
    assert min(losses) > 709 and all(map(math.isfinite, losses)), losses
    result = run_here(["eval_core.py", f"--ckpt={path}", "--eval=ppl", "--T=1", "--max_docs=2", "--device=cpu"],
                      monkeypatch, capsys)
    assert result.returncode == 3 and carries(result.stderr, "ppl[0]") and "ppl inf" in result.stdout, result

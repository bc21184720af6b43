"""
Tests for interop/harness.py, the lm-evaluation-harness model, offline: tasks are harness configs over small jsonl
files written here. A rolling task's word perplexity is data.evaluate_bpb's nats over the same words; a
LAMBADA-style task's accuracy and perplexity are a hand computation's; generate_until is sample.py's greedy text,
cut at its stop strings. Skipped where lm-eval is not installed (pip install -r requirements-eval.txt; CI has it).

    python -m pytest tests/test_harness.py -q
"""

import functools
import json
import math
import os
import re

import pytest
import torch
import torch.nn.functional as F

for flag in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # read when datasets is imported: set before lm_eval
    os.environ[flag] = "1"
lm_eval = pytest.importorskip("lm_eval", reason="lm_eval does not import; pip install -r requirements-eval.txt adds it")
from lm_eval.api.instance import Instance  # noqa: E402

from interop import harness  # noqa: E402  (after the skip: it needs lm_eval)
import sample  # noqa: E402
from nanoparcae.checkpoint import save_checkpoint  # noqa: E402
from conftest import carries  # noqa: E402
from nanoparcae.tokenizer import Tokenizer  # noqa: E402
from data import evaluate_bpb  # noqa: E402
from model import Parcae, ParcaeConfig, evaluation_initial_state  # noqa: E402

pytestmark = pytest.mark.slow  # every test reads a model trained for 60 steps
SEED = 1234
DOCS = ["The river ran past the old mill and into the town.", "A cat sat on the mat; the dog sat on the log.",
        "Numbers 12 and 345 follow words, then tabs\tand  double spaces.", "Short one."]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "base"))


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """A tiny model that has learned DOCS by heart (so greedy decoding gets some last words right), its tokenizer."""
    tokenizer = Tokenizer.train(iter([" ".join(DOCS) * 20]), 300)
    torch.manual_seed(0)
    config = ParcaeConfig(vocab_size=300, seq_len=48, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=3)
    model = Parcae(config).train()
    x, y = torch.zeros(len(DOCS), 48, dtype=torch.long), torch.full((len(DOCS), 48), -1)
    for i, ids in enumerate(tokenizer.encode(DOCS, prepend_bos=True)):
        x[i, :len(ids) - 1], y[i, :len(ids) - 1] = torch.tensor(ids[:-1]), torch.tensor(ids[1:])
    optimizer, generator = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.Generator().manual_seed(0)
    for _ in range(60):
        model(x, targets=y, T=3, h0_generator=generator).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), tokenizer


def task(tmp_path, name, rows, **config):
    """A harness task config over a jsonl file of rows (the harness's own json loader, no network)."""
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return dict(task=name, dataset_path="json", dataset_kwargs={"data_files": {"test": str(path)},
                                                                "cache_dir": str(tmp_path / "hf")},
                test_split="test", **config)


@functools.lru_cache(maxsize=None)
def task_manager():
    """The harness's index without the task YAMLs it ships (reading them takes seconds): these tests give their
    tasks as whole configs."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_defaults=False)


def evaluate(lm, config):
    out = lm_eval.simple_evaluate(model=lm, tasks=[config], log_samples=True, bootstrap_iters=0,
                                  task_manager=task_manager())
    return out["results"][config["task"]], out["samples"][config["task"]]


def test_rolling_word_perplexity_is_the_projects_own(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    config = task(tmp_path, "tiny_rolling", [{"text": d} for d in DOCS], output_type="loglikelihood_rolling",
                  doc_to_text="", doc_to_target="{{text}}",
                  metric_list=[{"metric": m} for m in ("word_perplexity", "byte_perplexity", "bits_per_byte")])
    results, _ = evaluate(harness.HarnessLM(model, tokenizer, T=2, batch_size=3, seed=SEED), config)
    # the project's own: one BOS-led row per document, padded to seq_len (the h0 draw of that width)
    S = model.config.seq_len
    batches = []
    for doc in DOCS:
        ids = tokenizer.encode(doc)
        x, y = torch.zeros(1, S, dtype=torch.long), torch.full((1, S), -1)
        x[0, :len(ids)], y[0, :len(ids)] = torch.tensor([tokenizer.bos_id, *ids[:-1]]), torch.tensor(ids)
        batches.append((x, y))
    loss, bpb = evaluate_bpb(model, tokenizer, batches, T=2, seed=SEED)
    nats = loss * sum(len(tokenizer.encode(d)) for d in DOCS)
    words = sum(len(re.split(r"\s+", d)) for d in DOCS)
    assert results["word_perplexity,none"] == pytest.approx(math.exp(nats / words), rel=1e-5)
    assert results["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-5)


def hand_logprobs(model, ids, T):
    """log p(ids[i] | ids[:i]) for i >= 1 and whether each is the argmax: one forward, the evaluation's h0."""
    h0 = evaluation_initial_state(model.config.d_model, model.config.seq_len, SEED, "cpu")[:, :len(ids) - 1]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]), T=T, h0=h0)[0].float(), dim=-1)
    targets = torch.tensor(ids[1:])
    return logp.gather(1, targets[:, None])[:, 0], logp.argmax(-1) == targets


def test_rolling_windows_score_every_token_once(model_and_tokenizer):
    """A text longer than seq_len: the harness's windows (the first BOS-led, each later one led by the token
    before it, the last with a full context), each a row of at most seq_len tokens, sum to the text's log p."""
    model, tokenizer = model_and_tokenizer
    ids = tokenizer.encode(" ".join(DOCS) * 3)
    S = model.config.seq_len
    assert len(ids) > 2 * S
    windows, predicted = [([tokenizer.bos_id, *ids[:S - 1]], S - 1)], S - 1
    while predicted < len(ids):
        n = min(S - 1, len(ids) - predicted)
        windows.append((ids[predicted + n - S:predicted + n] if n < S - 1 else ids[predicted - 1:predicted + n], n))
        predicted += n
    expected = sum(hand_logprobs(model, row, 3)[0][-n:].sum().item() for row, n in windows)
    request = Instance("loglikelihood_rolling", {}, (tokenizer.decode(ids),), 0)
    assert harness.HarnessLM(model, tokenizer, T=3, seed=SEED).loglikelihood_rolling([request])[0] == \
        pytest.approx(expected, rel=1e-5)


def test_last_word_accuracy_and_perplexity_are_the_hand_check(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    # the documents it learned and ones it never saw: a mix of hits and misses
    texts = DOCS + ["Blue glass fell upon quiet stones.", "The mill sat on the river of numbers.", "A dog ran."]
    config = task(tmp_path, "tiny_lambada", [{"text": t} for t in texts], output_type="loglikelihood",
                  doc_to_text="{{text.split(' ')[:-1]|join(' ')}}", doc_to_target="{{' '+text.split(' ')[-1]}}",
                  metric_list=[{"metric": "acc"}, {"metric": "perplexity"}])
    results, _ = evaluate(harness.HarnessLM(model, tokenizer, T=3, batch_size=2, seed=SEED), config)
    hits, logprobs = [], []
    for text in texts:
        context = text.rsplit(" ", 1)[0]
        ids = [tokenizer.bos_id, *tokenizer.encode(text)]
        n = len(ids) - 1 - len(tokenizer.encode(context))  # the last word's tokens (with its space)
        logp, greedy = hand_logprobs(model, ids, 3)
        hits.append(bool(greedy[-n:].all()))
        logprobs.append(logp[-n:].sum().item())
    assert 0 < sum(hits) < len(hits)  # the check can tell a hit from a miss
    assert results["acc,none"] == pytest.approx(sum(hits) / len(hits))
    assert results["perplexity,none"] == pytest.approx(math.exp(-sum(logprobs) / len(logprobs)), rel=1e-5)


def test_generate_until_is_sample_py_greedy_cut_at_stop_strings(model_and_tokenizer, tmp_path, capsys):
    model, tokenizer = model_and_tokenizer
    tokenizer.save(tmp_path / "tok")
    save_checkpoint(tmp_path / "ckpt.pt", model, tokenizer_dir=str(tmp_path / "tok"))
    prompts = ["The river ran", "A cat sat on"]
    greedy = []
    for prompt in prompts:
        sample.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--prompt", prompt, "--temperature", "0", "--T", "2",
                     "--max_new_tokens", "10", "--seed", str(SEED), "--device", "cpu"])
        out = capsys.readouterr().out
        assert out.startswith(prompt) and out.endswith("\n")
        greedy.append(out[len(prompt):-1])
    assert all(len(text) > 4 for text in greedy)
    # a stop string inside the first text and not in the second, which then runs its full 10 tokens
    stop = next(greedy[0][i:i + 2] for i in range(1, len(greedy[0]) - 1) if greedy[0][i:i + 2] not in greedy[1])
    expected = [greedy[0].split(stop)[0], greedy[1]]
    lm = harness.HarnessLM(model, tokenizer, T=2, seed=SEED)
    requests = [Instance("generate_until", {}, (p, {"until": [stop], "max_gen_toks": 10}), i)
                for i, p in enumerate(prompts)]
    assert lm.generate_until(requests) == expected
    config = task(tmp_path, "tiny_generate", [{"prompt": p} for p in prompts], output_type="generate_until",
                  doc_to_text="{{prompt}}", doc_to_target="", generation_kwargs={"until": [stop], "max_gen_toks": 10},
                  metric_list=[{"metric": "exact_match"}])
    _, samples = evaluate(lm, config)
    assert [s["resps"][0][0] for s in sorted(samples, key=lambda s: s["doc_id"])] == expected


def test_the_command_runs_a_yaml_task_and_writes_json(model_and_tokenizer, tmp_path, monkeypatch, capsys):
    """python -m interop.harness over a task YAML (the harness's include_path), at two depths, into the JSON
    beside the checkpoint; --help names the evaluation; CORE's task sets are refused with one line."""
    from lm_eval.tasks import TaskManager
    model, tokenizer = model_and_tokenizer
    tokenizer.save(tmp_path / "tok")
    save_checkpoint(tmp_path / "ckpt.pt", model, tokenizer_dir=str(tmp_path / "tok"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_yaml.yaml").write_text(
        f"task: tiny_yaml\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        f"  cache_dir: {tmp_path / 'hf'}\n"
        f"test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{{{text}}}}'\n"
        f"metric_list:\n  - metric: word_perplexity\n")
    # the harness's index of this folder alone: reading every task YAML it ships takes seconds and finds nothing here
    monkeypatch.setattr(harness, "TaskManager",
                        lambda: TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False))
    harness.main(["--ckpt", str(tmp_path / "ckpt.pt"), "--tasks", "tiny_yaml", "--T", "1,3", "--device", "cpu"])
    written = json.loads((tmp_path / "ckpt_harness_T1-3.json").read_text())
    ppl = [written["results"][T]["tiny_yaml"]["word_perplexity,none"] for T in ("1", "3")]
    assert all(math.isfinite(p) and p > 1 for p in ppl) and ppl[0] != ppl[1]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        harness.main(["--help"])
    out = capsys.readouterr().out
    assert "harness" in out and "requirements-eval.txt" in out
    with pytest.raises(ValueError) as err:
        harness.run_harness(model, tokenizer, "core", [2])
    assert carries(str(err.value), "--tasks"), err.value  # the flag, which takes the harness's names

"""runs/speedrun.sh rehearsed on a CPU: a tiny model at depth 6, gloo with 2 processes, a local server standing in
for FineWeb-Edu's and the eval bundle's hosts; killed mid-training, then run again; and the card's numbers against
the run's files. Without a GPU and without the rehearsal, the recipe stops in one line before it does anything."""

import csv
import io
import json
import os
import signal
import subprocess
import sys
import time
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import ROOT, awaited, beforehand, carries, environment, serving, write_corpus

STEPS = 30  # within a pass of the one training shard
TRAIN_FLAGS = ["--d_model=64", "--head_dim=32", "--vocab_size=320", "--seq_len=32", "--device_batch_size=2",
               "--total_batch_size=256", f"--max_tokens={STEPS * 256}", "--eval_every=1000", "--eval_tokens=512",
               "--save_every=5", "--log_every=1", "--dtype=float32", "--compile=0"]
EVAL_FLAGS = ["--val_tokens=1024", "--batch_size=4", "--max_docs=8", "--max_per_task=4"]
KILL_AFTER = 7  # a step logged after the checkpoint of step 5


def serve_data(server, tmp_path):
    """FineWeb-Edu's shard 0 and validation shard, and an eval bundle of 4 tasks (one of them extended). Shard 0's
    4,800 documents give each of the run's 4 loaders more than its 1,000-document buffer."""
    paragraphs = write_corpus(tmp_path / "corpus.txt").read_text().split("\n\n")
    documents = [f"{n}: {paragraphs[n % 360]}" for n in range(4800)]
    pq.write_table(pa.table({"text": documents}), server.root / "shard_00000.parquet", row_group_size=64)
    pq.write_table(pa.table({"text": paragraphs[360:]}), server.root / "shard_01822.parquet", row_group_size=8)
    records = {
        "commonsense_reasoning/copa.jsonl": [{"query": f"Item {i}: the loop", "choices": ["runs", "stops"],
                                              "gold": i % 2} for i in range(8)],
        "world_knowledge/mmlu.jsonl": [{"query": f"Question {i}:", "choices": ["state", "depth", "step", "token"],
                                        "gold": i % 4} for i in range(8)],
        "language_understanding/winograd_wsc.jsonl": [{"context_options": [f"the state {i}", f"the depth {i}"],
                                                       "continuation": "grows.", "gold": i % 2} for i in range(8)],
        "language_understanding/lambada_openai.jsonl": [{"context": f"the loop runs {i} and", "continuation": " the"}
                                                        for i in range(8)]}
    meta = io.StringIO()
    writer = csv.writer(meta)
    writer.writerow(["Eval Task", "Random baseline"])
    writer.writerows([["copa", 50], ["mmlu_zeroshot", 25], ["winograd", 50], ["lambada_openai", 0]])
    with zipfile.ZipFile(server.root / "eval_bundle.zip", "w") as archive:
        archive.writestr("eval_bundle/eval_meta_data.csv", meta.getvalue())
        for path, items in records.items():
            archive.writestr(f"eval_bundle/eval_data/{path}", "".join(json.dumps(item) + "\n" for item in items))


def rehearsal_env(base, server):
    return {**environment(), "NANOPARCAE_BASE_DIR": str(base), "CPU_REHEARSAL": "1", "SKIP_SETUP": "1", "NPROC": "2",
            "OMP_NUM_THREADS": "1", "TRAIN_FLAGS": " ".join(TRAIN_FLAGS), "EVAL_FLAGS": " ".join(EVAL_FLAGS),
            "DOWNLOAD_FLAGS": "-n 2", "FINEWEB_URL": server.url, "EVAL_BUNDLE_URL": f"{server.url}/eval_bundle.zip",
            "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}


def stage_times(output):
    """The recipe's "== NAME: done in ..." and "finished before ... skipped" lines -> {name: text}."""
    return {line.split(":")[0][3:]: line.split(": ", 1)[1] for line in output.splitlines()
            if line.startswith("== ") and (" done in " in line or "skipped" in line)}


def rehearsal(folder):
    """The recipe killed mid-training, then run again to its end -> the folder, the first run's log, the steps it
    logged and the checkpoints it left, and the second run (its CompletedProcess)."""
    with serving(folder / "www") as server:
        serve_data(server, folder)
        base = folder / "base"
        run_dir = base / "runs" / "d6_diagonal"
        env = rehearsal_env(base, server)
        log = folder / "first.log"
        with log.open("w") as out:
            first = subprocess.Popen(["bash", "runs/speedrun.sh"], cwd=ROOT, env=env, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 240
        while f'"step": {KILL_AFTER}, "loss"' not in ((run_dir / "metrics.jsonl").read_text()
                                                       if (run_dir / "metrics.jsonl").exists() else ""):
            assert first.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)  # the recipe, torchrun and its workers, mid-training
        first.wait()
        killed_at = len([line for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line])
        saved = sorted(path.name for path in run_dir.glob("ckpt_*.pt"))
        second = subprocess.run(["bash", "runs/speedrun.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=400)
    return folder, log.read_text(), (killed_at, saved), second


@pytest.mark.slow
@beforehand(rehearsal)
def test_rehearsal_killed_in_training_continues_and_its_card_reads_its_files():
    folder, first_log, (killed_at, saved), second = awaited(rehearsal)
    run_dir = folder / "base" / "runs" / "d6_diagonal"
    assert killed_at < STEPS and "ckpt_000005.pt" in saved
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    times = stage_times(second.stdout)
    assert {name for name, text in times.items() if "skipped" in text} == {"machine", "download", "tokenizer"}
    assert "resumed d6_diagonal at step 5" in second.stdout
    assert "the eval bundle: " in (run_dir / "recipe" / "download.log").read_text()  # fetched before training
    assert {"train", "eval_bpb", "eval_ppl", "eval_core", "figures", "samples_T1", "samples_T8"} <= set(times)
    print(first_log + second.stdout)  # the stages and their times, for the note

    card = (run_dir / "report.md").read_text()
    ckpt = torch.load(run_dir / f"ckpt_{STEPS:06d}.pt", weights_only=True, map_location="cpu")
    assert f"- tokens: {STEPS * 256:,} trained" in card and ckpt["step"] == STEPS
    assert "over 2 attempt(s) (1 interrupted" in card and "| report | 1 | 0 | running |" in card
    bpb = json.loads(next(run_dir.glob(f"ckpt_{STEPS:06d}_bpb_T*.json")).read_text())
    ppl = json.loads(next(run_dir.glob(f"ckpt_{STEPS:06d}_ppl_T*.json")).read_text())
    assert bpb["T"] == [1, 2, 4, 8, 16, 32]
    for T, loss, bits in zip(bpb["T"], bpb["loss"], bpb["bpb"]):
        assert f"| {T} | {loss:.4f} | {bits:.4f} | " in card
    assert f"| 8 | {bpb['loss'][3]:.4f} | {bpb['bpb'][3]:.4f} | {ppl['ppl'][0]:.2f} |" in card
    assert f"L_inf {bpb['fit']['L_inf']:.4f}" in card
    core = json.loads(next(run_dir.glob(f"ckpt_{STEPS:06d}_core_T8.json")).read_text())["runs"][0]
    assert f"CORE {core['core']:.4f}, Core-Extended {core['core_extended']:.4f}" in card
    for label, accuracy in core["accuracy"].items():
        assert f"| {label} | {'extended' if label == 'mmlu_zeroshot' else 'CORE'} | {accuracy:.4f} |" in card
    assert f"| val PPL | 19.06 | {ppl['ppl'][0]:.2f} |" in card and "not comparable" in card
    samples = (run_dir / "recipe" / "samples_T8.txt").read_text()
    assert samples.strip() and samples.strip() in card
    assert "![loss curve](loss.png)" in card and (run_dir / "loss.png").is_file()
    assert (run_dir / f"ckpt_{STEPS:06d}_bpb_T1-2-4-8-16-32.png").is_file()


def test_without_a_gpu_it_stops_before_anything_naming_cpu_sh(tmp_path):
    bin_dir = tmp_path / "bin"  # nvidia-smi as on a machine without a GPU: absent
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "grep"):
        (bin_dir / tool).symlink_to(subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip())
    result = subprocess.run(["bash", "runs/speedrun.sh"], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": str(bin_dir), "HOME": str(tmp_path), "NANOPARCAE_BASE_DIR": str(tmp_path)})
    assert result.returncode != 0 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "runs/cpu.sh" in result.stderr
    assert "GPU" in result.stderr
    assert list(tmp_path.iterdir()) == [bin_dir]  # nothing made, nothing downloaded


@pytest.mark.parametrize("args,env,named", [
    (["6", "diagonal", "--max_tokens=1000"], {}, "--max_tokens=1000"),  # an extra argument is never dropped
    ([], {"NPROC": "0"}, "NPROC=0"),
    ([], {"NPROC": "abc"}, "NPROC=abc"),
    (["7"], {}, "7"),
])
def test_the_recipe_s_own_inputs_are_refused_in_one_line_before_anything(args, env, named, tmp_path):
    result = subprocess.run(["bash", "runs/speedrun.sh", *args], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "HOME": str(tmp_path), "NANOPARCAE_BASE_DIR": str(tmp_path / "base"),
                                 **env})
    assert result.returncode == 2 and result.stdout == "", result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and named in result.stderr, result.stderr
    assert not (tmp_path / "base").exists()


@pytest.mark.slow
@pytest.mark.parametrize("env,named", [({"VOCAB_SIZE": "100"}, ["--vocab_size", "100"]),
                                       ({"TRAIN_FLAGS": "--d_model=64 --head_dim=48"}, ["d_model=64", "head_dim=48"])])
def test_vocab_size_and_train_flags_are_checked_by_train_py_before_the_first_stage(env, named, tmp_path):
    """No machine stage, no download: the host given for the shards is one no server listens on. A shape the model
    refuses (d_model 64 over heads of 48) is refused here too, since --check runs training's own checks."""
    result = subprocess.run(["bash", "runs/speedrun.sh"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                            env={**environment(), "HOME": str(tmp_path), "NANOPARCAE_BASE_DIR": str(tmp_path / "base"),
                                 "CPU_REHEARSAL": "1", "SKIP_SETUP": "1", "FINEWEB_URL": "http://127.0.0.1:9",
                                 "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}", **env})
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert carries(result.stderr, *named) and not (tmp_path / "base").exists(), result.stderr


def test_a_failed_stage_that_a_rerun_cannot_fix_says_so(tmp_path):
    """A stage failing with 2 (bad input) or 3 (diverged) ends on another line than one a rerun continues (1)."""
    last = {}
    for status in (1, 2, 3):
        script = f'set -o pipefail; RECIPE={tmp_path}; . runs/stage.sh; stage s bash -c "exit {status}"'
        result = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == status and not (tmp_path / "s.done").exists()
        last[status] = result.stderr.strip().splitlines()[-1]
        assert f"exit status {status}" in last[status]
    assert len({line.split("; ", 1)[1] for line in last.values()}) == 3, last

"""Bad input ends in one line naming the problem and the fix, never a traceback: a table of commands, each run
as a user runs it, with the status it must end in and the words its line must carry.

Run: python -m pytest -q tests/test_bad_input.py   (each case starts a process: marked slow)
"""

import os

import pytest

from conftest import TINY, carries, python
from nanoparcae import dataset


def one_document(tmp_path, base, monkeypatch):
    """A text file of one document, which the hash rule puts in the train split: no validation document."""
    path = tmp_path / "one.txt"
    path.write_text("just one document here, nothing more.\n")
    assert not dataset.is_val_document(path.read_text())
    return {"one": path}


def base_is_a_file(tmp_path, base, monkeypatch):
    (tmp_path / "a_file").write_text("")
    return {"base": tmp_path / "a_file"}


def three_shards(tmp_path, base, monkeypatch):
    """Three FineWeb-Edu training shards and the validation shard. The download's rule counts about 32.5M tokens a
    shard, so a run of 1e8 tokens needs a fourth."""
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(base))
    from test_data import write_shards
    write_shards([0, 1, 2, dataset.FINEWEB_VAL_SHARD])
    return {}


def corrupt_pages(tmp_path, base, monkeypatch):
    """A folder of text: a parquet file whose row group 1 holds random bytes, beside a jsonl file."""
    from test_data import corrupt, make_documents, write_jsonl
    (tmp_path / "corpus").mkdir()
    write_jsonl(tmp_path / "corpus" / "fine.jsonl", make_documents(200))
    return {"corpus": tmp_path / "corpus", "corrupt": corrupt(tmp_path / "corpus" / "part.parquet", "pages")}


# command (placeholders from the setup), setup, status, words naming the problem, words naming the fix
CASES = {
    "one document": (["train.py", *TINY, "--data={one}"], one_document, 2,
                     ["val", "no documents"], ["blank line"]),
    "base folder a file": (["train.py"], base_is_a_file, 2,
                           ["base folder", "{base}"], ["NANOPARCAE_BASE_DIR"]),
    "base folder a file, --resume": (["train.py", "--resume"], base_is_a_file, 2,
                                     ["base folder", "{base}"], ["NANOPARCAE_BASE_DIR"]),
    "base folder a file, sample.py": (["sample.py"], base_is_a_file, 2,
                                      ["base folder", "{base}"], ["NANOPARCAE_BASE_DIR"]),
    "base folder a file, eval_core.py": (["eval_core.py"], base_is_a_file, 2,
                                         ["base folder", "{base}"], ["NANOPARCAE_BASE_DIR"]),
    "base folder a file, download": (["-m", "nanoparcae.dataset", "download", "-n", "2"], base_is_a_file, 2,
                                     ["base folder", "{base}"], ["NANOPARCAE_BASE_DIR"]),
    "base folder a file, tokenizer": (["-m", "nanoparcae.tokenizer"], base_is_a_file, 2,
                                      ["base folder", "{base}"], ["NANOPARCAE_BASE_DIR"]),
    "base folder a file, hub sample": (["-m", "interop.hub", "sample", "d6_diagonal"], base_is_a_file, 2,
                                       ["base folder", "{base}"], ["NANOPARCAE_BASE_DIR"]),
    "--resume, nothing to resume": (["train.py", "--resume"], None, 2,
                                    ["no checkpoint", "d6_diagonal"], ["without", "--resume"]),
    "horizon past the shards on disk": (["train.py", *TINY, "--data=fineweb-edu", "--max_tokens=1e8"], three_shards,
                                        2, ["FineWeb-Edu", "3 are on disk"],
                                        ["python -m nanoparcae.dataset download --tokens=100000000"]),
    "corrupt row group": (["train.py", *TINY, "--data={corpus}"], corrupt_pages, 2, ["{corrupt}", "row group 1"],
                          ["remove"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_naming_the_problem_and_the_fix(case, tmp_path, monkeypatch):
    command, setup, status, problem, fix = CASES[case]
    base = tmp_path / "base"
    values = {"base": base}
    if setup:
        values.update(setup(tmp_path, base, monkeypatch))
    env = {"NANOPARCAE_BASE_DIR": str(values["base"]), "OMP_NUM_THREADS": "1"}
    result = python([word.format(**values) for word in command], {**os.environ, **env})
    err = result.stderr.strip()
    assert result.returncode == status and len(err.splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert carries(err, *[word.format(**values) for word in problem]), err
    assert carries(err, *fix), err
    if case == "--resume, nothing to resume":
        assert "shard" not in err  # the missing run first, not the missing data


@pytest.mark.slow
def test_a_backpropagated_depth_above_the_mean_is_said_with_its_fix(tmp_path):
    """--mu_bwd above --mu_rec trains (full backprop through the loop is an ablation), with a warning naming both
    flags and the paper's value."""
    env = {**os.environ, "NANOPARCAE_BASE_DIR": str(tmp_path / "base"), "OMP_NUM_THREADS": "1"}
    result = python(["train.py", *TINY, "--mu_rec=4", "--mu_bwd=9", "--dry_run"], env)
    assert result.returncode == 0, result.stderr[-3000:]
    warning = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and carries(warning[0], "--mu_bwd=9", "--mu_rec=4", "--mu_bwd=2"), result.stdout
    quiet = python(["train.py", *TINY, "--mu_rec=4", "--mu_bwd=4", "--dry_run"], env)
    assert quiet.returncode == 0 and "warning:" not in quiet.stdout, quiet.stdout

"""The random init runs once per run: on a fresh run's rank 0. The other ranks and a resume build the model
without it, and train as before."""

import pytest
import torch

from conftest import ROOT, TINY, awaited, beforehand, carries, python, train_env, write_corpus
from model import Parcae, ParcaeConfig
from nanoparcae.checkpoint import training_model

CONFIG = ParcaeConfig(vocab_size=97, seq_len=16, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32)


@pytest.fixture
def inits(monkeypatch):
    """The devices on which Parcae.init_weights ran (a model sized on the meta device runs it there, at no cost)."""
    devices, init_weights = [], Parcae.init_weights

    def counted(model):
        devices.append(next(model.parameters()).device.type)
        return init_weights(model)
    monkeypatch.setattr(Parcae, "init_weights", counted)
    return devices


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_the_initialising_rank_draws_the_weights_it_drew_before(inits):
    torch.manual_seed(7)
    before = Parcae(CONFIG)
    torch.manual_seed(0)  # the seed is the argument's, not the caller's
    model = training_model(CONFIG, "cpu", 7)
    assert same_tensors(model.state_dict(), before.state_dict()) and model.training
    assert inits == ["cpu", "cpu"]


def test_a_resume_and_the_other_ranks_never_run_the_init(inits):
    reference = Parcae(CONFIG)
    inits.clear()
    weights = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    resumed = training_model(CONFIG, "cpu", 7, weights)
    assert same_tensors(resumed.state_dict(), reference.state_dict()) and resumed.training
    empty = training_model(CONFIG, "cpu", 7, initialise=False)
    assert all(tensor.device.type == "cpu" for tensor in empty.state_dict().values())
    assert empty.state_dict().keys() == reference.state_dict().keys()
    for model in (resumed, empty):  # the RoPE tables, which no checkpoint or broadcast needs to carry
        assert torch.equal(model.rope_cos, reference.rope_cos) and torch.equal(model.rope_sin, reference.rope_sin)
    assert set(inits) == {"meta"}


# train.py, each rank saying where it ran the random init on real weights
COUNTING = f"""
import os, sys, runpy
sys.path.insert(0, {str(ROOT)!r})
from model import Parcae
init_weights = Parcae.init_weights
def counted(model):
    if next(model.parameters()).device.type != "meta":
        print(f"random init on rank {{os.environ.get('RANK', 0)}}", file=sys.stderr, flush=True)
    return init_weights(model)
Parcae.init_weights = counted
sys.argv = [{str(ROOT / "train.py")!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def counted_runs(folder):
    """A run on two processes stopped after step 2, then resumed -> both finished processes."""
    write_corpus(folder / "corpus.txt")
    (folder / "counting").write_text(COUNTING)
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--",
               str(folder / "counting"), f"--data={folder / 'corpus.txt'}", *TINY, "--run=counted"]
    env = train_env(folder, base=folder / "base")
    return python([*command, "--stop_at=2"], env), python([*command, "--resume"], env)


@pytest.mark.slow
@beforehand(counted_runs)
def test_two_ranks_initialise_once_on_rank_0_and_a_resume_never():
    fresh, resumed = awaited(counted_runs)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    inits = [line for line in fresh.stderr.splitlines() if "random init" in line]
    assert len(inits) == 1 and carries(inits[0], "rank", "0"), inits
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert carries(resumed.stdout, "resumed", "counted", "2") and "random init" not in resumed.stderr

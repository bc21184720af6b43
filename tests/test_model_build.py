"""A model from a checkpoint's weights (model.from_weights) never runs the random init, and holds those weights;
the random init runs once per run, on a fresh run's rank 0."""

from dataclasses import asdict

import pytest
import torch

from conftest import ROOT, TINY, awaited, beforehand, carries, python, raises_naming, train_env, write_corpus
from model import Parcae, ParcaeConfig, from_weights

CONFIG = ParcaeConfig(vocab_size=97, seq_len=16, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32)


def test_a_model_from_weights_holds_them_and_never_runs_the_init(monkeypatch):
    """Its parameters are the weights given (cast to float32 where saved in bfloat16), its RoPE tables those of a
    model built with its init; the init ran on the meta device alone, where it fills nothing."""
    torch.manual_seed(3)
    reference = Parcae(CONFIG)
    weights = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    weights["wte.weight"] = weights["wte.weight"].bfloat16()
    devices, init_weights = [], Parcae.init_weights
    monkeypatch.setattr(Parcae, "init_weights", lambda model: (devices.append(model.wte.weight.device.type),
                                                                init_weights(model)))
    model = from_weights(asdict(CONFIG), weights)
    assert devices == ["meta"] and not model.training and model.config == CONFIG
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, weights[name].float()), name
    assert torch.equal(model.rope_cos, reference.rope_cos) and torch.equal(model.rope_sin, reference.rope_sin)


def test_a_config_or_weights_that_build_no_parcae_are_one_line():
    """A field no config has, a value of the wrong type, a shape ParcaeConfig refuses, or weights of another model:
    ValueError in one line, naming what is wrong."""
    weights = Parcae(CONFIG).state_dict()
    for config, named in ((dict(asdict(CONFIG), colour=1), "colour"), (dict(asdict(CONFIG), vocab_size="97"), "str"),
                          (dict(asdict(CONFIG), n_head=3), "n_head=3"), (dict(asdict(CONFIG), d_model=-64), "-64")):
        with raises_naming(ValueError, named) as err:
            from_weights(config, weights)
        assert "\n" not in str(err.value)
    with raises_naming(ValueError, "wte.weight") as err:
        from_weights(asdict(CONFIG), {**weights, "wte.weight": torch.zeros(3, 64)})
    assert "\n" not in str(err.value)


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

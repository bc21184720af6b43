"""Tests for nanoparcae.checkpoint.load_run, the one loader of a run: every command that loads a run finds it, and its
tokenizer, after the base folder has moved; the ways a checkpoint or its tokenizer can be wrong, each in one line;
and that it reads the weights alone, mapped, into a model without a random init whose logits are those of one loaded
in full."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from nanoparcae.checkpoint import load_run
from conftest import Started, carries, corrupt_a_weight, raises_naming, refused, run_here, train, train_env


@pytest.fixture(scope="module")
def moved(corpus):
    """A tiny run trained under corpus/base, then the base folder moved to corpus/moved -> the new base."""
    train(corpus, "--max_tokens=512", "--run=tiny")
    shutil.move(corpus / "base", corpus / "moved")
    return corpus / "moved"


@pytest.mark.slow
def test_every_command_that_loads_a_run_works_after_the_base_folder_moved(corpus, moved):
    """README: moving NANOPARCAE_BASE_DIR moves the runs. The checkpoint records the old tokenizer path; each command
    finds the tokenizer by its key under the new base folder. The four run at once, one thread each."""
    ckpt = moved / "runs" / "tiny" / "ckpt_000002.pt"
    commands = {
        "sample": ["sample.py", "--prompt=the loop", "--max_new_tokens=4"],
        "eval_core": ["eval_core.py", "--eval", "bpb", "--T", "1,2", "--val_tokens=64", "--batch_size=2"],
        "export": ["-m", "interop.hub", "export", "tiny", str(corpus / "exported")],
        "bench": ["-m", "experiments.bench", "--ckpt", str(ckpt), "--rows", "5", "--repeats", "1", "--new_tokens", "4"],
    }
    env = train_env(corpus, base=moved)
    running = {name: Started(args, env) for name, args in commands.items()}
    out = {}
    for name, process in running.items():
        out[name], err = process.communicate(timeout=300)
        assert process.returncode == 0, f"{name}: {err[-3000:]}"
    assert not (corpus / "base").exists()
    assert out["sample"].startswith("the loop")
    assert (moved / "runs" / "tiny" / "ckpt_000002_bpb_T1-2.json").is_file()
    assert {"config.json", "model.pt", "tokenizer.json"} <= {p.name for p in (corpus / "exported").iterdir()}
    assert "checkpoint tiny/ckpt_000002.pt" in out["bench"]  # the run's checkpoint, not the untrained stand-in


@pytest.mark.slow
def test_a_wrong_checkpoint_or_tokenizer_is_one_line(moved, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(moved))
    path = moved / "runs" / "tiny" / "ckpt_000002.pt"
    model, tokenizer, ckpt, found = load_run("tiny")
    assert found == path and not model.training and tokenizer.vocab_size == model.config.vocab_size == 320
    assert load_run(path)[3] == load_run(None)[3] == path  # a file, a run's name, the newest run

    def message(ckpt_or_run, error=ValueError):
        with pytest.raises(error) as err:
            load_run(ckpt_or_run)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert message(path.parent, FileNotFoundError) == (f"{path.parent} is a folder, not a checkpoint file; pass a "
                                                       f"checkpoint file such as its newest, {path}, or the run's "
                                                       f"name, tiny")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert message(tmp_path / "other.pt").startswith(f"checkpoint {tmp_path / 'other.pt'} is not a nanoparcae "
                                                     f"checkpoint (KeyError: 'config')")
    torch.save({**ckpt, "tokenizer_dir": str(tmp_path / "gone" / "files-0-320")}, tmp_path / "no_tokenizer.pt")
    assert message(tmp_path / "no_tokenizer.pt", FileNotFoundError).endswith(
        f"recreate it with `python -m nanoparcae.dataset tokenizer --data={ckpt['args']['data']} --vocab_size=320`")
    smaller = {**ckpt, "config": {**ckpt["config"], "vocab_size": 300}}  # padded to 320 as well: the same weights
    torch.save(smaller, tmp_path / "smaller.pt")
    assert message(tmp_path / "smaller.pt").endswith("has 320 tokens, the model 300: they are not from the same run")


# -----------------------------------------------------------------------------
# Loading for inference: the weights alone, memory-mapped, into a model with no random init

def tiny_checkpoint(path, tokenizer_dir, injection="diagonal", optimizer_bytes=0, seed=0):
    """A checkpoint of a tiny Parcae with random weights (not its zero-init ones) beside an optimizer entry of
    optimizer_bytes and the loaders' states, as train.py writes them -> (the model, its path)."""
    from model import Parcae, ParcaeConfig
    from nanoparcae.checkpoint import save_checkpoint
    config = ParcaeConfig(vocab_size=260, seq_len=32, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=3, injection=injection)
    model = Parcae(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    optimizer = {"state": {0: {"exp_avg": torch.ones(optimizer_bytes // 4)}}, "param_groups": []}
    save_checkpoint(path, model, step=7, args={"data": "stdlib", "vocab_size": 260}, optimizer=optimizer,
                    loader=[{"position": 3}], tokenizer_dir=str(tokenizer_dir))
    return model, path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from nanoparcae.tokenizer import Tokenizer
    directory = tmp_path_factory.mktemp("tok")
    Tokenizer.train(iter(["a checkpoint read for inference"] * 20), vocab_size=260).save(directory)
    return directory


@pytest.mark.parametrize("injection", ["diagonal", "concat", "add", "none"])
def test_load_run_gives_the_logits_of_a_randomly_initialised_model_loaded_in_full(tmp_path, tokenizer_dir, injection):
    """The model built without an init holds every parameter and buffer (the RoPE tables) of one built with its
    init and given the whole checkpoint, bit for bit, and so computes the same logits."""
    from model import Parcae, ParcaeConfig
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir, injection, optimizer_bytes=4096)
    full = torch.load(path, map_location="cpu", weights_only=True)
    old = Parcae(ParcaeConfig(**full["config"]))
    old.load_state_dict(full["model"])
    old.eval()
    model, tokenizer, ckpt, found = load_run(path)
    assert found == path and not model.training and tokenizer.vocab_size == 260
    old_tensors = {**dict(old.named_parameters()), **dict(old.named_buffers())}
    new_tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert old_tensors.keys() == new_tensors.keys() and {"rope_cos", "rope_sin"} <= new_tensors.keys()
    for name, tensor in old_tensors.items():
        loaded = new_tensors[name]
        assert (loaded.dtype, loaded.device, loaded.shape) == (tensor.dtype, tensor.device, tensor.shape), name
        assert torch.equal(loaded, tensor), name
        assert loaded.requires_grad == tensor.requires_grad, name
    idx = torch.randint(0, 260, (2, 20), generator=torch.Generator().manual_seed(1))
    h0 = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for T in (1, 5):
            assert torch.equal(model(idx, T=T, h0=h0), old(idx, T=T, h0=h0))
    # what callers read is there; what inference never needs is not
    assert ckpt["step"] == 7 and ckpt["args"]["data"] == "stdlib" and ckpt["config"] == full["config"]
    assert ckpt["tokenizer_dir"] == str(tokenizer_dir) and not {"optimizer", "loader"} & ckpt.keys()
    assert ckpt["model"].keys() == full["model"].keys()
    assert all(torch.equal(ckpt["model"][k], v) for k, v in full["model"].items())


def test_load_run_runs_no_random_init(tmp_path, tokenizer_dir, monkeypatch):
    """Every init (Parcae's and torch's module resets) may run on the meta device alone, where it fills nothing."""
    import model as model_module
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir)

    def on_meta_only(init):
        def guarded(tensor, *args, **kwargs):
            if not tensor.is_meta:
                raise AssertionError(f"{init.__name__} filled a {tensor.device} tensor")
            return init(tensor, *args, **kwargs)
        return guarded

    for name in ("trunc_normal_", "normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "orthogonal_"):
        monkeypatch.setattr(torch.nn.init, name, on_meta_only(getattr(torch.nn.init, name)))
    monkeypatch.setattr(model_module, "trunc_orthogonal_", on_meta_only(model_module.trunc_orthogonal_))
    init_weights = model_module.Parcae.init_weights

    def init_weights_on_meta_only(self):
        if not self.wte.weight.is_meta:
            raise AssertionError(f"init_weights filled a {self.wte.weight.device} tensor")
        init_weights(self)

    monkeypatch.setattr(model_module.Parcae, "init_weights", init_weights_on_meta_only)
    model = load_run(path)[0]
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    with raises_naming(AssertionError, "cpu"):  # the guards do catch an init
        model_module.Parcae(model.config)


def mapped_ranges(path):
    """The address ranges of this process that map the file at path."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def memory_kb(field):
    """VmRSS (resident now) or VmHWM (its peak) of this process, in kB."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status[field].split()[0])


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's /proc/self")
def test_load_run_reads_the_weights_alone_into_the_model_itself(tmp_path, tokenizer_dir):
    """On the CPU the model's weights are the mapped file's pages, not a copy of them; the optimizer's 256 MB is
    never read: the peak resident memory grows by far less while loading."""
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir, optimizer_bytes=256 * 2**20)
    Path("/proc/self/clear_refs").write_text("5")  # the peak, VmHWM, starts again from the resident size
    before = memory_kb("VmRSS")
    model = load_run(path)[0]
    assert memory_kb("VmHWM") - before < 64 * 1024
    ranges = mapped_ranges(path)
    assert ranges, "nothing maps the checkpoint's file"
    for name, p in model.named_parameters():
        assert any(start <= p.data_ptr() < end for start, end in ranges), f"{name} is a copy of the checkpoint's"


def test_a_truncated_checkpoint_is_one_line_naming_it(tmp_path, tokenizer_dir):
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir, optimizer_bytes=4096)
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with raises_naming(ValueError, str(path)) as err:
        load_run(path)
    assert "\n" not in str(err.value)


# -----------------------------------------------------------------------------
# Files that say whether they are whole and what they belong to: the tensors' digest, the tokenizer's

def run_with_tokenizer(base, tokenizer_dir):
    """A tiny run's checkpoint under base/runs/tiny, trained (as it records) with a copy of tokenizer_dir -> path."""
    from nanoparcae.tokenizer import Tokenizer
    ours = shutil.copytree(tokenizer_dir, base / "tokenizers" / "files-0-260")
    path = base / "runs" / "tiny" / "ckpt_000007.pt"
    model, _ = tiny_checkpoint(path, ours)
    ckpt = torch.load(path, weights_only=True)
    from nanoparcae.checkpoint import save_checkpoint
    save_checkpoint(path, model, **{key: ckpt[key] for key in ("step", "args", "optimizer", "loader", "tokenizer_dir")},
                    tokenizer_digest=Tokenizer.files_digest(ours))
    return path


@pytest.mark.parametrize("command", [["sample.py", "--prompt=a", "--max_new_tokens=2", "--ckpt={ckpt}"],
                                     ["eval_core.py", "--eval=bpb", "--data=stdlib", "--ckpt={ckpt}"],
                                     ["-m", "interop.hub", "export", "{ckpt}", "{out}"]])
def test_a_checkpoint_with_a_changed_byte_is_refused_by_every_command_that_loads_it(command, tmp_path, tokenizer_dir,
                                                                                   monkeypatch, capsys):
    """One byte amid the weights, the file's size unchanged: each command ends in one line naming the file, status
    2, and writes nothing; the same file whole loads."""
    path = run_with_tokenizer(Path(os.environ["NANOPARCAE_BASE_DIR"]), tokenizer_dir)
    load_run(path)
    corrupt_a_weight(path)
    args = [arg.format(ckpt=path, out=tmp_path / "exported") for arg in command]
    message = refused(run_here(args, monkeypatch, capsys))
    assert carries(message, str(path), "damaged", "model") and "remove" in message, message
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name] and not (tmp_path / "exported").exists()


def test_a_checkpoint_saved_before_digests_loads_with_one_warning_naming_it(tmp_path, tokenizer_dir, capsys):
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir)
    ckpt = torch.load(path, weights_only=True)
    del ckpt["digest"]
    torch.save(ckpt, path)
    model = load_run(path)[0]
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in ckpt["model"].items())
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and carries(warning[0], "warning:", str(path), "digest"), warning


def test_a_tokenizer_other_than_the_checkpoints_is_refused_naming_both(tmp_path, tokenizer_dir, monkeypatch, capsys):
    """Another tokenizer of the same size in the checkpoint's tokenizer folder (another run's, say): refused in one
    line naming the folder and the two digests; sample.py ends so, status 2."""
    from nanoparcae.tokenizer import Tokenizer
    path = run_with_tokenizer(Path(os.environ["NANOPARCAE_BASE_DIR"]), tokenizer_dir)
    ours = Path(torch.load(path, weights_only=True)["tokenizer_dir"])
    trained_with = Tokenizer.files_digest(ours)
    Tokenizer.train(iter(["another corpus altogether, another merge order"] * 20), vocab_size=260).save(ours)
    other = Tokenizer.files_digest(ours)
    assert other != trained_with
    with pytest.raises(ValueError) as err:
        load_run(path)
    assert carries(str(err.value), str(ours), other, str(path), trained_with) and "\n" not in str(err.value)
    message = refused(run_here(["sample.py", "--prompt=a", f"--ckpt={path}"], monkeypatch, capsys))
    assert carries(message, str(ours), other, trained_with), message


# -----------------------------------------------------------------------------
# A run is found by its exact name, and only the files train.py wrote are its checkpoints

def test_a_run_is_found_by_its_exact_name_never_as_a_pattern(tmp_path, tokenizer_dir):
    """Run x1 saved: `x[1]` and `x?` name no run (a glob would match x1), and x1 itself loads."""
    from nanoparcae.checkpoint import run_dir
    _, path = tiny_checkpoint(run_dir("x1") / "ckpt_000007.pt", tokenizer_dir)
    for pattern in ("x[1]", "x?", "*"):
        with pytest.raises(FileNotFoundError) as info:
            load_run(pattern)
        assert carries(str(info.value), str(run_dir(pattern))), info.value
    assert load_run("x1")[3] == path


def test_a_users_copy_of_a_checkpoint_is_neither_resumed_nor_pruned(tmp_path, tokenizer_dir):
    """ckpt_000010_backup.pt beside ckpt_000010.pt: the newest is the run's own, and its next save prunes
    ckpt_000010.pt alone."""
    from nanoparcae.checkpoint import latest, save_and_prune
    model, path = tiny_checkpoint(tmp_path / "ckpt_000010.pt", tokenizer_dir)
    copy = shutil.copy(path, tmp_path / "ckpt_000010_backup.pt")
    assert latest(tmp_path) == path
    loader = type("Loader", (), {"state_dict": lambda self: {"position": 5}})()
    save_and_prune(tmp_path, 12, model, [loader], tokenizer_dir=str(tokenizer_dir))
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000010_backup.pt", "ckpt_000012.pt"]
    assert Path(copy).is_file() and latest(tmp_path) == tmp_path / "ckpt_000012.pt"

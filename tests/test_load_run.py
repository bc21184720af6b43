"""Tests for nanoparcae.checkpoint.load_run, the one loader of a run: every command that loads a run finds it, and its
tokenizer, after the base folder has moved; the ways a checkpoint or its tokenizer can be wrong, each in one line;
and that it reads the weights alone, mapped, into a model without a random init whose logits are those of one loaded
in full."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from model import from_weights
from nanoparcae.checkpoint import load_run
from nanoparcae.command import EnvironmentFailure
from nanoparcae.tokenizer import tokenizer_dir as cache_folder
from conftest import ROOT, Started, carries, corrupt_a_weight, raises_naming, refused, run_here, train, train_env


def loaded(run=None, ckpt=None):
    """load_run, then the model built as every command builds it -> (model, tokenizer, checkpoint dict, path)."""
    ckpt, tokenizer, path = load_run(run, ckpt)
    return from_weights(ckpt["config"], ckpt["model"]), tokenizer, ckpt, path


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
    model, tokenizer, ckpt, found = loaded("tiny")
    assert found == path and not model.training and tokenizer.vocab_size == model.config.vocab_size == 320
    assert load_run(ckpt=path)[2] == load_run()[2] == path  # a file, a run's name, the newest run

    def message(path, error=ValueError):
        with pytest.raises(error) as err:
            load_run(ckpt=path)
        assert "\n" not in str(err.value)
        return str(err.value)

    assert message(path.parent) == (f"{path.parent} is a folder, not a checkpoint file; pass one, such as its "
                                    f"newest, {path}, or --run=tiny")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    assert carries(message(tmp_path / "other.pt"), str(tmp_path / "other.pt"), "nanoparcae", "config")

    def signed(**changes):  # the run's checkpoint with changes, as train.py would have saved it
        from nanoparcae.checkpoint import digest_of
        changed = {key: value for key, value in {**ckpt, **changes}.items() if key != "digest"}
        return {**changed, "digest": digest_of(changed)}
    torch.save(signed(tokenizer_dir=str(tmp_path / "gone" / "files-0-320")), tmp_path / "no_tokenizer.pt")
    assert message(tmp_path / "no_tokenizer.pt", FileNotFoundError).endswith(
        f"recreate it with `python -m nanoparcae.tokenizer --data={ckpt['args']['data']} --vocab_size=320`")
    copied = tmp_path / "copied" / "files-0-320"  # a tokenizer folder copied in part names the run's command
    shutil.copytree(cache_folder(key=Path(ckpt["tokenizer_dir"]).name), copied)
    (copied / "token_bytes.txt").unlink()
    torch.save(signed(tokenizer_dir=str(copied)), tmp_path / "copied.pt")
    assert carries(message(tmp_path / "copied.pt"), str(copied), "token_bytes.txt", "remove", "python -m "
                   f"nanoparcae.tokenizer --data={ckpt['args']['data']} --vocab_size=320")
    smaller = signed(config={**ckpt["config"], "vocab_size": 300})  # padded to 320 as well: the same weights
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
    model, tokenizer, ckpt, found = loaded(ckpt=path)
    assert found == path and not model.training and tokenizer.vocab_size == 260
    old_tensors = {**dict(old.named_parameters()), **dict(old.named_buffers())}
    new_tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert old_tensors.keys() == new_tensors.keys() and {"rope_cos", "rope_sin"} <= new_tensors.keys()
    for name, tensor in old_tensors.items():
        new = new_tensors[name]
        assert (new.dtype, new.device, new.shape) == (tensor.dtype, tensor.device, tensor.shape), name
        assert torch.equal(new, tensor), name
        assert new.requires_grad == tensor.requires_grad, name
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
    model = loaded(ckpt=path)[0]
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
    model = loaded(ckpt=path)[0]
    assert memory_kb("VmHWM") - before < 64 * 1024
    ranges = mapped_ranges(path)
    assert ranges, "nothing maps the checkpoint's file"
    for name, p in model.named_parameters():
        assert any(start <= p.data_ptr() < end for start, end in ranges), f"{name} is a copy of the checkpoint's"


def test_a_truncated_checkpoint_is_one_line_naming_it(tmp_path, tokenizer_dir):
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir, optimizer_bytes=4096)
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    with raises_naming(ValueError, str(path)) as err:
        load_run(ckpt=path)
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


LOADING_COMMANDS = [["sample.py", "--prompt=a", "--max_new_tokens=2", "--ckpt={ckpt}"],
                    ["eval_core.py", "--eval=bpb", "--data=stdlib", "--ckpt={ckpt}"],
                    ["-m", "interop.hub", "export", "{ckpt}", "{out}"]]


def edit_checkpoint(path, edit):
    """Load the checkpoint at path, edit(dict) it, and save it back as it is, its digest untouched."""
    ckpt = torch.load(path, weights_only=True)
    edit(ckpt)
    torch.save(ckpt, path)


@pytest.mark.parametrize("damage", ["model", "config"])
@pytest.mark.parametrize("command", LOADING_COMMANDS)
def test_a_checkpoint_with_a_changed_byte_is_refused_by_every_command_that_loads_it(command, damage, tmp_path,
                                                                                   tokenizer_dir, monkeypatch, capsys):
    """One byte amid the weights (the file's size unchanged), or its config edited after saving (norm_eps 0.5, another
    model): each command ends in one line naming the file and the entry, status 2, and writes nothing; the same file
    whole loads."""
    path = run_with_tokenizer(Path(os.environ["NANOPARCAE_BASE_DIR"]), tokenizer_dir)
    load_run(ckpt=path)
    if damage == "model":
        corrupt_a_weight(path)
    else:
        edit_checkpoint(path, lambda ckpt: ckpt["config"].update(norm_eps=0.5))
    args = [arg.format(ckpt=path, out=tmp_path / "exported") for arg in command]
    message = refused(run_here(args, monkeypatch, capsys))
    assert carries(message, str(path), "damaged", damage) and "remove" in message, message
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name] and not (tmp_path / "exported").exists()


def pop_model_digest(ckpt):
    digest = ckpt["digest"]
    digest.get("entries", digest).pop("model")


@pytest.mark.parametrize("edit,named", [
    (lambda ckpt: ckpt["config"].update(norm_eps=0.5), "config"),
    (lambda ckpt: ckpt.update(step=18), "step"),
    (lambda ckpt: ckpt["args"].update(data="other"), "args"),
    (lambda ckpt: ckpt["loader"][0].update(position=4), "loader"),
    (lambda ckpt: ckpt.update(lowest_val_loss=1.0), "lowest_val_loss"),  # an entry that has no digest
    (pop_model_digest, "model"),
    (lambda ckpt: ckpt.update(digest=["a digest"]), "digest"),
])
def test_every_entry_a_load_reads_is_checked_against_its_digest(tmp_path, tokenizer_dir, edit, named):
    """An entry edited after saving, added, or whose digest was taken away; a digest of another type: the reader
    a resume uses refuses it in one line naming the file and the entry, as load_run does for what it reads."""
    from nanoparcae.checkpoint import read_checkpoint
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir)
    edit_checkpoint(path, edit)
    with raises_naming(ValueError, str(path), named) as err:
        read_checkpoint(path)
    assert "\n" not in str(err.value) and "remove" not in str(err.value)  # a file in no run folder
    if named != "loader":  # which load_run never reads
        with raises_naming(ValueError, str(path), named):
            load_run(ckpt=path)


def test_non_finite_weights_are_refused_in_one_line_whatever_the_digest(tmp_path, tokenizer_dir):
    """A checkpoint whose weights hold a NaN and an inf, signed with them: refused in one line naming the file and
    the tensors. save_checkpoint itself never puts such weights in place."""
    from nanoparcae.checkpoint import digest_of, save_checkpoint
    model, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir)
    with torch.no_grad():
        model.wte.weight[3, 5] = float("nan")
        model.C_proj.weight[0, 0] = float("inf")
    with raises_naming(EnvironmentFailure, "wte.weight", "C_proj.weight"):
        save_checkpoint(path, model, step=8, tokenizer_dir=str(tokenizer_dir))
    assert torch.load(path, weights_only=True)["step"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]

    def signed_with_these_weights(ckpt):
        ckpt["model"] = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        ckpt["digest"] = digest_of({key: value for key, value in ckpt.items() if key != "digest"})
    edit_checkpoint(path, signed_with_these_weights)
    with raises_naming(ValueError, str(path), "wte.weight", "C_proj.weight") as err:
        load_run(ckpt=path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("digest", ["none", "of the tensors alone"])
def test_a_checkpoint_an_earlier_version_signed_or_none_is_refused_in_one_line(tmp_path, tokenizer_dir, digest):
    """One without a digest, or with the earlier digest of its tensors alone, which leaves its config and step
    unchecked: refused in one line naming the file and that it predates this version, never advised away."""
    from nanoparcae.checkpoint import read_checkpoint
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir, optimizer_bytes=64)
    earlier = {"none": lambda ckpt: ckpt.pop("digest"),
               "of the tensors alone": lambda ckpt: ckpt.update(digest={"model": "0" * 64, "optimizer": "0" * 64})}
    edit_checkpoint(path, earlier[digest])
    for read in (lambda: load_run(ckpt=path), lambda: read_checkpoint(path)):
        with raises_naming(ValueError, str(path), "predates") as err:
            read()
        assert "\n" not in str(err.value) and "remove" not in str(err.value)


NOT_CHECKPOINTS = {  # what a .pt file may hold that torch.load reads, or a file torch.save never wrote
    "a tensor": lambda path: torch.save(torch.zeros(3), path),
    "a list": lambda path: torch.save([1, 2], path),
    "a dict without a config": lambda path: torch.save({"model": {}}, path),
    "a config that is a list": lambda path: torch.save({"config": [1], "model": {}}, path),
    "a config of wrong types": lambda path: torch.save({"config": {"vocab_size": "260"}, "model": {}}, path),
    "a model that is a list": lambda path: torch.save({"config": {}, "model": [torch.zeros(2)]}, path),
    "text": lambda path: path.write_text("root:x:0:0:root:/root:/bin/bash\n"),
}


def test_a_file_that_holds_no_checkpoint_is_one_line_naming_it_and_never_advised_away(tmp_path):
    """Each is refused as no nanoparcae checkpoint, naming the file, with no advice to remove it: it is the user's."""
    for why, write in NOT_CHECKPOINTS.items():
        path = tmp_path / "ckpt_000001.pt"
        write(path)
        with raises_naming(ValueError, str(path), "nanoparcae") as err:
            load_run(ckpt=path)
        assert "\n" not in str(err.value) and "remove" not in str(err.value), (why, err.value)


@pytest.mark.parametrize("command", LOADING_COMMANDS)
def test_every_command_that_loads_a_checkpoint_refuses_a_file_that_holds_none_in_one_line(command, tmp_path,
                                                                                         monkeypatch, capsys):
    for why in ("a tensor", "a list", "text"):
        path = tmp_path / f"{why.replace(' ', '_')}.pt"
        NOT_CHECKPOINTS[why](path)
        args = [arg.format(ckpt=path, out=tmp_path / "exported") for arg in command]
        message = refused(run_here(args, monkeypatch, capsys))
        assert carries(message, str(path), "nanoparcae") and "remove" not in message, message
    assert not (tmp_path / "exported").exists()


def test_only_a_runs_own_checkpoint_is_advised_away(tmp_path, tokenizer_dir, monkeypatch):
    """Truncated: the run's ckpt_<step>.pt may be removed to start the run over; a user's copy beside it, or the
    same name outside the runs, may not. One this user may not read is said to be so, neither damaged nor to be
    removed."""
    from nanoparcae.checkpoint import run_dir
    own = run_dir("tiny") / "ckpt_000007.pt"
    copies = [own.with_name("ckpt_000007_backup.pt"), tmp_path / "ckpt_000007.pt"]
    for path in (own, *copies):
        tiny_checkpoint(path, tokenizer_dir)
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
        with raises_naming(ValueError, str(path), "truncated") as err:
            load_run(ckpt=path)
        assert ("remove" in str(err.value)) == (path == own), err.value

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))
    monkeypatch.setattr(torch, "load", denied)
    with raises_naming(ValueError, str(own), "Permission", "denied") as err:
        load_run(ckpt=own)
    assert not any(word in str(err.value) for word in ("remove", "damaged", "truncated")), err.value


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_checkpoint_this_user_may_not_read_is_said_so(tmp_path, tokenizer_dir):
    _, path = tiny_checkpoint(tmp_path / "ckpt_000007.pt", tokenizer_dir)
    path.chmod(0)
    with raises_naming(ValueError, str(path), "Permission", "denied") as err:
        load_run(ckpt=path)
    assert "remove" not in str(err.value)


@pytest.mark.parametrize("made", ["a file", "a dangling symlink", "unreadable"])
def test_a_run_folder_that_is_not_one_is_named_in_one_line(tmp_path, tokenizer_dir, made, monkeypatch):
    """Not 'no checkpoint': the run's path, and what it is."""
    from nanoparcae import checkpoint
    folder = checkpoint.run_dir("tiny")
    folder.parent.mkdir(parents=True)
    if made == "a file":
        folder.write_text("")
    elif made == "a dangling symlink":
        folder.symlink_to(tmp_path / "gone")
    else:
        tiny_checkpoint(folder / "ckpt_000007.pt", tokenizer_dir)
        scandir = os.scandir

        def denied(path):  # root reads any folder: its refusal, as another user meets it
            if Path(path) == folder:
                raise PermissionError(13, "Permission denied", str(path))
            return scandir(path)
        monkeypatch.setattr(os, "scandir", denied)
    newest = [] if made == "a file" else [lambda: load_run()]  # a file there is no run
    for find in (lambda: load_run("tiny"), lambda: checkpoint.latest(folder), *newest):
        with raises_naming(ValueError, str(folder)) as err:
            find()
        assert "\n" not in str(err.value) and "no checkpoint" not in str(err.value)


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
        load_run(ckpt=path)
    assert carries(str(err.value), str(ours), other, str(path), trained_with) and "\n" not in str(err.value)
    message = refused(run_here(["sample.py", "--prompt=a", f"--ckpt={path}"], monkeypatch, capsys))
    assert carries(message, str(ours), other, trained_with), message


# -----------------------------------------------------------------------------
# A run is found by its exact name, and only the files train.py wrote are its checkpoints

def test_a_run_is_found_by_its_exact_name_never_as_a_pattern_or_a_file(tmp_path, tokenizer_dir, monkeypatch, capsys):
    """Run x1 saved: `x[1]`, `x?` and `*` are no run names, and x1 itself loads. A name is never read as a file
    (probes --run=x.pt and --run=model.py): sample.py --run=x.pt loads the run named so, and eval_core.py
    --run=model.py, from the folder holding model.py, looks for that run alone."""
    from nanoparcae.checkpoint import run_dir
    _, path = tiny_checkpoint(run_dir("x1") / "ckpt_000007.pt", tokenizer_dir)
    for pattern in ("x[1]", "x?", "*", "../x1", "a" * 300):
        with raises_naming(ValueError, f"--run={pattern[:120]!r}"):
            load_run(pattern)
    assert load_run("x1")[2] == path
    tiny_checkpoint(run_dir("x.pt") / "ckpt_000007.pt", tokenizer_dir)
    monkeypatch.chdir(ROOT)
    command = ["sample.py", "--run=x.pt", "--prompt=a", "--max_new_tokens=2"]
    assert run_here(command, monkeypatch, capsys).returncode == 0
    message = refused(run_here(["eval_core.py", "--run=model.py", "--eval=bpb"], monkeypatch, capsys))
    assert carries(message, str(run_dir("model.py"))) and "not a nanoparcae checkpoint" not in message, message


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


def test_only_the_names_the_project_writes_are_resumed_pruned_or_removed(tmp_path, tokenizer_dir, capsys):
    """Probes: a user's ckpt_10.pt and ckpt_0000000010.pt were resumed from, then deleted; ckpt_notes.pt.tmp was
    deleted as a partial save; a folder named ckpt_000001.pt stopped the prune with IsADirectoryError. Here none is
    resumed from or touched, nor a link to a user's file; only the run's own partial file and older checkpoint go."""
    from nanoparcae.checkpoint import latest, remove_partial_saves, save_and_prune
    folder = tmp_path / "run"
    model, own = tiny_checkpoint(folder / "ckpt_000008.pt", tokenizer_dir)
    for name in ("ckpt_10.pt", "ckpt_0000000010.pt", "ckpt_notes.pt.tmp"):
        shutil.copy(own, folder / name)
    (folder / "ckpt_000001.pt").mkdir()
    (folder / "ckpt_000001.pt" / "notes.txt").write_text("mine")
    (tmp_path / "mine.pt").write_text("a user's file")
    (folder / "ckpt_000009.pt").symlink_to(tmp_path / "mine.pt")
    (folder / "ckpt_000009.pt.tmp").symlink_to(tmp_path / "mine.pt")
    (folder / "ckpt_000011.pt.tmp").write_bytes(b"a save cut short")
    users = sorted(p.name for p in folder.iterdir() if p.name not in ("ckpt_000008.pt", "ckpt_000011.pt.tmp"))
    assert latest(folder) == own
    remove_partial_saves(folder)
    assert carries(capsys.readouterr().out, str(folder / "ckpt_000011.pt.tmp"))
    loader = type("Loader", (), {"state_dict": lambda self: {"position": 5}})()
    save_and_prune(folder, 12, model, [loader], tokenizer_dir=str(tokenizer_dir))
    assert sorted(p.name for p in folder.iterdir()) == sorted([*users, "ckpt_000012.pt"])
    assert (tmp_path / "mine.pt").read_text() == "a user's file" and latest(folder) == folder / "ckpt_000012.pt"


def test_a_name_too_long_for_the_filesystem_is_one_line_with_its_cause(tmp_path, monkeypatch, capsys):
    """Probes: a 300-character --run gave `File name too long` as a traceback, and a 300-character --ckpt in
    sample.py was advised a permission fix. The run name is refused as such, the file by the OS's cause."""
    long_path = tmp_path / ("c" * 300 + ".pt")
    for command in (["sample.py", "--prompt=a"], ["eval_core.py", "--eval=bpb"]):
        message = refused(run_here([*command, "--run=" + "r" * 300], monkeypatch, capsys))
        assert carries(message, "--run") and "run name" in message, message
        message = refused(run_here([*command, f"--ckpt={long_path}"], monkeypatch, capsys))
        assert "File name too long" in message and "permission" not in message, message

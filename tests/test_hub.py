"""
Tests for interop/hub.py: the authors' parameter names (a fixture written from their source) map one to one onto
ours; a folder in their format loads, locally and from a 127.0.0.1 server, and gives the logits of the
model it was written from; tokenizer.json converts to a tiktoken Encoding that agrees with a direct
reading of its merges; and each bad input fails with one clear line.

    python -m pytest tests/test_hub.py -q
"""

import errno
import http.server
import itertools
import json
import math
import os
import re
import shutil
import threading
import warnings
from pathlib import Path

import pytest
import regex
import torch

from conftest import carries, python, raises_naming, refused, run_here, warns_naming
from interop import hub
from nanoparcae.command import run_command
from nanoparcae.tokenizer import SPLIT_PATTERN
from model import Parcae, ParcaeConfig, apply_rotary, initial_state

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "authors_params.json").read_text())
ROOT = Path(__file__).resolve().parent.parent
PAPER_PARAMS = {"parcae-small-140m": 144_323_136, "gpt-small-140m": 143_141_184}  # METHOD.md §1's table


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPARCAE_BASE_DIR", str(tmp_path / "base"))


# -----------------------------------------------------------------------------
# The authors' names and shapes (tests/fixtures/authors_params.json) against ours


@pytest.mark.parametrize("name", ["parcae-small-140m", "gpt-small-140m"])
def test_authors_parameters_map_one_to_one(name):
    authors = FIXTURE[name]
    config = hub.config_from_authors(authors["config"])
    with torch.device("meta"):
        model = Parcae(config)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    mapping = hub.map_names(authors["state_dict"], ours, config)
    assert sorted(mapping.values()) == sorted(ours)  # none of ours left over, none hit twice
    assert set(authors["state_dict"]) - set(mapping) == set(hub.CHECKED_NAMES)  # only the tied head and RoPE buffer
    assert all(tuple(authors["state_dict"][k]) == ours[v] for k, v in mapping.items())
    assert model.num_params() == PAPER_PARAMS[name]
    assert config.injection == ("diagonal" if name.startswith("parcae") else "none")


def test_rope_row_order_turns_interleaved_rope_into_ours():
    """Their RoPE (modules/utils.py) rotates pairs (2i, 2i+1) by +angle; with q's dims reordered by
    rope_order, ours (halves, -angle) gives the same vectors in that order."""
    B, S, H, D, base = 2, 7, 3, 16, 50_000.0
    q = torch.randn(B, S, H, D)
    angles = torch.outer(torch.arange(S, dtype=torch.float32), base ** (-torch.arange(0, D, 2).float() / D))
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    pairs = q.unflatten(-1, (-1, 2))
    theirs = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin,
                          pairs[..., 1] * cos + pairs[..., 0] * sin], dim=-1).flatten(3)
    order = hub.rope_order(D)
    ours = apply_rotary(q[..., order], cos, sin)
    torch.testing.assert_close(ours, theirs[..., order])


# -----------------------------------------------------------------------------
# A folder in the authors' format, written from a small random model of ours


def authors_config(c):
    """What their save_pretrained writes (the fields hub.py reads), for our config c."""
    cfg = dict(block_size=c.seq_len, vocab_size=c.vocab_size, padding_multiple=64,
               padded_vocab_size=c.padded_vocab_size, n_embd=c.d_model, num_attention_heads=c.n_head,
               num_key_value_heads=c.n_head,
               intermediate_size=4 * c.d_model, bias=False, qk_bias=False, tie_embeddings=True,
               block_class_name="TransformerPreNormBlock", norm_class_name="RMSNorm", norm_eps=c.norm_eps,
               mlp_class_name="BaseMLP", nonlin_name="ReLU2", qk_norm=True, clip_qkv=None, logit_softcap=None,
               init_strategy="scaled-zero", mup_model_scaling_factor=1, randomize_positions_from=None,
               rope_settings=dict(use_rope=True, rope_condense_ratio=1, rope_base=int(c.rope_base)))
    if c.injection == "none":
        return dict(cfg, n_layer=c.n_layer, use_abacus=False, _class_name="GPTConfig")
    return dict(cfg, injection_type="diagonal", state_init="like-init", recurrent_embedding_dimension=c.d_model,
                recurrent_intermediation_embedding_dimension=4 * c.d_model, recurrent_num_attention_heads=None,
                n_layers_in_prelude=c.n_prelude, n_layers_in_recurrent_block=c.n_recur, n_layers_in_coda=c.n_coda,
                mean_recurrence=c.mu_rec, mean_backprop_depth=c.mu_bwd, prelude_norm=c.prelude_norm,
                recurrent_iteration_method="per-sequence", _class_name="ParcaeConfig")


def authors_state_dict(model):
    """Our state dict under their names (written here from their source, not from hub.py's table), with
    q and k rows in their interleaved RoPE layout, the tied head and their freqs_cis buffer."""
    c = model.config
    top = {"wte.weight": "transformer.wte.weight", "norm_f.weight": "transformer.ln_f.weight",
           "prelude_norm.weight": "transformer.ln_prelude.weight", "injection.A_log": "transformer.adapter.A_log",
           "injection.dt_bias": "transformer.adapter.dt_bias", "injection.B.weight": "transformer.adapter.B",
           "C_proj.weight": "transformer.C.weight"}
    block = {"attn_norm.weight": "norm_1.weight", "mlp_norm.weight": "norm_2.weight",
             "mlp.c_fc.weight": "mlp.fc.weight", "mlp.c_proj.weight": "mlp.proj.weight"}
    offsets = {"prelude": 0, "recur": c.n_prelude, "coda": c.n_prelude + c.n_recur}
    their_rows = torch.argsort(torch.cat([torch.arange(1, c.head_dim, 2), torch.arange(0, c.head_dim, 2)]))
    out = {}
    for name, tensor in model.state_dict().items():
        if name in top or name.startswith("value_embeds."):
            out[top.get(name, name)] = tensor.clone()
            continue
        part, i, rest = name.split(".", 2)
        if rest in ("attn.c_q.weight", "attn.c_k.weight"):  # our dim j holds their dim (2j+1 | 2(j-D/2))
            tensor = tensor.view(c.n_head, c.head_dim, -1)[:, their_rows].reshape(tensor.shape)
        where = (f"h.{offsets[part] + int(i)}" if c.injection == "none"
                 else f"{dict(prelude='prelude', recur='core_block', coda='coda')[part]}.{i}")
        out[f"transformer.{where}.{block.get(rest, rest)}"] = tensor.clone()
    out["lm_head.weight"] = out["transformer.wte.weight"]
    inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
    angles = torch.outer(torch.arange(c.seq_len, dtype=torch.float32), inv_freq)
    out["freqs_cis"] = torch.stack([angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]], dim=4)
    return out


def byte_level_chars():
    """GPT-2's bytes_to_unicode, written out: byte -> the character that stands for it in tokenizer.json."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("Ġa", "n"), ("Ġan", "d"), ("Ã", "©"),
          ("e", "r"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"), ("1", "2")]


def tokenizer_json(bos="<|bos|>"):
    """A byte-level BPE tokenizer.json as HF tokenizers writes it: specials first, then the 256 bytes, then merges."""
    chars = byte_level_chars()
    vocab = {bos: 0, "<|eos|>": 1}
    for b in range(256):
        vocab[chars[b]] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    return {"version": "1.0", "normalizer": None,
            "added_tokens": [{"id": 0, "content": bos, "special": True},
                             {"id": 1, "content": "<|eos|>", "special": True}],
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
            "decoder": {"type": "ByteLevel"},
            "model": {"type": "BPE", "vocab": vocab, "merges": [f"{a} {b}" for a, b in MERGES]}}


def tiny_model(injection, seed=0):
    torch.manual_seed(seed)
    config = ParcaeConfig(vocab_size=300, seq_len=32, n_prelude=1, n_recur=2, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=3, injection=injection)
    model = Parcae(config).eval()
    with torch.no_grad():  # every weight random, so a swapped or dropped one shows in the logits
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def write_authors_folder(folder, model, weights_name="model.pt"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(authors_config(model.config)))
    torch.save(authors_state_dict(model), folder / weights_name)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    return folder


def assert_same_logits(original, loaded):
    idx = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        if original.config.injection == "none":
            torch.testing.assert_close(loaded(idx), original(idx), rtol=0, atol=1e-5)
            return
        h0 = initial_state((2, 12, original.config.d_model))
        for T in (1, 4):
            torch.testing.assert_close(loaded(idx, T=T, h0=h0), original(idx, T=T, h0=h0), rtol=0, atol=1e-5)


@pytest.mark.parametrize("injection", ["diagonal", "none"])
def test_local_authors_folder_gives_the_same_logits(tmp_path, injection):
    original = tiny_model(injection)
    model, tokenizer = hub.load_pretrained(str(write_authors_folder(tmp_path / "ckpt", original)))
    assert model.config.injection == injection and not model.training
    assert_same_logits(original, model)
    assert tokenizer.bos_id == 0 and tokenizer.vocab_size == 2 + 256 + len(MERGES)


class HubHandler(http.server.BaseHTTPRequestHandler):
    """Serves <root>/<repo>/<file> at /<repo>/resolve/main/<file>, honouring Range like the Hub."""
    root, ranges = None, []

    def do_GET(self):
        repo_file = self.path.replace("/resolve/main/", "/", 1).lstrip("/")
        path = self.root / repo_file
        if not path.is_file():
            self.send_error(404)
            return
        body = path.read_bytes()
        start = 0
        if "Range" in self.headers:
            self.ranges.append((path.name, self.headers["Range"]))
            start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-"))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


def test_repo_id_downloads_resumes_and_caches(tmp_path, monkeypatch):
    original = tiny_model("diagonal", seed=1)
    served = tmp_path / "served"
    write_authors_folder(served / "SandyResearch" / "tiny", original)
    HubHandler.root, HubHandler.ranges = served, []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    monkeypatch.setattr(hub, "HUB_URL", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        # a download cut off half way: the next call asks only for the rest
        weights = (served / "SandyResearch" / "tiny" / "model.pt").read_bytes()
        cache = Path(tmp_path / "base" / "hub" / "SandyResearch" / "tiny")
        cache.mkdir(parents=True)
        (cache / "model.pt.part").write_bytes(weights[:1000])
        model, _ = hub.load_pretrained("SandyResearch/tiny")
        assert HubHandler.ranges == [("model.pt", "bytes=1000-")]
        assert (cache / "model.pt").read_bytes() == weights and not (cache / "model.pt.part").exists()
        assert_same_logits(original, model)
    finally:
        server.shutdown()
        server.server_close()
    hub.load_pretrained("SandyResearch/tiny")  # the server is gone: the cache alone serves a second load


# -----------------------------------------------------------------------------
# tokenizer.json -> tiktoken


def reference_bpe(text, spec):
    """A direct reading of tokenizer.json: split with its regex, spell each piece in the byte-level
    alphabet, apply the lowest-ranked merge until none applies, look the pieces up in the vocabulary."""
    chars = byte_level_chars()
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(spec["model"]["merges"])}
    pattern = spec["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    ids = []
    for piece in regex.findall(pattern, text):
        word = [chars[b] for b in piece.encode("utf-8")]
        while len(word) > 1:
            pairs = [(ranks.get(pair, math.inf), i) for i, pair in enumerate(zip(word, word[1:]))]
            rank, i = min(pairs)
            if rank == math.inf:
                break
            word[i:i + 2] = [word[i] + word[i + 1]]
        ids += [spec["model"]["vocab"][w] for w in word]
    return ids


def test_tokenizer_json_converts_to_the_same_ids(tmp_path):
    spec = tokenizer_json()
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = hub.tokenizer_from_json(tmp_path / "tokenizer.json")
    text = "the theatre and the world, 12 123 café 🎉\n\n  in and\tor <|bos|> ÿ\x00 there"
    ids = tokenizer.encode(text)
    assert ids == reference_bpe(text, spec)
    assert len(set(ids) & {spec["model"]["vocab"]["Ġthe"], spec["model"]["vocab"]["Ġand"]}) == 2  # merges did apply
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode("and", prepend_bos=True)[0] == tokenizer.bos_id == 0
    assert tokenizer.enc.encode_single_token("<|eos|>") == 1
    assert tokenizer.token_bytes[0] == 0 and tokenizer.token_bytes[spec["model"]["vocab"]["Ġand"]] == 4


def test_tokenizer_bos_under_another_name(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps(tokenizer_json(bos="<|endoftext|>")))
    assert hub.tokenizer_from_json(tmp_path / "tokenizer.json").bos_id == 0


# -----------------------------------------------------------------------------
# One clear line for each bad input


def test_unknown_class_and_unsupported_settings():
    cfg = FIXTURE["parcae-small-140m"]["config"]
    with pytest.raises(ValueError, match="_class_name='EQLMConfig'"):
        hub.config_from_authors(dict(cfg, _class_name="EQLMConfig"))
    with pytest.raises(ValueError, match="logit_softcap=15"):
        hub.config_from_authors(dict(cfg, logit_softcap=15.0))
    with raises_naming(ValueError, "layer", "5"):  # their ve_gate rule disagrees with value_embeds here
        hub.config_from_authors(dict(cfg, n_layers_in_recurrent_block=3, mean_backprop_depth=3))


BAD_CONFIGS = {  # what a careless or hostile config.json holds -> the field its refusal names
    "a list": (lambda cfg: [cfg], None), "a string size": (lambda cfg: dict(cfg, n_embd="64"), "n_embd"),
    "a string eps": (lambda cfg: dict(cfg, norm_eps="1e-5"), "norm_eps"),
    "no block_size": (lambda cfg: {k: v for k, v in cfg.items() if k != "block_size"}, "block_size"),
    "zero heads": (lambda cfg: dict(cfg, num_attention_heads=0), "num_attention_heads"),
    "a class list": (lambda cfg: dict(cfg, _class_name=["ParcaeConfig"]), "_class_name"),
    "RoPE a list": (lambda cfg: dict(cfg, rope_settings=[50_000]), "rope_settings"),
    "an unknown RoPE key": (lambda cfg: dict(cfg, rope_settings={"rope_scaling": 4}), "rope_settings.rope_scaling"),
    "a 1.3 TB RoPE table": (lambda cfg: dict(cfg, block_size=10**9), "block_size=1000000000"),
    "n_embd 10**6": (lambda cfg: dict(cfg, n_embd=10**6, intermediate_size=4 * 10**6, num_attention_heads=2,
                                      num_key_value_heads=2, recurrent_embedding_dimension=10**6,
                                      recurrent_intermediation_embedding_dimension=4 * 10**6), "n_embd=1000000"),
}


@pytest.mark.parametrize("fault", BAD_CONFIGS)
def test_a_malformed_config_json_is_refused_naming_it_and_the_field_before_any_allocation(tmp_path, monkeypatch,
                                                                                          capsys, fault):
    """Each fault ends in one line naming the file and its field, before the model is sized or the weights read
    (either would fail the test here: main allocated a 40 GB RoPE table for block_size 10**9)."""
    folder = write_authors_folder(tmp_path / "ckpt", tiny_model("diagonal"))
    edit, name = BAD_CONFIGS[fault]
    (folder / "config.json").write_text(json.dumps(edit(authors_config(tiny_model("diagonal").config))))

    def allocates(*args, **kwargs):
        raise AssertionError("allocated before the config was checked")
    monkeypatch.setattr(hub, "from_weights", allocates)
    monkeypatch.setattr(torch, "load", allocates)
    message = refused(run_here(["-m", "interop.hub", str(folder)], monkeypatch, capsys))
    assert carries(message, str(folder / "config.json"), *[name] * bool(name)), message


def test_the_memory_plan_is_the_bytes_the_loaded_model_and_its_weights_file_hold(tmp_path, monkeypatch):
    """One byte less free than the float32 model's parameters and RoPE tables plus the weights file: refused
    naming config.json; exactly that much: it loads."""
    original = tiny_model("diagonal")
    folder = write_authors_folder(tmp_path / "ckpt", original)
    needs = sum(t.nbytes for t in (*original.parameters(), *original.buffers())) + (folder / "model.pt").stat().st_size
    monkeypatch.setattr(hub, "free_memory", lambda device: needs - 1)
    with raises_naming(ValueError, str(folder / "config.json"), "n_embd=64"):
        hub.load_pretrained(str(folder))
    monkeypatch.setattr(hub, "free_memory", lambda device: needs)
    assert_same_logits(original, hub.load_pretrained(str(folder))[0])


@pytest.mark.parametrize("weights", ["truncated", "a tensor", "a list", "a number among tensors"])
def test_a_damaged_weights_file_is_refused_in_one_line_naming_it(tmp_path, monkeypatch, capsys, weights):
    """None advises deleting it: a local folder is the user's own (only the Hub's cache may be fetched again)."""
    folder = write_authors_folder(tmp_path / "ckpt", tiny_model("diagonal"))
    path = folder / "model.pt"
    if weights == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        state = torch.load(path, weights_only=True)
        torch.save({"a tensor": torch.zeros(3), "a list": [torch.zeros(3)],
                    "a number among tensors": {**state, "transformer.wte.weight": 3}}[weights], path)
    message = refused(run_here(["-m", "interop.hub", str(folder)], monkeypatch, capsys))
    assert carries(message, str(path)) and "delete" not in message, message


def test_missing_file(tmp_path):
    folder = write_authors_folder(tmp_path / "ckpt", tiny_model("diagonal"))
    (folder / "model.pt").unlink()
    with raises_naming(FileNotFoundError, "pytorch_model.bin", "model.pt"):
        hub.load_pretrained(str(folder))


@pytest.mark.parametrize("injection", ["diagonal", "none"])
def test_a_bare_save_pretrained_folder_loads_and_only_text_asks_for_a_tokenizer(tmp_path, injection, capsys):
    """Their save_pretrained writes config.json (every field of their config) and model.pt (their state_dict(): the
    tied head, freqs_cis, and for their GPT built without the fused head its own (d, V) lm_head, never read when
    tied), no tokenizer: the model loads with the same logits; `interop.hub sample`, which reads text, says in one
    line what to add."""
    original = tiny_model(injection)
    folder = tmp_path / "bare"
    folder.mkdir()
    cfg = dict(authors_config(original.config), name="", hf_config={}, attn_impl="flash", init_orthogonal=True,
               use_fused_head=injection != "none" and "pytorch", simple_ops=False, strategy="single")
    state = authors_state_dict(original)
    if injection == "none":
        state["lm_head.weight"] = torch.randn(original.config.d_model, original.config.padded_vocab_size)
    (folder / "config.json").write_text(json.dumps(cfg))
    torch.save(state, folder / "model.pt")
    model, tokenizer = hub.load_pretrained(str(folder))
    assert tokenizer is None
    assert_same_logits(original, model)
    with pytest.raises(SystemExit) as err:
        run_command(hub.main, ["sample", str(folder), "--prompt", "the", "--max_new_tokens", "1"])
    message = capsys.readouterr().err
    assert err.value.code == 2 and len(message.splitlines()) == 1, message
    assert carries(message, str(folder), "tokenizer.json", "save_pretrained"), message


def test_unmapped_name_shape_mismatch_and_missing_weight(tmp_path):
    model = tiny_model("diagonal")
    state = authors_state_dict(model)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    with raises_naming(ValueError, "transformer.core_block.0.attn.rotary.weight"):
        hub.map_names({**shapes, "transformer.core_block.0.attn.rotary.weight": (4,)}, ours, model.config)
    with raises_naming(ValueError, "transformer.C.weight", "(64, 32)", "C_proj.weight", "(64, 64)"):
        hub.map_names({**shapes, "transformer.C.weight": (64, 32)}, ours, model.config)
    del shapes["transformer.adapter.dt_bias"]
    with raises_naming(ValueError, "1", "injection.dt_bias"):
        hub.map_names(shapes, ours, model.config)
    state["transformer.coda.0.mlp.fc.weight"] = state["transformer.coda.0.mlp.fc.weight"][:, :10]  # via the loader too
    folder = write_authors_folder(tmp_path / "ckpt", model)
    torch.save(state, folder / "model.pt")
    with pytest.raises(ValueError, match="coda.0.mlp.fc.weight has shape"):
        hub.load_pretrained(str(folder))


def test_sample_from_gives_what_the_same_model_gives_from_a_checkpoint(tmp_path, capsys):
    """`interop.hub sample <authors' folder>` and sample.py --ckpt=<our checkpoint of the same model> print the same
    text."""
    import sample
    from nanoparcae.checkpoint import save_checkpoint
    original = tiny_model("diagonal", seed=2)
    folder = write_authors_folder(tmp_path / "ckpt", original)
    hub.tokenizer_from_json(folder / "tokenizer.json").save(tmp_path / "tok")
    save_checkpoint(tmp_path / "ours.pt", original, tokenizer_dir=str(tmp_path / "tok"))
    flags = ["--prompt", "the world and", "--max_new_tokens", "6", "--temperature", "0", "--T", "3", "--device", "cpu"]
    outputs = []
    hub.main(["sample", str(folder), *flags])
    outputs.append(capsys.readouterr().out)
    sample.main(["--ckpt", str(tmp_path / "ours.pt"), *flags])
    outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("the world and")
    assert len(outputs[0]) > len("the world and\n")


@pytest.mark.slow
def test_a_vocabulary_larger_than_the_tokenizer_is_never_sampled(tmp_path, capsys):
    """A checkpoint folder tried with a smaller tokenizer.json (271 tokens for the model's 300): the ids the
    tokenizer lacks are masked out of sampling, with a warning naming both sizes, in `interop.hub sample` and in its
    summary
    (tiktoken's decode raised a KeyError on them)."""
    model = tiny_model("diagonal", seed=2)
    with torch.no_grad():
        model.wte.weight[271:] *= 50  # the ids past the tokenizer's take the largest logits
    folder = write_authors_folder(tmp_path / "ckpt", model)
    loaded, tokenizer = hub.load_pretrained(str(folder))
    ids = tokenizer.encode("the world and", prepend_bos=True)
    with torch.no_grad():
        assert int(loaded(torch.tensor([ids]))[0, -1].argmax()) >= 271  # unmasked, greedy would pick one
    with warns_naming(UserWarning, "300", "271"):
        allowed = tokenizer.known_ids(300)
    assert int(allowed.sum()) == 271 and not allowed[271:].any()
    with warns_naming(UserWarning, "300", "271"):
        hub.main(["sample", str(folder), "--prompt", "the world and", "--max_new_tokens", "12", "--T", "2",
                  "--temperature", "0"])
    out = capsys.readouterr().out
    assert out.startswith("the world and") and len(out) > len("the world and\n")
    result = python(["-m", "interop.hub", str(folder)])
    assert result.returncode == 0 and "next token after" in result.stdout, result.stderr


# -----------------------------------------------------------------------------
# Export: our checkpoint -> the authors' folder -> hub.load_pretrained


MIXED_TEXT = ("def parse(x):\n    return {'k': [1, 22, 333]}  # don't\n\n\n\tif x:\r\n        pass    \n"
              "Ünïcödé: café, naïve, 東京 🎉🎉 — “quotes” ½\u00a0nbsp  \n \n" + " " * 9 + "end")


def tokenizer_for_export(vocab_size=300):
    """A tokenizer trained by rustbpe (real merges) on text rich in code, Unicode and whitespace runs."""
    from nanoparcae.tokenizer import Tokenizer
    return Tokenizer.train(iter([MIXED_TEXT * 3, Path(hub.__file__).read_text()]), vocab_size)


def exported(tmp_path, injection, original=None):
    """(original model, exported folder), through `hub.py export <checkpoint> <folder>`."""
    from nanoparcae.checkpoint import save_checkpoint
    original = tiny_model(injection, seed=3) if original is None else original
    tokenizer_for_export().save(tmp_path / "tok")
    save_checkpoint(tmp_path / "ckpt.pt", original, tokenizer_dir=str(tmp_path / "tok"))
    hub.main(["export", str(tmp_path / "ckpt.pt"), str(tmp_path / "out")])
    return original, tmp_path / "out"


@pytest.mark.parametrize("injection", ["diagonal", "concat", "add", "none"])
def test_export_then_load_gives_the_same_logits(tmp_path, injection):
    original, folder = exported(tmp_path, injection)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.pt", "tokenizer.json",
                                                        "tokenizer_config.json"]
    loaded, tokenizer = hub.load_pretrained(str(folder))
    idx = torch.randint(0, 300, (2, 12))
    h0 = initial_state((2, 12, original.config.d_model))
    with torch.no_grad():
        for T in (1, 4, 8):
            torch.testing.assert_close(loaded(idx, T=T, h0=h0), original(idx, T=T, h0=h0), rtol=0, atol=1e-5)
    assert tokenizer.encode(MIXED_TEXT) == tokenizer_for_export().encode(MIXED_TEXT)


@pytest.mark.parametrize("injection", ["diagonal", "none"])
def test_export_writes_what_their_source_names(injection):
    """The exported names, tensors and config fields are those this file's authors_state_dict and authors_config
    write from reading their source (not from hub.py's tables). Left out: freqs_cis (their model computes it) and
    lm_head.weight: their GPT (models/gpt/gpt.py) builds the Triton LinearCrossEntropyLoss head for any truthy
    use_fused_head, their default "pytorch" included, and with it false a (d, V) head that a tied model never
    reads, on which a (V, d) lm_head.weight fails their load_state_dict; their Parcae ties lm_head to wte."""
    model = tiny_model(injection, seed=4)
    ours, theirs = hub.authors_state_dict(model), authors_state_dict(model)
    assert set(ours) == set(theirs) - {"freqs_cis", "lm_head.weight"}
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    config = hub.authors_config(model.config)
    assert {k: config[k] for k in authors_config(model.config)} == authors_config(model.config)
    assert config["use_fused_head"] is False and config["tie_embeddings"] is True


def test_export_holds_one_copy_of_the_weights(tmp_path, monkeypatch):
    """What export hands torch.save is the model's own storage, but for the q and k rows it reorders, and the
    file it writes is byte for byte the one a copy of every tensor writes."""
    model, saved, save = tiny_model("diagonal", seed=5), {}, torch.save
    monkeypatch.setattr(torch, "save", lambda obj, file: (saved.update(obj), save(obj, file)))
    hub.export(model, tokenizer_for_export(), tmp_path / "out")
    ours = {tensor.untyped_storage().data_ptr() for tensor in model.state_dict().values()}
    new = {name for name, tensor in saved.items() if tensor.untyped_storage().data_ptr() not in ours}
    assert new and new == {name for name in saved if name.endswith(("attn.c_q.weight", "attn.c_k.weight"))}
    with open(tmp_path / "copied.pt", "wb") as file:  # written as export writes, through a file object
        save({name: tensor.clone() for name, tensor in saved.items()}, file)
    assert (tmp_path / "out" / "model.pt").read_bytes() == (tmp_path / "copied.pt").read_bytes()


def test_exported_config_round_trips():
    parcae = ParcaeConfig(vocab_size=300, seq_len=64, n_prelude=1, n_recur=2, n_coda=1, d_model=64, head_dim=32,
                          mu_rec=6, mu_bwd=2, injection="concat", sampling="per_batch", prelude_norm=False)
    assert hub.config_from_authors(json.loads(json.dumps(hub.authors_config(parcae)))) == parcae
    gpt = ParcaeConfig(vocab_size=300, seq_len=64, n_prelude=1, n_recur=1, n_coda=1, d_model=64, head_dim=32,
                       injection="none")  # a Transformer has no loop: its mu_rec is the default's
    assert hub.config_from_authors(json.loads(json.dumps(hub.authors_config(gpt)))) == gpt


def test_exported_tokenizer_json_encodes_as_ours(tmp_path):
    """The exported tokenizer.json, read by its merges (reference_bpe), by hub.py, and by HF tokenizers where
    installed, gives our tiktoken ids on code, Unicode and whitespace runs."""
    ours = tokenizer_for_export(vocab_size=600)
    spec = hub.tokenizer_json(ours)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    ids = ours.encode(MIXED_TEXT)
    assert len(ids) < 0.75 * len(MIXED_TEXT.encode())  # the merges do apply
    assert reference_bpe(MIXED_TEXT, spec) == ids
    assert hub.tokenizer_from_json(tmp_path / "tokenizer.json").encode(MIXED_TEXT) == ids
    assert {t["content"]: t["id"] for t in spec["added_tokens"]} == ours.enc._special_tokens
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        return  # their tokenizer library is not in our requirements; reference_bpe stands for it
    theirs = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert theirs.encode(MIXED_TEXT, add_special_tokens=False).ids == ids
    assert theirs.decode(ids) == MIXED_TEXT


def test_a_depth_3_model_exports_with_the_backprop_depth_its_gates_need(tmp_path, capsys):
    """Depth 3 with mu_rec 5 and mu_bwd 2: their gates need an odd mean_backprop_depth, so config.json gets 1,
    with a warning, and the folder loads back with the same logits at every T. With mu_rec 4 (the
    CPU default's) the CLI refuses in one line naming mean_recurrence and writes nothing."""
    from nanoparcae.checkpoint import save_checkpoint
    torch.manual_seed(5)
    original = Parcae(ParcaeConfig.from_depth(3, vocab_size=300, seq_len=32, d_model=64, head_dim=32, mu_rec=5,
                                              mu_bwd=2)).eval()
    with warns_naming(UserWarning, "mean_backprop_depth=1", "mu_bwd", "2"):
        _, folder = exported(tmp_path, "diagonal", original)
    assert json.loads((folder / "config.json").read_text())["mean_backprop_depth"] == 1
    loaded, _ = hub.load_pretrained(str(folder))
    idx = torch.randint(0, 300, (2, 12))
    h0 = initial_state((2, 12, 64))
    with torch.no_grad():
        for T in (1, 2, 5, 8):
            torch.testing.assert_close(loaded(idx, T=T, h0=h0), original(idx, T=T, h0=h0), rtol=0, atol=1e-5)
    cpu_default = Parcae(ParcaeConfig.from_depth(3, vocab_size=300, d_model=64, head_dim=32, mu_rec=4))
    save_checkpoint(tmp_path / "cpu_default.pt", cpu_default, tokenizer_dir=str(tmp_path / "tok"))
    with pytest.raises(SystemExit) as err:
        run_command(hub.main, ["export", str(tmp_path / "cpu_default.pt"), str(tmp_path / "refused")])
    message = capsys.readouterr().err
    assert err.value.code == 2 and message.startswith("error: ") and len(message.splitlines()) == 1, message
    assert carries(message, "mean_recurrence=4", "--mu_rec", "--depth"), message  # the value, then the fixes' flags
    assert not (tmp_path / "refused").exists()


def their_gated_layers(cfg):
    """Which layers their Parcae reads a value embedding in, from a config.json: it gives value_embeds to the
    layers i % 2 == (n - 1) % 2 of n = P + R + C (models/parcae/parcae.py) and reads one only where the block's
    ve_gate exists, has_ve(layer_id, n_layer) with layer ids i, P + i, P + R * mean_recurrence + i and
    n_layer = R * mean_backprop_depth (modules/mixer.py, parcae/config.py)."""
    P, R, C = cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"], cfg["n_layers_in_coda"]
    layer_ids = [*range(P + R), *(P + R * cfg["mean_recurrence"] + i for i in range(C))]
    has_value_embedding = [i % 2 == (P + R + C - 1) % 2 for i in range(P + R + C)]
    has_gate = [layer_id % 2 == (R * cfg["mean_backprop_depth"] - 1) % 2 for layer_id in layer_ids]
    return [i for i in range(P + R + C) if has_value_embedding[i] and has_gate[i]], has_gate == has_value_embedding


@pytest.mark.parametrize("third", [1, 2, 3])
def test_every_depth_exports_where_their_gates_can_pair_and_is_refused_in_one_line_elsewhere(third):
    """Depths 3, 6 and 9 (L_P = L_R = L_C) at each parity of mu_rec and mu_bwd: the written config makes their
    Parcae read every value embedding ours has, with mean_recurrence = mu_rec and their sampler's mean depth
    max(mean_recurrence, mean_backprop_depth) unchanged (so the same forward at any T, in eval mode, and under
    their per-sequence sampling); or, exactly where no mean_backprop_depth can do that (an odd L_R with an even
    mu_rec), one line naming mean_recurrence."""
    for mu_rec, mu_bwd in itertools.product((3, 4), (1, 2)):
        config = ParcaeConfig.from_depth(3 * third, vocab_size=300, d_model=64, head_dim=32, mu_rec=mu_rec,
                                         mu_bwd=mu_bwd)
        if third % 2 and mu_rec % 2 == 0:
            with pytest.raises(ValueError, match=f"cannot export mean_recurrence={mu_rec}: ") as err:
                hub.authors_config(config)
            assert "\n" not in str(err.value)
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            written = hub.authors_config(config)
        gated, paired = their_gated_layers(written)
        assert gated == hub.value_embedding_layers(config) and paired
        assert written["mean_recurrence"] == mu_rec and abs(written["mean_backprop_depth"] - mu_bwd) <= 1
        assert max(mu_rec, written["mean_backprop_depth"]) == max(mu_rec, mu_bwd)
        assert bool(caught) == (written["mean_backprop_depth"] != mu_bwd)  # said when it differs


@pytest.mark.slow
def test_export_refuses_what_their_loader_would_compute_differently(tmp_path):
    with raises_naming(ValueError, "rope_base", "10000", "rope_settings"):
        hub.authors_config(ParcaeConfig(vocab_size=300, d_model=64, head_dim=32, rope_base=10_000.0))
    refusals = {  # (P, R, C, mu_rec, mu_bwd): the field to blame
        (2, 3, 2, 6, 3): "mean_recurrence=6: their coda's layer ids, P + 3 * mean_recurrence + i, need an odd one",
        (1, 2, 2, 4, 2): "n_layers_in_prelude + n_layers_in_coda = 3: an even R gates odd layer ids only",
        (1, 1, 2, 1, 1): "mean_backprop_depth=1: the other parity their gates need would change their mean depth",
    }
    for (P, R, C, mu_rec, mu_bwd), field in refusals.items():
        config = ParcaeConfig(vocab_size=300, d_model=64, head_dim=32, n_prelude=P, n_recur=R, n_coda=C,
                              mu_rec=mu_rec, mu_bwd=mu_bwd)
        with pytest.raises(ValueError, match=re.escape(field)) as err:
            hub.authors_config(config)
        assert "\n" not in str(err.value) and "skip those" in str(err.value)
    result = python(["-m", "interop.hub", "export", str(tmp_path / "none.pt"), str(tmp_path / "out")])
    assert result.returncode != 0 and result.stderr.strip().count("\n") == 0
    assert carries(result.stderr, str(tmp_path / "none.pt")), result.stderr


def test_an_export_replaces_a_model_folder_whole_and_two_weight_files_are_refused(tmp_path, capsys):
    """The issue's shadow: export into a folder holding another model's pytorch_model.bin. The folder is replaced
    whole (no weights file beside model.pt, no scratch folder left) and loads the new model; a folder with both
    files is refused in one line naming them, status 2; a folder holding other files is refused, kept as it was."""
    original, folder = exported(tmp_path, "diagonal")
    torch.save(authors_state_dict(tiny_model("diagonal", seed=4)), folder / "pytorch_model.bin")  # another model's
    with pytest.raises(SystemExit) as status:
        run_command(hub.main, [str(folder)])
    message = capsys.readouterr().err
    assert status.value.code == 2 and len(message.strip().splitlines()) == 1
    assert carries(message, str(folder), "pytorch_model.bin", "model.pt"), message
    hub.main(["export", str(tmp_path / "ckpt.pt"), str(folder)])
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.pt", "tokenizer.json",
                                                        "tokenizer_config.json"]
    assert not list(tmp_path.glob(".*"))  # neither the scratch folder nor the old one set aside
    assert_same_logits(original, hub.load_pretrained(str(folder))[0])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(SystemExit) as status:
        run_command(hub.main, ["export", str(tmp_path / "ckpt.pt"), str(tmp_path / "mine")])
    message = capsys.readouterr().err
    assert status.value.code == 2 and carries(message, str(tmp_path / "mine"), "notes.txt"), message
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def export_newer(tmp_path):
    """A second model's checkpoint beside exported()'s, with the same tokenizer -> (model, checkpoint path)."""
    from nanoparcae.checkpoint import save_checkpoint
    newer = tiny_model("diagonal", seed=6)
    save_checkpoint(tmp_path / "newer.pt", newer, tokenizer_dir=str(tmp_path / "tok"))
    return newer, tmp_path / "newer.pt"


def test_an_export_through_a_symbolic_link_replaces_the_folder_it_points_to(tmp_path, monkeypatch, capsys):
    """The link stays a link to the same folder, which now holds the new model; no hidden folder is left; a loop
    of links is refused in one line, left as it was."""
    _, real = exported(tmp_path, "diagonal")
    newer, checkpoint = export_newer(tmp_path)
    (tmp_path / "links").mkdir()
    link, loop = tmp_path / "links" / "link", tmp_path / "links" / "loop"
    link.symlink_to(real)
    loop.symlink_to(loop)
    result = run_here(["-m", "interop.hub", "export", str(checkpoint), str(link)], monkeypatch, capsys)
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert_same_logits(newer, hub.load_pretrained(str(real))[0])
    assert not [p.name for p in (*tmp_path.iterdir(), *link.parent.iterdir()) if p.name.startswith(".")]
    message = refused(run_here(["-m", "interop.hub", "export", str(checkpoint), str(loop)], monkeypatch, capsys))
    assert carries(message, str(loop)) and loop.is_symlink(), message


@pytest.mark.parametrize("fault", ["room for the weights file only", "ENOSPC while free space shows"])
def test_an_export_out_of_disk_ends_in_one_line_and_leaves_the_folder_as_it_was(tmp_path, monkeypatch, capsys,
                                                                                fault):
    """Status 1, one line naming the folder; the earlier export there is whole, and no hidden folder is left."""
    _, folder = exported(tmp_path, "diagonal")
    _, checkpoint = export_newer(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    if fault == "room for the weights file only":
        usage = shutil.disk_usage(tmp_path)._replace(free=(folder / "model.pt").stat().st_size + 1)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: usage)
    else:
        def full(obj, file):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(torch, "save", full)
    result = run_here(["-m", "interop.hub", "export", str(checkpoint), str(folder)], monkeypatch, capsys)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert carries(result.stderr, os.path.realpath(folder)), result.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_next_export_removes_the_partial_folders_a_stopped_one_left(tmp_path, capsys):
    """Beside the destination, only the folders with an export's own temporary names, of a process no longer
    running, are removed, each named on stdout; another destination's and a running export's stay."""
    _, folder = exported(tmp_path, "diagonal")
    gone = 2**22 + 1  # above any pid_max: no process has it
    stopped = [tmp_path / f".out.{gone}.old", tmp_path / f".out.{gone}.tmp"]  # in the order removed
    kept = [tmp_path / f".out.{os.getppid()}.tmp", tmp_path / f".other.{gone}.tmp", tmp_path / f".out.{gone}.txt"]
    for partial in stopped + kept:
        partial.mkdir()
        (partial / "model.pt").write_bytes(b"partial")
    capsys.readouterr()
    hub.main(["export", str(tmp_path / "ckpt.pt"), str(folder)])
    out = capsys.readouterr().out
    assert carries(out, *map(str, stopped)), out
    assert not any(p.exists() for p in stopped) and all(p.is_dir() for p in kept)


@pytest.mark.parametrize("held", ["a tensor", "a list"])
def test_exporting_a_checkpoint_that_holds_no_dict_ends_in_one_line(tmp_path, monkeypatch, capsys, held):
    """export reads checkpoints through load_run, whose refusal names the file; nothing is written."""
    path = tmp_path / "ckpt_000010.pt"
    torch.save(torch.zeros(3) if held == "a tensor" else [torch.zeros(3)], path)
    message = refused(run_here(["-m", "interop.hub", "export", str(path), str(tmp_path / "out")], monkeypatch, capsys))
    assert carries(message, str(path)) and not (tmp_path / "out").exists(), message


def test_an_export_into_a_mount_point_or_a_busy_folder_ends_in_one_line(tmp_path, monkeypatch, capsys):
    """Probe: an export into a mount point ended in `Device or resource busy` from the rename, a traceback. A mount
    point is refused before anything is written; a folder the OS will not rename is one line naming its cause."""
    _, folder = exported(tmp_path, "diagonal")
    _, checkpoint = export_newer(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == folder or ismount(path))
    message = refused(run_here(["-m", "interop.hub", "export", str(checkpoint), str(folder)], monkeypatch, capsys))
    assert carries(message, str(folder), "mount") and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    rename = Path.rename

    def busy(self, target):
        if self == folder:
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(self))
        return rename(self, target)
    monkeypatch.setattr(Path, "rename", busy)
    result = run_here(["-m", "interop.hub", "export", str(checkpoint), str(folder)], monkeypatch, capsys)
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert carries(result.stderr, str(folder), os.strerror(errno.EBUSY)), result.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_an_allocation_a_process_limit_refuses_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """Probe: under `ulimit -v`, a load the memory plan passed failed; the release's weights file was said not to be
    a state dict, to be deleted, and our checkpoint to be truncated, to be removed. Each now names the memory refused,
    and neither file is advised away."""
    folder = write_authors_folder(tmp_path / "release", tiny_model("diagonal"))
    _, checkpoint = exported(tmp_path, "diagonal")
    load = torch.load

    def refused_memory(path, *args, **kwargs):
        if kwargs.get("mmap"):
            raise RuntimeError(f"unable to mmap 4096 bytes from file <{path}>: Cannot allocate memory (12)")
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 4096 bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(torch, "load", refused_memory)
    for args, status in ((["-m", "interop.hub", str(folder)], 1),
                         (["-m", "interop.hub", "export", str(tmp_path / "ckpt.pt"), str(tmp_path / "again")], 2)):
        result = run_here(args, monkeypatch, capsys)
        assert result.returncode == status and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert carries(result.stderr, "Cannot allocate memory", "limit"), result.stderr
        words = ("delete", "truncated", "loadable", "not a nanoparcae")
        assert not any(word in result.stderr for word in words), result.stderr
    monkeypatch.setattr(torch, "load", load)
    assert hub.load_pretrained(str(folder))[0] is not None and checkpoint.is_dir()

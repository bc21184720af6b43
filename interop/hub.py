"""
hub.py: run the authors' released Parcae checkpoints with nanoparcae's model and a tiktoken tokenizer.
The releases are SandyResearch/parcae-140m, the other sizes, and their GPT baselines.

Their package parcae_lm writes a folder with config.json, a state dict and a byte-level BPE tokenizer.json.
config.json is its config dataclass as JSON plus `_class_name`; the weights are model.pt or pytorch_model.bin.
METHOD.md §5 describes the format.
This file downloads such a folder, or reads a local one, and builds our ParcaeConfig from theirs.
It renames their parameters onto ours with one explicit table.
It turns tokenizer.json into a tiktoken Encoding wrapped in tokenizer.Tokenizer.
`export` goes the other way, writing a nanoparcae checkpoint as such a folder for their from_pretrained.

    python -m interop.hub SandyResearch/parcae-140m                   # download, load, print a summary
    python -m interop.hub sample SandyResearch/parcae-140m --T=8 --prompt="The ocean"   # sample.py's flags
    python -m interop.hub eval SandyResearch/parcae-140m --T 8 --max_per_task 100       # eval_core.py's flags
    python -m interop.hub export d12 out/parcae-d12                   # a run, or ./ckpt.pt (a path) -> their format
    model, tokenizer = interop.hub.load_pretrained("SandyResearch/parcae-140m")   # or a local folder
"""

import json
import math
import os
import re
import shutil
import sys
import warnings
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch

import eval_core
import sample
from nanoparcae.checkpoint import load_run, saved_bytes
from nanoparcae.command import EnvironmentFailure, command_parser, first_sentence, run_command, size
from nanoparcae.files import NO_WRITE, check_writable, get_base_dir, read_json
from nanoparcae.download import download_file
from engine import free_memory
from model import SAMPLINGS, Block, Parcae, ParcaeConfig, from_weights, value_embedding_layers
from nanoparcae.tokenizer import Tokenizer

HUB_URL = os.environ.get("NANOPARCAE_HUB_URL", "https://huggingface.co")  # tests point it at 127.0.0.1
WEIGHT_FILES = ("pytorch_model.bin", "model.pt")  # the order their from_pretrained tries
# a model folder's files, as export or their save_pretrained (either weights file) writes them
MODEL_FILES = ("config.json", *WEIGHT_FILES, "tokenizer.json", "tokenizer_config.json")
SOURCE_HELP = "a Hub repo id (SandyResearch/parcae-140m) or a local folder with config.json, model.pt, tokenizer.json"

# -----------------------------------------------------------------------------
# Download, from {HUB_URL}/{repo_id}/resolve/main/{file} to get_base_dir()/hub/<repo_id>/<file>


def cache_dir(repo_id):
    return get_base_dir() / "hub" / repo_id


def local_dir(source):
    """Where a source's files sit on this machine, the folder itself or a repo's cache."""
    return Path(source) if Path(source).is_dir() else cache_dir(source)


def download(repo_id, filename):
    """Fetch one file into the cache (kept across calls; a partial one is resumed, see download.download_file).
    Returns the path, or None when the server has no such file."""
    path = cache_dir(repo_id) / filename
    if path.is_file():
        return path
    url = f"{HUB_URL}/{repo_id}/resolve/main/{filename}"
    check_writable(path.parent, f"{repo_id}'s {filename}")  # a read-only cache is named, not the network
    try:
        return download_file(url, path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise FileNotFoundError(f"{err}; check the repo id and the network, or pass a local folder") from None


def fetch_files(source, need_tokenizer=False):
    """Find a source's files -> the paths of config.json, the weights and tokenizer.json.
    The source is a local folder or a Hub repo id.
    The tokenizer is None where their save_pretrained wrote none.
    With need_tokenizer (text is read or written) a missing one is refused in one line."""
    folder, local = local_dir(source), Path(source).is_dir()
    where = source if local else f"{HUB_URL}/{source}"

    def get(name):
        if local:
            return folder / name if (folder / name).is_file() else None
        return download(source, name)

    config_path, tokenizer_path = get("config.json"), get("tokenizer.json")
    both = [name for name in WEIGHT_FILES if local and (folder / name).is_file()]
    if len(both) > 1:  # their loader reads the first, maybe another model's left by an earlier export
        raise ValueError(f"{folder} holds both {' and '.join(both)}, which may be two models' weights; remove the "
                         f"one that is not this model's, or export again into a new folder")
    # a weights file already in the cache first, so a cached repo never touches the network
    names = sorted(WEIGHT_FILES, key=lambda name: not (folder / name).is_file())
    weights_path = next((p for p in map(get, names) if p is not None), None)
    for name, found in (("config.json", config_path), (" or ".join(WEIGHT_FILES), weights_path)):
        if found is None:
            raise FileNotFoundError(f"{where} has no {name}; the source is a Hub repo id such as "
                                    f"SandyResearch/parcae-140m or a folder holding config.json and model.pt")
    if tokenizer_path is None and need_tokenizer:
        raise FileNotFoundError(f"{where} has no tokenizer.json, which text needs: add the tokenizer.json of the "
                                f"tokenizer the model was trained with (their save_pretrained writes none)")
    return config_path, weights_path, tokenizer_path


# -----------------------------------------------------------------------------
# Config, from their ParcaeConfig / GPTConfig (parcae_lm/models/*/config.py) to our ParcaeConfig

INJECTION_OF_CLASS = {"ParcaeConfig": None, "GPTConfig": "none"}  # Parcae's comes from injection_type below
INJECTION_OF_TYPE = {"diagonal": "diagonal", "linear": "concat", "add": "add"}  # their LinearInjection = our concat
# every field whose other values change the forward, with the one value our model computes
REQUIRED = {"bias": False, "qk_bias": False, "qk_norm": True, "clip_qkv": None, "logit_softcap": None,
            "tie_embeddings": True, "norm_class_name": "RMSNorm", "block_class_name": "TransformerPreNormBlock",
            "mlp_class_name": "BaseMLP", "nonlin_name": "ReLU2", "mup_model_scaling_factor": 1,
            "randomize_positions_from": None}
REQUIRED_PARCAE = {"state_init": "like-init"}  # h0 ~ TruncNormal(0, embedding std, +-3 std), as ours
REQUIRED_GPT = {"use_abacus": False}
# init strategies (their utils/init.py) with embedding std sqrt(2/(5d)), no embed_scale, no logit_scale:
# the only places where the init table reaches the forward (h0's std, x * emb_scale, logits * logit_scale)
PLAIN_INITS = ("scaled-zero", "scaled", "scaled-geiping", "scaled-stuck", "small")


# what each field read must hold, its test and its name in a refusal (JSON's true is no number here)
KINDS = {"size": (lambda v: type(v) is int and v >= 1, "a whole number of at least 1"),
         "count": (lambda v: type(v) is int and v >= 0, "a whole number of at least 0"),
         "number": (lambda v: type(v) in (int, float) and 0 <= v < math.inf, "a finite number of at least 0"),
         "flag": (lambda v: type(v) is bool, "true or false"), "text": (lambda v: type(v) is str, "a string"),
         "object": (lambda v: type(v) is dict, "an object of fields")}
ROPE_FIELDS = {"use_rope": "flag", "rope_condense_ratio": "number", "rope_base": "number"}  # their RoPESettings
THEIR_ROPE_BASE = 50_000  # RoPESettings' default, the base their from_pretrained builds with


def field(cfg, name, kind=None, where="config.json"):
    """cfg[name], of the kind KINDS names; else ValueError naming where and the field."""
    if name not in cfg:
        raise ValueError(f"{where} has no field {name!r}; it is not a parcae_lm save_pretrained config")
    value = cfg[name]
    if kind and not KINDS[kind][0](value):
        raise ValueError(f"{where} has {name}={value!r}, where {KINDS[kind][1]} belongs")
    return value


def require(cfg, name, expected, where="config.json"):
    value = field(cfg, name, where=where)
    if value != expected:
        raise ValueError(f"{where} has {name}={value!r}, nanoparcae's model computes only {name}={expected!r}")


def rope_base(cfg, where):
    """Their rope_settings, checked field by field -> the RoPE base. An unknown setting may change RoPE, so it is
    refused."""
    rope = field(cfg, "rope_settings", "object", where)
    if unknown := sorted(set(rope) - set(ROPE_FIELDS)):
        raise ValueError(f"{where} has rope_settings.{unknown[0]}, a RoPE setting nanoparcae does not know")
    settings = {name: field(rope, name, kind, f"{where} rope_settings") for name, kind in ROPE_FIELDS.items()
                if name in rope}
    if not settings.get("use_rope", True) or settings.get("rope_condense_ratio", 1) != 1:
        raise ValueError(f"{where} has rope_settings={rope}; nanoparcae computes plain RoPE only")
    return float(settings.get("rope_base", THEIR_ROPE_BASE))


def config_from_authors(cfg, where="config.json"):
    """Their config.json dict -> our ParcaeConfig. Each field read is checked for its kind first.
    Unknown classes and settings our forward does not compute are refused with one line naming where,
    never approximated. Fields outside the forward (name, attn_impl, ...) are not read."""
    if type(cfg) is not dict:
        raise ValueError(f"{where} holds a JSON {type(cfg).__name__}, not the object of fields a config is")
    class_name = cfg.get("_class_name", "GPTConfig")  # their from_pretrained's default too
    if type(class_name) is not str or class_name not in INJECTION_OF_CLASS:
        raise ValueError(f"{where} has _class_name={class_name!r}; nanoparcae loads only "
                         f"{' and '.join(INJECTION_OF_CLASS)} (Parcae and its GPT baseline)")
    parcae = class_name == "ParcaeConfig"

    def get(name, kind="size"):
        return field(cfg, name, kind, where)

    for name, expected in {**REQUIRED, **(REQUIRED_PARCAE if parcae else REQUIRED_GPT)}.items():
        require(cfg, name, expected, where)
    d, n_head = get("n_embd"), get("num_attention_heads")
    if d % n_head or d // n_head % 2:
        raise ValueError(f"{where} has n_embd={d} and num_attention_heads={n_head}: a head's {d / n_head:g} "
                         f"dims must be a whole even number (RoPE turns pairs)")
    require(cfg, "num_key_value_heads", n_head, where)
    require(cfg, "intermediate_size", 4 * d, where)
    if get("init_strategy", "text") not in PLAIN_INITS:
        raise ValueError(f"{where} has init_strategy={cfg['init_strategy']!r}, whose embedding or logit scale "
                         f"nanoparcae does not compute; supported: {PLAIN_INITS}")
    common = dict(vocab_size=get("vocab_size"), seq_len=get("block_size"), d_model=d, head_dim=d // n_head,
                  n_head=n_head, norm_eps=get("norm_eps", "number"), rope_base=rope_base(cfg, where))
    if not parcae:
        n_layer = get("n_layer")  # the blocks run once in order, so any split into three parts is the same
        third = n_layer // 3
        config = ParcaeConfig(**common, n_prelude=third, n_recur=n_layer - 2 * third, n_coda=third, injection="none")
    else:
        require(cfg, "recurrent_embedding_dimension", d, where)
        require(cfg, "recurrent_intermediation_embedding_dimension", 4 * d, where)
        if cfg.get("recurrent_num_attention_heads") not in (None, n_head):
            raise ValueError(f"{where} has recurrent_num_attention_heads={cfg['recurrent_num_attention_heads']}, "
                             f"nanoparcae's recurrent block has the same {n_head} heads as the rest")
        injection = get("injection_type", "text")
        if injection not in INJECTION_OF_TYPE:
            raise ValueError(f"{where} has injection_type={injection!r}; supported: {tuple(INJECTION_OF_TYPE)}")
        sampling = "per_batch" if cfg.get("recurrent_iteration_method") == "per-batch" else "per_sequence"
        config = ParcaeConfig(**common, n_prelude=get("n_layers_in_prelude", "count"),
                              n_recur=get("n_layers_in_recurrent_block"), n_coda=get("n_layers_in_coda", "count"),
                              mu_rec=get("mean_recurrence"), mu_bwd=get("mean_backprop_depth"),
                              injection=INJECTION_OF_TYPE[injection], prelude_norm=get("prelude_norm", "flag"),
                              sampling=sampling)
        gated, embedded = gated_layers(config, cfg["mean_backprop_depth"]), value_embedding_layers(config)
        if gated != embedded:  # nanoparcae pairs each value embedding with its gate, as the released sizes do
            layer = min(set(gated) ^ set(embedded))
            what = "a value embedding but no gate" if layer in embedded else "a gate but no value embedding"
            raise ValueError(f"{where} gives layer {layer} {what} in the authors' code; nanoparcae pairs them "
                             f"and cannot run it")
    if config.padded_vocab_size != get("padded_vocab_size"):
        raise ValueError(f"{where} pads the vocabulary to {cfg['padded_vocab_size']} rows, nanoparcae pads "
                         f"{config.vocab_size} to {config.padded_vocab_size} (a multiple of 64)")
    return config


def gated_layers(config, mean_backprop_depth):
    """List the layers their Parcae gives a ve_gate; without one it ignores the value embedding.
    The rule is has_ve(layer id, R * mean_backprop_depth), from parcae_lm/modules/mixer.py and parcae/config.py.
    Layer ids are i (prelude), P + i (recurrent) and P + R * mean_recurrence + i (coda).
    Only the parities of R * mu_rec and R * mbd matter."""
    c = config
    ids = [*range(c.n_prelude + c.n_recur), *(c.n_prelude + c.n_recur * c.mu_rec + i for i in range(c.n_coda))]
    return [i for i, layer_id in enumerate(ids) if layer_id % 2 == (c.n_recur * mean_backprop_depth - 1) % 2]


# -----------------------------------------------------------------------------
# Parameter names, theirs -> ours, in one explicit table
#
# Where the authors' forward could differ from ours, and how we match it (read from parcae_lm):
# - h0. Their state_init "like-init" draws TruncNormal(0, std, +-3 std), std being their init table's
#   embedding std (sqrt(2/(5d)) for scaled-zero) times emb_scale = 1. That is model.initial_state, on another
#   random stream (pass h0 to compare the two on one draw).
# - value embeddings. Both add ResFormer's 2 sigmoid(ve_gate(x[..., :32])) * ve to v, x the block's normed
#   input, the recurrent layers reusing theirs at every step. gated_layers says which layers carry them.
# - norms. norm_1, norm_2, ln_prelude and ln_f are RMSNorm(eps=norm_eps) with a weight and no unit offset (their
#   Config.Norm adds one only for "Gemma" names). The prelude norm feeds the injection only, as ours.
# - RoPE. Theirs rotates interleaved pairs (2i, 2i+1) by +angle (modules/utils.py apply_rotary_emb_complex_like);
#   ours halves (i, D/2 + i) by -angle. Rotating (b, a) by -angle is rotating (a, b) by +angle, so our dims
#   (i, D/2 + i) = their (2i + 1, 2i). rope_order permutes the rows of c_q and c_k in each head, and RMS norm
#   and q.k do not see the order. Same frequencies base^(-2i/D); the base is checked against their freqs_cis.
# - qk norm. Both take a parameter-free RMS norm after RoPE, theirs F.rms_norm with eps=None (the dtype's
#   machine epsilon, 1.2e-7 in float32), see model.py's Attention.
# - attention. SDPA / flash with the default scale 1/sqrt(head_dim), causal, n_kv_head = n_head.
# - MLP. Theirs is fc -> 0.5 * relu(x)^2 (their Relu2's mul(0.5)) -> proj, no biases, as ours.
# - head. It is tied to wte (tie_embeddings), logits * logit_scale = 1 (PLAIN_INITS), no softcap. Theirs have
#   padded_vocab_size columns, ours are cut to vocab_size.
# - injection. Theirs is x * exp(-dt * exp(A_log)) + dt * (e @ B^T), dt = softplus(dt_bias). Ours forms the
#   rate as exp(A_log + ln dt) floored at 1e-6 (model.py DiagonalInjection.discretize), below which the decays
#   differ by less than 1e-6.
# - C_proj. Their transformer.C, a bias-free Linear after the loop with no norm before it, is ours.
# - vocabulary. Both pad to a multiple of 64 (config_from_authors checks padded_vocab_size).
# - depth. Without num_steps_pair their per-sequence forward samples a depth even in eval mode, and ours
#   runs mu_rec. Give T explicitly (theirs num_steps_pair=[T]) to compare.

BLOCK_NAMES = {  # their TransformerPreNormBlock (parcae_lm/modules/ blocks, mixer and mlp) -> our Block
    "norm_1.weight": "attn_norm.weight", "norm_2.weight": "mlp_norm.weight",
    "attn.c_q.weight": "attn.c_q.weight", "attn.c_k.weight": "attn.c_k.weight", "attn.c_v.weight": "attn.c_v.weight",
    "attn.c_proj.weight": "attn.c_proj.weight", "attn.ve_gate.weight": "attn.ve_gate.weight",
    "mlp.fc.weight": "mlp.c_fc.weight", "mlp.proj.weight": "mlp.c_proj.weight",
}
TOP_NAMES = {
    "transformer.wte.weight": "wte.weight",
    "transformer.ln_f.weight": "norm_f.weight",
    "transformer.ln_prelude.weight": "prelude_norm.weight",
    "transformer.adapter.A_log": "injection.A_log",  # DiagonalInjection (modules/injection.py)
    "transformer.adapter.dt_bias": "injection.dt_bias",
    "transformer.adapter.B": "injection.B.weight",  # a bare (d, d) Parameter used as e @ B^T, i.e. Linear's weight
    "transformer.adapter.adapter.weight": "injection.adapter.weight",  # LinearInjection, a Linear(2d -> d) on [h, e]
    "transformer.C.weight": "C_proj.weight",
}
BLOCK_PARTS = {"prelude": "prelude", "core_block": "recur", "coda": "coda"}  # their Parcae's ModuleLists
CHECKED_NAMES = ("lm_head.weight", "freqs_cis")  # the tied head and RoPE buffer, checked only
BLOCK_NAME = re.compile(r"transformer\.(prelude|core_block|coda|h)\.(\d+)\.(.+)")
VALUE_EMBED_NAME = re.compile(r"value_embeds\.(\d+)\.weight")


def our_name(name, config):
    """Their state-dict name -> ours, or None when the table has no entry for it."""
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    if VALUE_EMBED_NAME.fullmatch(name):
        return name  # same global layer index in both
    match = BLOCK_NAME.fullmatch(name)
    if not match or match[3] not in BLOCK_NAMES:
        return None
    part, index = match[1], int(match[2])
    if part == "h":  # their GPT's single list of blocks, cut into our three parts
        starts = (("coda", config.n_prelude + config.n_recur), ("recur", config.n_prelude), ("prelude", 0))
        part, start = next((part, start) for part, start in starts if index >= start)
        index -= start
    else:
        part = BLOCK_PARTS[part]
    return f"{part}.{index}.{BLOCK_NAMES[match[3]]}"


def map_names(their_shapes, our_shapes, config):
    """Map their names and shapes to our names, as a dict from each name of theirs to ours.
    Every name of theirs, but CHECKED_NAMES, lands on exactly one of ours with the same shape.
    Every one of ours is covered."""
    mapping = {}
    for name, shape in their_shapes.items():
        if name in CHECKED_NAMES:
            continue
        ours = our_name(name, config)
        if ours is None or ours not in our_shapes:
            raise ValueError(f"the checkpoint's parameter {name} has no place in nanoparcae's model "
                             f"({'no entry in the name table' if ours is None else f'no {ours} in our model'})")
        if ours in mapping.values():
            raise ValueError(f"the checkpoint's parameter {name} maps onto {ours}, which another name already filled")
        if tuple(shape) != tuple(our_shapes[ours]):
            raise ValueError(f"the checkpoint's {name} has shape {tuple(shape)}, "
                             f"our {ours} has {tuple(our_shapes[ours])}")
        mapping[name] = ours
    left = sorted(set(our_shapes) - set(mapping.values()))
    if left:
        raise ValueError(f"the checkpoint has no weights for {len(left)} of our parameters, e.g. {left[0]}")
    return mapping


def rope_order(head_dim):
    """Our dim j of a head holds their dim rope_order[j], so (i, D/2 + i) <- (2i + 1, 2i)."""
    half = head_dim // 2
    return torch.tensor([2 * i + 1 for i in range(half)] + [2 * i for i in range(half)])


def convert_state_dict(state_dict, model):
    """Their state dict -> ours (a new dict), after checking the tied head and the RoPE table."""
    c = model.config
    mapping = map_names({k: v.shape for k, v in state_dict.items()},
                        {k: v.shape for k, v in model.state_dict().items()}, c)
    head, wte = state_dict.get("lm_head.weight"), state_dict["transformer.wte.weight"]
    if head is not None and not torch.equal(head, wte):
        raise ValueError("the checkpoint's lm_head.weight differs from transformer.wte.weight; nanoparcae ties them")
    if "freqs_cis" in state_dict:
        theirs = state_dict["freqs_cis"].float()[0, :, 0]  # (S, D/2, [cos, sin])
        ours = torch.stack([model.rope_cos[0, :theirs.size(0), 0], model.rope_sin[0, :theirs.size(0), 0]], dim=-1)
        if theirs.shape != ours.shape or not torch.allclose(theirs.to(ours.device), ours, atol=1e-4):
            raise ValueError(f"the checkpoint's RoPE table (freqs_cis) is not ours with base {c.rope_base:g} "
                             f"and head_dim {c.head_dim}; check rope_settings in config.json")
    order = rope_order(c.head_dim)
    converted = {}
    for name, ours in mapping.items():
        tensor = state_dict[name]
        if ours.endswith(("attn.c_q.weight", "attn.c_k.weight")):
            tensor = tensor.view(c.n_head, c.head_dim, -1)[:, order].reshape(tensor.shape)
        converted[ours] = tensor
    return converted


# -----------------------------------------------------------------------------
# Tokenizer, from a byte-level BPE tokenizer.json (HF tokenizers) to a tiktoken Encoding

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
BOS_NAMES = ("<|bos|>", "<|endoftext|>", "<s>")  # the first one the tokenizer has marks a document start


def byte_level_alphabet():
    """GPT-2's byte-level alphabet, in which printable bytes stand for themselves and the other 68 for chr(256 + k)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


def split_pattern(pre_tokenizer):
    """The regex that cuts text into pieces, a Split's before a regex-free ByteLevel, or ByteLevel's own (GPT-2's)."""
    kind = (pre_tokenizer or {}).get("type")
    steps = pre_tokenizer.get("pretokenizers", []) if kind == "Sequence" else [pre_tokenizer or {}]
    kinds = [s.get("type") for s in steps]
    split_then_bytes = kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True)
    if split_then_bytes and "Regex" in steps[0].get("pattern", {}) \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        pattern = steps[0]["pattern"]["Regex"]
    elif kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        pattern = GPT2_PATTERN
    else:
        raise ValueError(f"tokenizer.json pre-tokenizer {kinds} is not byte-level BPE "
                         f"(Split + ByteLevel, or ByteLevel)")
    if steps[-1].get("add_prefix_space"):
        raise ValueError("tokenizer.json adds a prefix space, which tiktoken does not; nanoparcae cannot reproduce it")
    return pattern


def tokenizer_from_json(path, bos_token=None):
    """tokenizer.json -> tokenizer.Tokenizer, its vocabulary mapped back to bytes with ranks = ids.
    BPE merges are in id order, as a trainer mints them, and added tokens are kept as special tokens."""
    spec = read_json(path)
    bpe = spec.get("model") if isinstance(spec.get("model"), dict) else {}
    if bpe.get("type") != "BPE" or not isinstance(bpe.get("vocab"), dict) or spec.get("normalizer"):
        raise ValueError(f"{path} is not a plain BPE tokenizer with a vocabulary (its model is "
                         f"{str(spec.get('model'))[:40]!r}, its normalizer {str(spec.get('normalizer'))[:40]!r})")
    pattern = split_pattern(spec.get("pre_tokenizer"))
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    alphabet = byte_level_alphabet()
    ranks = {}
    for token, rank in bpe["vocab"].items():
        if token in specials:
            continue
        if any(ch not in alphabet for ch in token):
            raise ValueError(f"{path} has token {token!r} outside the byte-level alphabet")
        ranks[bytes(alphabet[ch] for ch in token)] = rank
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path} lacks {len(missing)} of the 256 single-byte tokens (e.g. byte {missing[0]})")
    bos = bos_token or next((name for name in BOS_NAMES if name in specials), None)
    if bos not in specials:
        raise ValueError(f"{path} has no BOS among its special tokens {sorted(specials)[:8]}; looked for {BOS_NAMES}")
    return Tokenizer(ranks, pattern, specials, bos, name=Path(path).parent.name or "authors")


# -----------------------------------------------------------------------------
# Everything together


def model_bytes(config, free):
    """Bytes of config's float32 model, its parameters and RoPE tables, counted on the meta device.
    Where its layers alone pass `free`, it is their count times one layer's bytes, a lower bound built at once."""
    with torch.device("meta"):
        layers = config.n_layer * sum(p.nbytes for p in Block(config, False).parameters())
        if layers > free:
            return layers
        model = Parcae(config)
    return sum(t.nbytes for t in (*model.parameters(), *model.buffers()))


def check_memory(config, config_path, weights_path, device):
    """Refuse in one line, before anything is allocated, a model the memory free cannot hold.
    The CPU holds the weights file's tensors and the float32 model, another device the model again."""
    c, cpu, device = config, torch.device("cpu"), torch.device(device)
    free = free_memory(cpu)
    held = model_bytes(c, free)
    needs = [(cpu, held + weights_path.stat().st_size, free)]
    if device != cpu:
        needs.append((device, held, free_memory(device)))
    for place, bytes_needed, free in needs:
        if bytes_needed > free:
            raise ValueError(f"{config_path} asks for a model of n_embd={c.d_model}, {c.n_layer} layers, "
                             f"vocab_size={c.vocab_size} and block_size={c.seq_len}, which needs "
                             f"{size(bytes_needed)} on {place}, more than the {size(free)} free; nothing was "
                             f"allocated: check those fields")


def read_weights(path, fix):
    """Their weights file -> its state dict, read with weights_only. Anything but named tensors raises ValueError."""
    try:
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        if isinstance(err, RuntimeError) and zipfile.is_zipfile(path):  # whole, so the machine refused it
            raise out_of_memory(path, err) from None
        raise ValueError(f"{path} is not a loadable state dict ({first_sentence(err)}); {fix}") from None
    entries = state_dict.items() if type(state_dict) is dict else [(None, state_dict)]
    bad = next(((name, value) for name, value in entries
                if type(name) is not str or not isinstance(value, torch.Tensor)), None)
    if bad:
        what = f"a {type(state_dict).__name__}" if bad[0] is None else f"{bad[0]!r}: a {type(bad[1]).__name__}"
        raise ValueError(f"{path} holds {what}, not a state dict of named tensors; {fix}")
    return state_dict


def out_of_memory(path, err):
    """The refusal of an allocation the memory plan passed, which a limit such as ulimit -v refused."""
    why = " ".join(str(err).split())[:300]  # torch's allocator puts the OS's cause last
    return EnvironmentFailure(f"{path} could not be loaded into memory ({why}); this process may allocate less "
                              f"than is free (ulimit -v), so raise its limit or free memory")


def load_pretrained(source, device="cpu", need_tokenizer=False):
    """A Hub repo id (e.g. SandyResearch/parcae-140m) or a local folder -> (model in eval mode, tokenizer); the
    tokenizer is None for a folder without tokenizer.json, or a one-line error if need_tokenizer (fetch_files)."""
    config_path, weights_path, tokenizer_path = fetch_files(source, need_tokenizer)
    authors_config = read_json(config_path)
    config = config_from_authors(authors_config, config_path)
    check_memory(config, config_path, weights_path, device)
    fix = "export or copy it again" if Path(source).is_dir() else "delete it to download it again"
    state_dict = read_weights(weights_path, fix)
    if config.injection == "none" and not authors_config.get("use_fused_head", "pytorch"):
        state_dict.pop("lm_head.weight", None)  # their GPT's own head, never read when tied (authors_state_dict)
    try:  # no random init, as the weights are the release's tensors themselves
        with torch.device("meta"):
            shaped = Parcae(config)  # our names and shapes
        shaped.init_buffers()  # the RoPE table, compared with theirs
        model = from_weights(asdict(config), convert_state_dict(state_dict, shaped), device)
    except RuntimeError as err:
        raise out_of_memory(weights_path, err) from None
    tokenizer = None if tokenizer_path is None else tokenizer_from_json(tokenizer_path)
    if tokenizer and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{tokenizer_path} has {tokenizer.vocab_size} tokens, the model only {config.vocab_size}")
    return model, tokenizer


# -----------------------------------------------------------------------------
# Export, from a nanoparcae checkpoint to a folder their from_pretrained reads (the tables above, inverted)
#
# Their from_pretrained (parcae_lm/__init__.py) reads config.json into ParcaeConfig or GPTConfig by
# _class_name, dropping rope_settings (so RoPE base 50,000, their default), builds the model and loads
# pytorch_model.bin or model.pt with strict=False, which would skip a name that is not theirs silently, so
# the names come from the same tables the loader checks. Their tokenizer (parcae_lm/tokenizer.py) is
# AutoTokenizer on tokenizer.json, with tokenizer_config.json naming the class and the special tokens.

THEIR_INJECTION = {ours: theirs for theirs, ours in INJECTION_OF_TYPE.items()}
THEIR_TOP_NAMES = {ours: theirs for theirs, ours in TOP_NAMES.items()}  # the loading tables, inverted
THEIR_BLOCK_NAMES = {ours: theirs for theirs, ours in BLOCK_NAMES.items()}
THEIR_BLOCK_PARTS = {ours: theirs for theirs, ours in BLOCK_PARTS.items()}
# our depth sampler -> their (recurrent_iteration_method, sampling_scheme); training only, the forward at a
# given depth does not read it. per_batch_split has no scheme of theirs, and its nearest draws the same T per batch.
THEIR_SAMPLING = {"per_sequence": ("per-sequence", "poisson-truncated-full"), "fixed": ("per-sequence", "fixed"),
                  **dict.fromkeys(("per_batch", "per_batch_split"), ("per-batch", "poisson-truncated-full")),
                  **{name: ("per-batch", name.replace("_", "-")) for name in SAMPLINGS if name.startswith("poisson")}}


def their_backprop_depth(c):
    """mu_bwd, or else its neighbour whose parity puts their value-embedding gates on our value-embedding layers.
    Past the gates it reaches only their depth sampler, T ~ Poisson(max(mean_recurrence, mean_backprop_depth)),
    with k = min(T, mean_backprop_depth) of them backpropagated. Keeping the max keeps every forward (any T, eval mode,
    per-sequence sampling). Only training changes, in k, and per-batch training runs T + k steps."""
    embedded, top = value_embedding_layers(c), max(c.mu_rec, c.mu_bwd)
    for depth in (c.mu_bwd, c.mu_bwd - 1, c.mu_bwd + 1):
        if depth >= 1 and max(c.mu_rec, depth) == top and gated_layers(c, depth) == embedded:
            if depth != c.mu_bwd:
                warnings.warn(f"config.json gets mean_backprop_depth={depth}, not mu_bwd {c.mu_bwd}, to place their "
                              f"value-embedding gates; only their training reads it (README)")
            return depth
    why = (f"mean_backprop_depth={c.mu_bwd}: the other parity their gates need would change their mean depth; "
           f"train with --mu_bwd <= mu_rec" if any(gated_layers(c, depth) == embedded for depth in (1, 2)) else
           f"mean_recurrence={c.mu_rec}: their coda's layer ids, P + {c.n_recur} * mean_recurrence + i, need an odd "
           f"one; train with an odd --mu_rec (e.g. {c.mu_rec + 1}) or --depth 6, 12, 18 or 24" if c.n_recur % 2 else
           f"n_layers_in_prelude + n_layers_in_coda = {c.n_prelude + c.n_coda}: an even R gates odd layer ids only")
    raise ValueError(f"cannot export {why} (their code would gate value embeddings on layers "
                     f"{gated_layers(c, c.mu_bwd)}, not on {embedded}, and skip those)")


def authors_config(c):
    """Our ParcaeConfig c -> their config.json dict (a ParcaeConfig, or a GPTConfig for the Transformer baseline),
    checked by reading it back with config_from_authors."""
    if c.rope_base != THEIR_ROPE_BASE:
        raise ValueError(f"this model has rope_base {c.rope_base:g}; their from_pretrained ignores rope_settings and "
                         f"builds RoPE with base {THEIR_ROPE_BASE:,}, so it would compute another model")
    cfg = dict(name="nanoparcae", block_size=c.seq_len, vocab_size=c.vocab_size, padding_multiple=64,
               padded_vocab_size=c.padded_vocab_size, n_embd=c.d_model, num_attention_heads=c.n_head,
               num_key_value_heads=c.n_head, intermediate_size=4 * c.d_model, norm_eps=c.norm_eps,
               init_strategy=PLAIN_INITS[0], init_orthogonal=True,  # model.py's init, their scaled-zero, orthogonal
               use_fused_head=False,  # any other value, their default "pytorch" too, gives their GPT a Triton head
               rope_settings=dict(use_rope=True, rope_condense_ratio=1, rope_base=THEIR_ROPE_BASE), **REQUIRED)
    if c.injection == "none":
        cfg.update(REQUIRED_GPT, n_layer=c.n_layer, _class_name="GPTConfig")
    else:
        method, scheme = THEIR_SAMPLING[c.sampling]
        cfg.update(REQUIRED_PARCAE, injection_type=THEIR_INJECTION[c.injection], n_layers_in_prelude=c.n_prelude,
                   n_layers_in_recurrent_block=c.n_recur, n_layers_in_coda=c.n_coda,
                   recurrent_embedding_dimension=c.d_model, recurrent_intermediation_embedding_dimension=4 * c.d_model,
                   recurrent_num_attention_heads=None, mean_recurrence=c.mu_rec,
                   mean_backprop_depth=their_backprop_depth(c),
                   prelude_norm=c.prelude_norm, recurrent_iteration_method=method, sampling_scheme=scheme,
                   _class_name="ParcaeConfig")
    config_from_authors(cfg)  # raises where their forward would differ
    return cfg


def their_name(name, config):
    """Our state-dict name -> theirs, our_name inverted."""
    if name in THEIR_TOP_NAMES or VALUE_EMBED_NAME.fullmatch(name):
        return THEIR_TOP_NAMES.get(name, name)
    part, index, rest = name.split(".", 2)
    block = THEIR_BLOCK_NAMES[rest]
    if config.injection == "none":  # their GPT has one list of blocks
        index = int(index) + {"prelude": 0, "recur": config.n_prelude, "coda": config.n_prelude + config.n_recur}[part]
        return f"transformer.h.{index}.{block}"
    return f"transformer.{THEIR_BLOCK_PARTS[part]}.{index}.{block}"


def authors_state_dict(model):
    """Rename our model's state dict to their names, q and k rows back in their interleaved RoPE order.
    It leaves out freqs_cis, which their model computes, and lm_head.weight.
    Their Parcae ties lm_head to wte; their GPT without the fused head builds one it never reads when tied.
    A CPU model's tensors are shared, not copied; only the reordered q and k rows are new."""
    c = model.config
    back = torch.argsort(rope_order(c.head_dim))
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("attn.c_q.weight", "attn.c_k.weight")):
            tensor = tensor.view(c.n_head, c.head_dim, -1)[:, back].reshape(tensor.shape)
        tensor = tensor.detach().cpu()
        if tensor.untyped_storage().nbytes() != tensor.nbytes or not tensor.is_contiguous():
            tensor = tensor.clone()  # torch.save writes a view's whole storage
        out[their_name(name, c)] = tensor
    return out


def tokenizer_json(tokenizer):
    """Write tokenizer.Tokenizer as a tokenizer.json dict that encodes as its tiktoken Encoding does.
    The format is HF tokenizers' byte-level BPE, with the same split regex.
    Every token is spelled in GPT-2's byte alphabet, with its rank as id.
    Each token of two or more bytes gets a merge for every cut into two tokens, ordered by the token's rank.
    That is because tiktoken joins the adjacent pair whose join ranks lowest.
    ignore_merges matches tiktoken's shortcut, by which a piece that is one token whole is that token."""
    enc = tokenizer.enc
    char_of = {b: ch for ch, b in byte_level_alphabet().items()}
    ranks = enc._mergeable_ranks

    def spell(token):
        return "".join(char_of[b] for b in token)

    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        cuts = sorted((ranks[token[:i]], ranks[token[i:]], i) for i in range(1, len(token))
                      if token[:i] in ranks and token[i:] in ranks)
        merges += [f"{spell(token[:i])} {spell(token[i:])}" for _, _, i in cuts]
    byte_level = dict(add_prefix_space=False, trim_offsets=True, use_regex=False)
    return {
        "version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
        "added_tokens": [dict(id=i, content=name, single_word=False, lstrip=False, rstrip=False, normalized=False,
                              special=True) for name, i in sorted(enc._special_tokens.items(), key=lambda t: t[1])],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": enc._pat_str}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **byte_level}]},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": {spell(token): rank for token, rank in ranks.items()}, "merges": merges},
    }


def export(model, tokenizer, out_dir):
    """Write config.json, model.pt, tokenizer.json and tokenizer_config.json for their from_pretrained.
    out_dir is written whole, as a folder beside it renamed to it at the end. A model folder there is replaced.
    So an earlier export's pytorch_model.bin never shadows this model.pt. Any other file there is refused.
    Where out_dir is a symbolic link, the folder it points to is replaced and the link kept.
    Returns the folder written."""
    special = {v: k for k, v in tokenizer.enc._special_tokens.items()}
    if tokenizer.bos_id not in special:
        raise ValueError("the tokenizer has no special BOS token to name in tokenizer_config.json")
    target = export_target(out_dir)
    tokens = {key: name for key, name in (("bos_token", special[tokenizer.bos_id]), ("eos_token", "<|eos|>"),
                                          ("pad_token", "<|pad|>")) if name in tokenizer.enc._special_tokens}
    tokenizer_config = dict(tokenizer_class="PreTrainedTokenizerFast", model_max_length=model.config.seq_len,
                            add_bos_token=False, add_eos_token=False, **tokens)
    texts = {"tokenizer.json": tokenizer_json(tokenizer), "tokenizer_config.json": tokenizer_config}
    texts = {name: json.dumps(obj, indent=1, ensure_ascii=False).encode() for name, obj in texts.items()}
    state = authors_state_dict(model)
    # config.json's 2 KB fit in saved_bytes' margin; the room is checked before authors_config warns
    make_room(target, saved_bytes(state) + sum(map(len, texts.values())))
    texts["config.json"] = json.dumps(authors_config(model.config), indent=1, ensure_ascii=False).encode()
    write_folder(target, texts, state)
    return target


def export_target(out_dir):
    """The folder an export into out_dir replaces, which is out_dir or the folder its symbolic links lead to.
    A file there, a loop of links, a mount point or a folder of other files than a model's raises ValueError."""
    target = Path(os.path.realpath(out_dir))
    if target.is_symlink() or (target.exists() and not target.is_dir()) or os.path.ismount(target):
        why = "a loop of symbolic links" if target.is_symlink() else "a mount point, which the export cannot " \
            "replace by renaming" if target.is_dir() else "a file"
        raise ValueError(f"{out_dir} is {why}; pass a folder to export into")
    if target.is_dir() and (others := sorted(p.name for p in target.iterdir() if p.name not in MODEL_FILES)):
        raise ValueError(f"{out_dir} holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}, not a "
                         f"model's files; export into a new or empty folder (a model folder there is replaced whole)")
    return target


def make_room(target, needs):
    """Remove the folders a stopped export into target left beside it, then check room for `needs` bytes there.
    A read-only or full disk raises EnvironmentFailure (check_writable)."""
    if target.parent.is_dir():
        remove_partial_exports(target)
    check_writable(target.parent, f"the export to {target}", needs=needs)  # its folder is made beside it


def write_folder(target, texts, state):
    """Write texts (bytes by name) and state, as model.pt, into a folder beside target, then rename it to target.
    A write that fails raises EnvironmentFailure in one line, with target as it was and no folder left."""
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        scratch.mkdir()
        for name, text in texts.items():
            (scratch / name).write_bytes(text)
        with open(scratch / "model.pt", "wb") as file:  # through Python's file, a full disk raises its errno
            torch.save(state, file)
        replace_folder(scratch, target)
    except OSError as err:
        fix = "free space on its disk or make it writable" if err.errno in NO_WRITE else "see the cause"
        raise EnvironmentFailure(f"the export to {target} could not be written ({err.strerror}); that folder is "
                                 f"as it was, so {fix}, then export again") from None
    finally:  # a failed write leaves no folder behind
        shutil.rmtree(scratch, ignore_errors=True)


def remove_partial_exports(target):
    """Remove the folders a stopped export into target left beside it, saying so.
    Only those named as write_folder and replace_folder name theirs, of a process no longer running."""
    partial = re.compile(rf"\.{re.escape(target.name)}\.(\d+)\.(tmp|old)")
    for path in sorted(target.parent.iterdir()):
        found = partial.fullmatch(path.name)
        if found and path.is_dir() and not path.is_symlink() and not running(int(found[1])):
            shutil.rmtree(path)
            print(f"removed {path}, the partial folder of an export that was stopped")


def running(pid):
    """Whether a process with this id runs (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        pass
    return True


def replace_folder(new, old):
    """Rename the folder new to old, whose earlier folder (if any) is set aside and then removed."""
    aside = old.with_name(f".{old.name}.{os.getpid()}.old")
    if old.is_dir():
        old.rename(aside)
    try:
        new.rename(old)
    except OSError:
        if aside.is_dir():  # the earlier folder back in its place
            aside.rename(old)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def export_main(argv):
    """A nanoparcae checkpoint -> a folder the authors' from_pretrained reads."""
    parser = command_parser("Write a nanoparcae checkpoint as a folder the authors' parcae_lm.from_pretrained reads")
    parser.prog = "python -m interop.hub export"
    parser.add_argument("source", help="a run under <base dir>/runs (its latest checkpoint), or a checkpoint file's "
                                       "path, which holds a / (./ckpt.pt)")
    parser.add_argument("out_dir", help="the folder to write (upload it with `hf upload`)")
    args = parser.parse_args(argv)
    warnings.formatwarning = lambda message, *_, **__: f"interop.hub export: {message}\n"
    ckpt, tokenizer, path = load_run(ckpt=args.source) if os.sep in args.source else load_run(run=args.source)
    model = from_weights(ckpt["config"], ckpt["model"])
    out = export(model, tokenizer, args.out_dir)
    link = f" (where {args.out_dir} leads)" if Path(args.out_dir).is_symlink() else ""
    print(f"{path} -> {out}{link}: config.json ({model.config.injection}), model.pt, tokenizer.json, "
          f"tokenizer_config.json")


def sample_main(argv):
    """sample.py's sampling, on the authors' release."""
    parser = command_parser("Sample from the authors' release with sample.py's flags")
    parser.prog = "python -m interop.hub sample"
    parser.add_argument("source", help=SOURCE_HELP)
    sample.add_sampling_flags(parser)
    args = sample.parse_sampling_flags(parser, argv)
    model, tokenizer = load_pretrained(args.source, torch.device(args.device), need_tokenizer=True)
    sample.sample(model, tokenizer, args, args.source)


def eval_main(argv):
    """eval_core.py's evaluations, on the authors' release; the results go beside its files."""
    parser = eval_core.eval_parser("Evaluate the authors' release with eval_core.py's flags")
    parser.prog = "python -m interop.hub eval"
    parser.add_argument("source", help=SOURCE_HELP)
    args = parser.parse_args(argv)
    device = eval_core.start_device(args)
    model, tokenizer = load_pretrained(args.source, device, need_tokenizer=True)
    return eval_core.evaluate(args, model, tokenizer, {}, local_dir(args.source) / "authors", device)


def summary_main(argv):
    """Load a release and print its summary and one greedy next token."""
    parser = command_parser("Download and load an authors' Parcae checkpoint and print a summary; the subcommands "
                            "sample, eval and export take their own --help")
    parser.prog = "python -m interop.hub"
    parser.add_argument("source", help=SOURCE_HELP)
    args = parser.parse_args(argv)
    model, tokenizer = load_pretrained(args.source, need_tokenizer=True)
    c = model.config
    print(f"{args.source}: injection={c.injection} layers={c.n_prelude}/{c.n_recur}/{c.n_coda} d={c.d_model} "
          f"mu_rec={c.mu_rec} params={model.num_params():,} vocab={tokenizer.vocab_size} "
          f"rho(Abar)={model.spectral_radius()}")
    ids = tokenizer.encode("The capital of France is", prepend_bos=True)
    allowed = tokenizer.known_ids(c.vocab_size)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), h0_generator=torch.Generator().manual_seed(0))[0, -1]
    logits = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    print("next token after 'The capital of France is':", repr(tokenizer.decode([int(logits.argmax())])))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {"export": export_main, "sample": sample_main, "eval": eval_main}
    if argv[:1] and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return summary_main(argv)


if __name__ == "__main__":
    run_command(main)

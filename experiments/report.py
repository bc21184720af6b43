"""
experiments/report.py: write a run's report card, report.md in its folder, from the run's own files.

    python -m experiments.report --run=d6_diagonal             # <base dir>/runs/d6_diagonal/report.md
    python -m experiments.report --run=d6_diagonal --machine   # first: record this machine for the card

It reads these files of the run:

- metrics.jsonl, and the newest checkpoint's recorded config and flags.
- eval_core.py's JSON beside it, and the figures experiments/plot.py drew there.
- recipe/, where runs/speedrun.sh and runs/cpu.sh keep stage times, the machine and samples.

The run's numbers come from those files or from model.py's formulas.
The paper's numbers and README's are typed in the two tables below.
Each table cites where they are printed.
"""

import os
import platform
import subprocess
from pathlib import Path

import torch

from model import from_weights
from nanoparcae.checkpoint import find_checkpoint, read_checkpoint, run_dir
from nanoparcae.command import EnvironmentFailure, command_parser, run_command
from nanoparcae.files import check_writable, read_json, write_atomically, write_json
from nanoparcae.core_tasks import CORE_LABELS
from nanoparcae.download import PAPER_TOKENS
from nanoparcae.memory import memory_plan
from nanoparcae.metrics import read_metrics
from nanoparcae.results import widest
from optim import optimizer_state_bytes

# The paper's nanochat table (METHOD.md §4), Parcae at T = 8, with the columns val PPL,
# LAMBADA PPL, CORE and Core-Extended.
PAPER = {
    6: {"none": (21.48, 127.39, 13.00, 8.80), "diagonal": (19.06, 80.64, 14.04, 9.67)},
    12: {"none": (15.79, 40.77, 17.46, 11.71), "diagonal": (14.49, 32.74, 20.00, 12.75)},
    18: {"none": (13.08, 22.37, 22.42, 14.20), "diagonal": (12.49, 19.71, 25.07, 15.19)},
    24: {"none": (11.95, 17.26, 25.45, 15.90), "diagonal": (11.42, 14.71, 28.44, 17.08)},
}
# README's "What to expect" gives runs/cpu.sh's run and its last val loss at each T.
# It was measured on a 2-core AMD EPYC.
CPU_README = {"run": {"depth": 3, "d_model": 128, "mu_rec": 4, "data": "stdlib", "max_tokens": 3.2e6},
              "val_loss": {1: 3.7575, 2: 3.7170, 4: 3.7109}}
ROOT = Path(__file__).resolve().parent.parent


# -----------------------------------------------------------------------------
# The machine, recorded by the recipe before it trains


def cpu_name():
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def git_commit():
    """This checkout's commit, marked +changes when tracked files differ; None outside git."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+changes" if dirty else "") if commit else None


def this_machine():
    """Describe this machine -> a dict of GPUs, CPU, torch, CUDA and the git commit."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpus": gpus, "cpu": cpu_name(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "commit": git_commit(),
            "processes": int(os.environ.get("NPROC", 0)) or max(1, len(gpus))}


def record_machine(run_dir, gpu=False):
    """Write this machine to the run's recipe/machine.json -> its path.
    With gpu it refuses a torch that sees no GPU, which would train on the CPU."""
    if gpu and not torch.cuda.is_available():
        raise EnvironmentFailure(f"torch {torch.__version__} sees no GPU: it is the CPU build, or the driver is "
                                 f"too old; remove .venv and run again for PyPI's CUDA build (TORCH_INDEX=URL "
                                 f"for another)")
    path = run_dir / "recipe" / "machine.json"
    check_writable(path.parent, path.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, this_machine())
    return path

# -----------------------------------------------------------------------------
# The run's files, read once


def read_run(run_dir):
    """Read everything the card shows from run_dir -> a dict.
    A missing file reads as None."""
    checkpoint = find_checkpoint(run_dir.parent, run_dir.name)
    ckpt = read_checkpoint(checkpoint, mmap=True, unused=("model", "optimizer", "loader"))  # reads no tensor
    model = from_weights(ckpt["config"], ckpt["model"])  # for its counts; the mapped weights are never read
    stages = read_metrics(run_dir / "recipe" / "stages.jsonl", key="stage")
    samples = {int(path.stem.split("_T")[1]): path.read_text()
               for path in sorted((run_dir / "recipe").glob("samples_T*.txt"))}
    bpb_path = widest(run_dir, f"{checkpoint.stem}_bpb_T*.json")
    return {"dir": run_dir, "checkpoint": checkpoint, "config": ckpt["config"], "args": ckpt.get("args", {}),
            "flags": ckpt.get("run", {}), "step": ckpt["step"], "skipped": ckpt.get("skipped_steps", 0),
            "model": model, "metrics": read_metrics(run_dir / "metrics.jsonl"), "stages": stages,
            "machine": read_json(run_dir / "recipe" / "machine.json"), "samples": samples,
            "bpb": read_json(bpb_path), "lt_png": bpb_path and bpb_path.with_suffix(".png"),
            "ppl": read_json(widest(run_dir, f"{checkpoint.stem}_ppl_T*.json")),
            "core": read_json(widest(run_dir, f"{checkpoint.stem}_core_T*.json"))}

# -----------------------------------------------------------------------------
# The card's sections, each a list of markdown lines


def number(value, form="{:.4f}"):
    return "-" if value is None else form.format(value)


def machine_section(run):
    machine, note = run["machine"], ""
    if machine is None:
        machine, note = this_machine(), " (the run recorded none: this is the machine that wrote the card)"
    gpus = machine["gpus"]
    device = f"{len(gpus)} x {gpus[0]}" if gpus else f"CPU: {machine['cpu']}, {machine['cpu_count']} cores"
    return ["## Machine", "",
            f"- device: {device}; {machine['processes']} process(es){note}",
            f"- torch {machine['torch']}" + (f", CUDA {machine['cuda']}" if machine["cuda"] else ""),
            f"- commit: {machine['commit'] or 'not a git checkout'}", ""]


def run_section(run):
    model, args, steps = run["model"], run["args"], [r for r in run["metrics"] if "loss" in r]
    tokens = run["step"] * args["total_batch_size"]
    planned = max(1, int(run["flags"].get("max_tokens", tokens) // args["total_batch_size"])) \
        * args["total_batch_size"]
    flags = " ".join(f"--{key}={value}" for key, value in run["flags"].items()
                     if key != "train_shards" and value is not None)
    return ["## Run", "",
            f"- `{run['dir'].name}`, checkpoint `{run['checkpoint'].name}`, step {run['step']} "
            f"of {planned // args['total_batch_size']}",
            f"- run flags: `{flags}`",
            f"- parameters: {model.num_params():,}",
            f"- tokens: {tokens:,} trained of {planned:,} planned",
            f"- FLOPs (the paper's C, METHOD.md §2): {model.paper_flops_per_token():.4e} a token, "
            f"{model.paper_flops_per_token() * tokens:.4e} trained",
            f"- executed matmul FLOPs (MFU's): {model.matmul_flops_per_token():.4e} a token, "
            f"{model.matmul_flops_per_token() * tokens:.4e} trained",
            f"- last train loss: {number(steps[-1]['loss'] if steps else None)}", ""]


def stage_attempts(run, name):
    """Sum up a recipe stage's records in stages.jsonl -> a tuple of five.
    They are attempts, seconds of those that ended, interrupted, skips and the result.
    The result is "done", "exit status N", "interrupted", or "running" for the stage writing this card."""
    records = [r for r in run["stages"] if r["stage"] == name]
    started = [r for r in records if "started" in r]
    ended = [r for r in records if "seconds" in r]
    running = bool(started) and started[-1] is run["stages"][-1]  # the last line of all is still going
    last = next((r for r in reversed(records) if "started" in r or "seconds" in r), {})
    result = "running" if running else "interrupted" if "started" in last else \
        "done" if last.get("status") == 0 else f"exit status {last['status']}" if last else "-"
    return (len(started), sum(r["seconds"] for r in ended), len(started) - len(ended) - running,
            sum(bool(r.get("skipped")) for r in records), result)


def how_it_ran_section(run):
    model, args, metrics = run["model"], run["args"], run["metrics"]
    steps = [r for r in metrics if "loss" in r]
    attempts, train_s, interrupted, _, _ = stage_attempts(run, "train")
    tokens = run["step"] * args["total_batch_size"]
    last = next((r for r in reversed(steps) if r.get("tokens_per_s")), {})
    lines = ["## How it ran", ""]
    lines.append("- training's wall time: " + (
        f"{train_s / 60:.1f} min over {attempts} attempt(s)"
        + (f" ({interrupted} interrupted, whose time is not recorded)" if interrupted else "")
        + f", {tokens / train_s:,.0f} tokens/s on average (start-up, evals and restarts included)"
        if train_s else "not recorded (no recipe/stages.jsonl)"))
    lines.append(f"- tokens/s at the last logged step: {number(last.get('tokens_per_s'), '{:,.0f}')}"
                 + (f", MFU {last['mfu']:.1%}" if last.get("mfu") else
                    " (no MFU: a CPU, or a GPU whose peak nanoparcae/ranks.py does not list)"))
    peaks = [r["peak_memory"] for r in steps if r.get("peak_memory")]
    if peaks:
        bf16 = args.get("dtype", "bfloat16") == "bfloat16"
        optimizer = optimizer_state_bytes(model, muon=args.get("optimizer", "muon") == "muon")
        plan = memory_plan(model, run["flags"]["device_batch_size"], bf16, optimizer,
                           compiled=bool(args.get("compile", 1)))["total"]
        lines.append(f"- peak memory per GPU: {max(peaks) / 1e9:.1f} GB measured, {plan / 1e9:.1f} GB planned "
                     f"({max(peaks) / plan:.0%} of the plan)")
    else:
        lines.append("- peak memory: not measured (CPU run)")
    lines.append(f"- skipped steps (non-finite gradients): {run['skipped']}")
    events = [r for r in metrics if "warning" in r or "diverged_at" in r]
    lines.append("- divergence events: " + ("none" if not events else "; ".join(
        f"step {r['step']}: " + (f"diverged at {r['diverged_at']} ({r['reason']})" if "diverged_at" in r
                                 else f"warning, {r['warning']} {r.get('h_norm', 0):.3g} > {r.get('limit', 0):g}")
        for r in events)))
    if run["stages"]:
        lines += ["", "| recipe stage | attempts | seconds | result |", "|---|---|---|---|"]
        for name in dict.fromkeys(stage["stage"] for stage in run["stages"]):
            attempts, seconds, interrupted, skips, result = stage_attempts(run, name)
            lines.append(f"| {name} | {attempts} | {seconds:.0f} | {result}"
                         + (f"; skipped on {skips} later run(s)" if skips else "") + " |")
        total = sum(r["seconds"] for r in run["stages"] if "seconds" in r)
        lines.append(f"| all | | {total:.0f} ({total / 3600:.2f} h) | |")
    return lines + [""]


def figures_section(run):
    lines = ["## Figures", ""]
    for title, path in (("loss curve", run["dir"] / "loss.png"), ("L(T) and its fitted law", run["lt_png"])):
        if path == run["lt_png"] and run["bpb"] and "fit" not in run["bpb"]:
            lines.append(f"- {title}: no fit, the loss was evaluated at fewer than 3 depths")
        elif path and path.is_file():
            lines.append(f"![{title}]({path.name})")
        else:
            lines.append(f"- {title}: not drawn (runs/speedrun.sh's figures stage draws it)")
    return lines + [""]


def loss_section(run):
    """Show val loss and bpb at each T (eval_core.py --eval bpb), the val PPL (--eval ppl) and the fit."""
    lines = ["## Validation", ""]
    evals = [r for r in run["metrics"] if any(key.startswith("val_loss_T") for key in r)]
    if evals:
        last = evals[-1]
        depths = sorted(int(key[len("val_loss_T"):]) for key in last if key.startswith("val_loss_T"))
        lines.append(f"Training's last eval (step {last['step']}): " + ", ".join(
            f"T = {T}: loss {last[f'val_loss_T{T}']:.4f}, bpb {last[f'val_bpb_T{T}']:.4f}" for T in depths) + ".")
        lines.append("")
    bpb, ppl = run["bpb"], run["ppl"]
    if bpb:
        ppls = dict(zip(ppl["T"], ppl["ppl"])) if ppl else {}
        lines += [f"eval_core.py on {bpb['data']} ({bpb['args']['val_tokens']:,} tokens of packed rows; val PPL: "
                  + (f"the first {ppl['args']['max_docs']:,} documents, one per forward" if ppl else "not run") + "):",
                  "", "| T | val loss | bpb | val PPL |", "|---|---|---|---|"]
        for T, loss, bits in zip(bpb["T"], bpb["loss"], bpb["bpb"]):
            lines.append(f"| {T} | {loss:.4f} | {bits:.4f} | {number(ppls.get(T), '{:.2f}')} |")
        if fit := bpb.get("fit"):
            lines += ["", f"L(T) = L_inf + Z exp(-z T): L_inf {fit['L_inf']:.4f}, Z {fit['Z']:.4f}, "
                      f"z {fit['z']:.4f}, RMS error {fit['rms']:.2e}; L_inf against the loss at T = mu_rec = "
                      f"{fit['mu_rec']}: {100 * (fit['L_inf'] - fit['loss_at_mu_rec']) / fit['loss_at_mu_rec']:+.2f}%"
                      + ("; the fit ends at the edge of its search for z: L_inf is no limit the losses show"
                         if fit.get("at_edge") else "")]
    else:
        lines.append("eval_core.py --eval bpb: not run.")
    return lines + [""]


def core_section(run):
    core = run["core"]
    if not core:
        return ["## CORE and Core-Extended", "", "Not run (`python eval_core.py --tasks extended` scores them).", ""]
    first = core["runs"][0]
    lines = ["## CORE and Core-Extended", "",
             f"At T = {first['T']}, few-shot seed {first['seed']}, "
             + ("every item" if first["max_per_task"] == -1 else f"{first['max_per_task']} items a task")
             + f": CORE {number(first['core'])}, Core-Extended {number(first['core_extended'])}"
             + (f"; {len(first['skipped'])} task(s) skipped ("
                + (", ".join(sorted(first["skipped"])) if len(first["skipped"]) <= 5 else "the JSON names them")
                + ", and why)" if first["skipped"] else "") + ".", "",
             "| task | set | accuracy | centered |", "|---|---|---|---|"]
    for label, accuracy in first["accuracy"].items():
        lines.append(f"| {label} | {'CORE' if label in CORE_LABELS else 'extended'} | {accuracy:.4f} | "
                     f"{first['centered'][label]:+.4f} |")
    return lines + [""]


def comparison_section(run):
    """Set the paper's numbers beside the run's at its sizes, or README's beside runs/cpu.sh's run."""
    flags, config, args = run["flags"], run["config"], run["args"]
    depth, injection = args.get("depth"), config["injection"]
    if depth in PAPER and injection in PAPER[depth]:
        paper = PAPER[depth][injection]
        ppl, core = run["ppl"], run["core"]
        T = 1 if injection == "none" else config["mu_rec"]
        ours_ppl = dict(zip(ppl["T"], ppl["ppl"])).get(T) if ppl else None
        first = core["runs"][0] if core else {}
        ours = [ours_ppl, first.get("core") and 100 * first["core"],
                first.get("core_extended") and 100 * first["core_extended"]]
        same = flags.get("max_tokens") == PAPER_TOKENS[depth] and args.get("data") == "fineweb-edu"
        lines = ["## Against the paper", "",
                 f"METHOD.md §4, {'the Transformer' if injection == 'none' else 'Parcae'} at depth {depth} "
                 f"(val PPL at T = {T}; CORE and Core-Extended x 100)"
                 + ("" if same else "; this run is not the paper's horizon on FineWeb-Edu, so not comparable")
                 + ":", "", "| number | paper | this run | difference |", "|---|---|---|---|"]
        for name, theirs, mine in zip(("val PPL", "CORE", "Core-Extended"), paper[:1] + paper[2:], ours):
            lines.append(f"| {name} | {theirs:.2f} | {number(mine, '{:.2f}')} | "
                         f"{number(None if mine is None else mine - theirs, '{:+.2f}')} |")
        return lines + [""]
    reference = CPU_README["run"]
    if all(args.get(key) == value for key, value in reference.items()):
        evals = [r for r in run["metrics"] if "val_loss_T1" in r]
        last = evals[-1] if evals else {}
        lines = ["## Against README", "",
                 "README's runs/cpu.sh numbers (the last eval, a 2-core AMD EPYC; another CPU moves the third "
                 "decimal):", "", "| T | README | this run | difference |", "|---|---|---|---|"]
        for T, theirs in CPU_README["val_loss"].items():
            mine = last.get(f"val_loss_T{T}")
            lines.append(f"| {T} | {theirs:.4f} | {number(mine)} | "
                         f"{number(None if mine is None else mine - theirs, '{:+.4f}')} |")
        return lines + [""]
    return []


def samples_section(run):
    lines = ["## Samples", ""]
    if not run["samples"]:
        return lines + ["Not drawn (`python sample.py --run=NAME` draws them).", ""]
    for T, text in sorted(run["samples"].items()):
        lines += [f"At T = {T}:", "", "```", text.rstrip(), "```", ""]
    return lines


def write_card(run_dir):
    """Write report.md in run_dir -> its path."""
    run = read_run(run_dir)
    card = [f"# Report card: {run_dir.name}", ""]
    for section in (machine_section, run_section, how_it_ran_section, comparison_section, loss_section,
                    core_section, figures_section, samples_section):
        card += section(run)
    path = run_dir / "report.md"
    write_atomically(path, lambda partial: partial.write_text("\n".join(card).rstrip() + "\n"))
    return path


def main(argv=None):
    parser = command_parser(__doc__)
    parser.add_argument("--run", required=True, help="a run under <base dir>/runs")
    parser.add_argument("--machine", action="store_true", help="record this machine in recipe/machine.json")
    parser.add_argument("--gpu", action="store_true", help="with --machine: refuse a torch that sees no GPU")
    args = parser.parse_args(argv)
    folder = run_dir(args.run)
    if args.machine:
        print(f"recorded the machine in {record_machine(folder, args.gpu)}")
    else:
        print(f"wrote {write_card(folder)}")


if __name__ == "__main__":
    run_command(main)

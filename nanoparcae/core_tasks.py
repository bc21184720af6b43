"""
nanoparcae/core_tasks.py: CORE's tasks (METHOD.md §3), up to where a model scores them.
It holds the task table (CORE's 22, Core-Extended's 46) and reads each task from DCLM's eval bundle.
It renders each item into token rows, whose scored span decides it.

    tasks = select_tasks("core")
    bundle_dir = download_eval_bundle()                 # $NANOPARCAE_BASE_DIR/eval_bundle, on first use
    data = load_task_data(bundle_dir, tasks[0], max_per_task=100)
    rows = build_rows(tasks[0], data, range(len(data)), tokenizer, seed=1234, max_len=2048)

    python -m nanoparcae.core_tasks [--url=URL]          # the eval bundle's download alone
"""

import csv
import json
import random
from pathlib import Path
from typing import NamedTuple

from nanoparcae.command import comma_list, command_parser, run_command
from nanoparcae.download import EVAL_BUNDLE_URL, download_eval_bundle

# -----------------------------------------------------------------------------
# The task table (METHOD.md §3; files, shots and delimiters as in DCLM's heavy.yaml and nanochat's core.yaml)

MC, SCHEMA, LM = "multiple_choice", "schema", "language_modeling"
ANSWER = "\nAnswer: "


class Task(NamedTuple):
    label: str
    path: str  # inside the bundle's eval_data/
    kind: str  # MC, SCHEMA or LM
    shots: int
    delimiter: str


CORE_TASKS = [
    Task("hellaswag_zeroshot", "language_understanding/hellaswag.jsonl", MC, 0, " "),
    Task("jeopardy", "world_knowledge/jeopardy_all.jsonl", LM, 10, ANSWER),
    Task("bigbench_qa_wikidata", "world_knowledge/bigbench_qa_wikidata.jsonl", LM, 10, " "),
    Task("arc_easy", "world_knowledge/arc_easy.jsonl", MC, 10, ANSWER),
    Task("arc_challenge", "world_knowledge/arc_challenge.jsonl", MC, 10, ANSWER),
    Task("copa", "commonsense_reasoning/copa.jsonl", MC, 0, " "),
    Task("commonsense_qa", "commonsense_reasoning/commonsense_qa.jsonl", MC, 10, " "),
    Task("piqa", "commonsense_reasoning/piqa.jsonl", MC, 10, ANSWER),
    Task("openbook_qa", "commonsense_reasoning/openbook_qa.jsonl", MC, 0, " "),
    Task("lambada_openai", "language_understanding/lambada_openai.jsonl", LM, 0, " "),
    Task("hellaswag", "language_understanding/hellaswag.jsonl", MC, 10, " "),
    Task("winograd", "language_understanding/winograd_wsc.jsonl", SCHEMA, 0, " "),
    Task("winogrande", "language_understanding/winogrande.jsonl", SCHEMA, 0, " "),
    Task("bigbench_dyck_languages", "symbolic_problem_solving/bigbench_dyck_languages.jsonl", LM, 10, " "),
    Task("agi_eval_lsat_ar", "symbolic_problem_solving/agi_eval_lsat_ar.jsonl", MC, 3, " "),
    Task("bigbench_cs_algorithms", "symbolic_problem_solving/bigbench_cs_algorithms.jsonl", LM, 10, " "),
    Task("bigbench_operators", "symbolic_problem_solving/bigbench_operators.jsonl", LM, 10, " "),
    Task("bigbench_repeat_copy_logic", "symbolic_problem_solving/bigbench_repeat_copy_logic.jsonl", LM, 10, " "),
    Task("squad", "reading_comprehension/squad.jsonl", LM, 10, " "),
    Task("coqa", "reading_comprehension/coqa.jsonl", LM, 0, " "),
    Task("boolq", "reading_comprehension/boolq.jsonl", MC, 10, ANSWER),
    Task("bigbench_language_identification", "language_understanding/bigbench_language_identification.jsonl", MC, 10,
         " "),
]

# Core-Extended adds DCLM's 24 other scoreable extended tasks, heavy.yaml without GPQA and generative QA.
# DCLM averages mmlu and bbq over categories (has_categories). Like nanochat's jeopardy, each file is one pool.
EXTENDED_EXTRA_TASKS = [
    Task("mmlu_zeroshot", "world_knowledge/mmlu.jsonl", MC, 0, "Answer: "),  # sic, DCLM's delimiter has no newline
    Task("mmlu_fewshot", "world_knowledge/mmlu.jsonl", MC, 5, ANSWER),
    Task("bigbench_misconceptions", "world_knowledge/bigbench_misconceptions.jsonl", MC, 10, " "),
    Task("siqa", "commonsense_reasoning/siqa.jsonl", MC, 10, " "),
    Task("bigbench_novel_concepts", "commonsense_reasoning/bigbench_novel_concepts.jsonl", MC, 10, " "),
    Task("bigbench_strange_stories", "commonsense_reasoning/bigbench_strange_stories.jsonl", MC, 10, " "),
    Task("bigbench_strategy_qa", "commonsense_reasoning/bigbench_strategy_qa.jsonl", MC, 10, " "),
    Task("bigbench_conlang_translation", "language_understanding/bigbench_conlang_translation.jsonl", LM, 0, " "),
    Task("bigbench_conceptual_combinations", "language_understanding/bigbench_conceptual_combinations.jsonl", MC, 10,
         " "),
    Task("bigbench_elementary_math_qa", "symbolic_problem_solving/bigbench_elementary_math_qa.jsonl", MC, 10, " "),
    Task("bigbench_logical_deduction", "symbolic_problem_solving/bigbench_logical_deduction.jsonl", MC, 10, " "),
    Task("simple_arithmetic_nospaces", "symbolic_problem_solving/simple_arithmetic_nospaces.jsonl", LM, 10, " "),
    Task("simple_arithmetic_withspaces", "symbolic_problem_solving/simple_arithmetic_withspaces.jsonl", LM, 10, " "),
    Task("math_qa", "symbolic_problem_solving/math_qa.jsonl", MC, 10, " "),
    Task("logi_qa", "symbolic_problem_solving/logi_qa.jsonl", MC, 10, ANSWER),
    Task("pubmed_qa_labeled", "reading_comprehension/pubmed_qa_labeled.jsonl", LM, 10, " "),
    Task("agi_eval_lsat_rc", "reading_comprehension/agi_eval_lsat_rc.jsonl", MC, 3, " "),
    Task("agi_eval_lsat_lr", "reading_comprehension/agi_eval_lsat_lr.jsonl", MC, 3, " "),
    Task("agi_eval_sat_en", "reading_comprehension/agi_eval_sat_en.jsonl", MC, 3, " "),
    Task("bigbench_understanding_fables", "reading_comprehension/bigbench_understanding_fables.jsonl", MC, 10, " "),
    Task("winogender_mc_female", "safety/winogender_mc_female.jsonl", MC, 10, " "),
    Task("winogender_mc_male", "safety/winogender_mc_male.jsonl", MC, 10, " "),
    Task("enterprise_pii_classification", "safety/enterprise_pii_classification.jsonl", MC, 10, " "),
    Task("bbq", "safety/bbq.jsonl", MC, 3, " "),
]
EXTENDED_TASKS = CORE_TASKS + EXTENDED_EXTRA_TASKS
CORE_LABELS = {task.label for task in CORE_TASKS}


def select_tasks(tasks):
    """"core" (22), "extended" (46), or labels separated by commas."""
    if tasks in ("core", "extended"):
        return CORE_TASKS if tasks == "core" else EXTENDED_TASKS
    by_label = {task.label: task for task in EXTENDED_TASKS}
    labels = [label.strip() for label in comma_list(tasks, str)]
    if unknown := [label for label in labels if label not in by_label]:
        raise ValueError(f"unknown task(s) {unknown}: use --tasks core, extended, or labels from "
                         f"{', '.join(by_label)}")
    return [by_label[label] for label in labels]

# -----------------------------------------------------------------------------
# Each task's items, read from the bundle

def read_random_baselines(bundle_dir):
    """Read each task's random baseline in percent (DCLM's v1 values, METHOD.md §3) from eval_meta_data.csv."""
    with open(Path(bundle_dir) / "eval_meta_data.csv", newline="", encoding="utf-8") as f:
        return {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}


def load_task_data(bundle_dir, task, max_per_task):
    """The task's records shuffled with Random(1337) as nanochat does, so a cut to max_per_task (if > 0) is fair."""
    with open(Path(bundle_dir) / "eval_data" / task.path, encoding="utf-8") as f:
        data = [json.loads(line) for line in f if line.strip()]
    random.Random(1337).shuffle(data)
    return data[:max_per_task] if max_per_task > 0 else data

# -----------------------------------------------------------------------------
# Prompts: nanochat's templates, tokens with BOS, the scored span, left cropping

def render_prompts(task, item, fewshot):
    """Prompt texts for one item, one per MC choice or schema context option; for LM the prompt without and
    with the continuation. Each few-shot block is its solved example followed by a blank line."""
    d = task.delimiter
    if task.kind == MC:
        shots = "".join(f"{ex['query']}{d}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
        return [f"{shots}{item['query']}{d}{choice}" for choice in item["choices"]]
    if task.kind == SCHEMA:
        shots = "".join(f"{ex['context_options'][ex['gold']]}{d}{ex['continuation']}\n\n" for ex in fewshot)
        return [f"{shots}{option}{d}{item['continuation']}" for option in item["context_options"]]
    shots = "".join(f"{ex['context'].strip()}{d}{ex['continuation']}\n\n" for ex in fewshot)
    prompt = f"{shots}{item['context'].strip()}{d}"
    # The prompt alone is stripped, so its tokens prefix the full text's (a trailing " " would join the next token).
    return [prompt.strip(), prompt + item["continuation"]]


def common_length(sequences, from_end=False):
    """Length of the longest prefix (or suffix) that all the sequences share."""
    shortest = min(len(s) for s in sequences)
    for i in range(shortest):
        at = -1 - i if from_end else i
        if any(s[at] != sequences[0][at] for s in sequences):
            return i
    return shortest


def scored_spans(task, tokens):
    """Return the sequences to score, and the (start, end) of each one's tokens that decide the item."""
    if task.kind == MC:  # the choices follow a shared context, so score what comes after the common prefix
        start = common_length(tokens)
        return tokens, [(start, len(t)) for t in tokens]
    if task.kind == SCHEMA:  # the contexts differ and share the continuation, so score the common suffix
        n = common_length(tokens, from_end=True)
        return tokens, [(len(t) - n, len(t)) for t in tokens]
    # An LM item scores only the full text, after the two texts' common prefix (the prompt, as nanochat asserts).
    full = tokens[1]
    return [full], [(common_length(tokens), len(full))]


def crop_left(tokens, start, end, max_len):
    """Keep the last max_len tokens, shifting the span with them. METHOD.md §3 crops from the left.
    The span keeps at least one token. It never starts at position 0, which nothing predicts."""
    cut = max(0, len(tokens) - max_len)
    return tokens[cut:], max(1, min(start - cut, end - cut - 1)), end - cut


class Row(NamedTuple):
    tokens: list
    start: int  # scored tokens are tokens[start:end]
    end: int
    example: int  # index of the item in the task's data


def build_rows(task, data, indices, tokenizer, seed, max_len):
    """Every sequence to score for the items at `indices`. Few-shot examples are drawn as nanochat draws them,
    Random(seed + idx).sample(every other index, shots); a task with fewer items than shots uses all the others."""
    shots = min(task.shots, len(data) - 1)
    prompts, owners = [], []  # owners hold (item index, how many prompts it has)
    for idx in indices:  # sample range(n - 1) and skip idx, rather than build every other index
        picks = random.Random(seed + idx).sample(range(len(data) - 1), shots)
        texts = render_prompts(task, data[idx], [data[j + (j >= idx)] for j in picks])
        prompts += texts
        owners.append((idx, len(texts)))
    tokens = tokenizer.encode(prompts, prepend_bos=True) if prompts else []  # BOS starts every prompt (METHOD.md §3)
    rows, offset = [], 0
    for idx, n in owners:
        sequences, spans = scored_spans(task, tokens[offset:offset + n])
        rows += [Row(*crop_left(seq, start, end, max_len), idx) for seq, (start, end) in zip(sequences, spans)]
        offset += n
    return rows


def main(argv=None):
    parser = command_parser("Download CORE's eval bundle under the base folder, once.")
    parser.add_argument("--url", default=EVAL_BUNDLE_URL, help="the bundle's zip (default: nanochat's host)")
    args = parser.parse_args(argv)
    print(f"the eval bundle: {download_eval_bundle(args.url)}")


if __name__ == "__main__":
    run_command(main)

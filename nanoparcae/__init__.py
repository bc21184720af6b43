"""
nanoparcae: what the root's files lean on that is not the method.
A package beside them, as nanochat keeps its own.

    common.py       what every command shares: processes, the base folder, one-line errors, atomic writes
    flags.py        the checked flag types of the commands' parsers
    memory.py       the device batch: the memory plan per GPU and the batch it picks
    dataset.py      the text and the data check: FineWeb-Edu shards, the sources, each source's tokenizer
    tokenizer.py    byte-level BPE, trained with rustbpe, run with tiktoken
    prepare.py      train.py's set-up before its first step, in one call
    run.py          the run's identity and its lock
    ranks.py        ranks that agree on their checkpoint and weights
    checkpoint.py   checkpoint files written, found and read back checked; load_run loads a trained run
    metrics.py      metrics.jsonl, read and written, and the step's log line
    divergence.py   the rule that stops a diverged run
    download.py     one resumable, retried HTTP download
    core_tasks.py   CORE's task table and eval bundle, items rendered into scored token rows
    report.py       a run's report card, report.md, read from the run's own files

    python -m nanoparcae.dataset download -n 240    # its one command: the FineWeb-Edu shards
"""

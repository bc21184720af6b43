"""
nanoparcae: what the root's files lean on that is not the method.
A package beside them, as nanochat keeps its own.

    command.py      a command's flags and its one way to fail, in one line
    files.py        the base folder, its writes checked first and never torn, and JSON read back
    memory.py       the device batch: the memory plan per GPU and the batch it picks
    dataset.py      a data source's text: its documents in chunks, its cached tokenizer, its size against a run
    fineweb.py      FineWeb-Edu's shards, fetched and counted
    tokenizer.py    byte-level BPE, trained with rustbpe, run with tiktoken
    prepare.py      train.py's set-up before its first step, in one call
    run.py          the run's identity and its lock
    ranks.py        the processes torchrun starts, and ranks that agree through one gather
    checkpoint.py   checkpoint files written, found and read back checked; load_run loads a trained run
    metrics.py      metrics.jsonl, read and written, and the step's log line
    divergence.py   the rule that stops a diverged run
    download.py     files fetched over HTTP: one resumable download, and CORE's eval bundle on every rank
    core_tasks.py   CORE's task table, its items read from the bundle and rendered into scored token rows
    report.py       a run's report card, report.md, read from the run's own files

    python -m nanoparcae.dataset download -n 240    # its one command: the FineWeb-Edu shards
"""

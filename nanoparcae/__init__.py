"""
What the root's files lean on that is not the method, as nanochat keeps its own; it imports no root file.

    command.py      a command's flags and its one way to fail, in one line
    files.py        the base folder, its writes checked first and never torn, and JSON read back
    ranks.py        the processes torchrun starts, and ranks that agree through one gather
    run.py          the run's name and folder, its identity against its checkpoint, and its lock
    checkpoint.py   checkpoint files saved, found, loaded and verified
    dataset.py      every data source's text, FineWeb-Edu's shards included, and the run's horizon checked
    tokenizer.py    byte-level BPE, trained with rustbpe, run with tiktoken, and its cache
    download.py     files fetched over HTTP, FineWeb-Edu's shards and CORE's eval bundle among them
    memory.py       the device batch, picked from the memory plan per GPU
    metrics.py      metrics.jsonl, read and written, and the step's log line
    divergence.py   the rule that stops a diverged run
    results.py      where an evaluation's results are kept, and which one is read back
    core_tasks.py   CORE's task table, its items read from the bundle and rendered into scored token rows
"""

"""
nanoparcae: what the root's files lean on that is not the method, kept in a package beside them as
nanochat keeps its own.

    run.py          train.py's bookkeeping: the device batch, the run's identity, the lock, save and prune
    common.py       processes and devices, the base folder, atomic writes, one-line errors, GPU peaks
    checkpoint.py   checkpoints written and read; load_run rebuilds a trained model and its tokenizer
    ranks.py        one trainer per run (the lock); ranks that agree on their checkpoint and weights
    divergence.py   the rule that stops a diverged run
    memory.py       the memory plan that picks a GPU's device batch
    dataset.py      the text: FineWeb-Edu shards, the three kinds of source, each source's tokenizer
    tokenizer.py    byte-level BPE, trained with rustbpe, run with tiktoken
    download.py     one resumable, retried HTTP download
    core_tasks.py   CORE's task table and eval bundle, items rendered into scored token rows

    python -m nanoparcae.dataset download -n 240    # its one command: the FineWeb-Edu shards
"""

"""
scoring.py: token rows scored by a model, many per forward (METHOD.md §3): rows grouped by length and padded on
the right, one seeded draw of the initial state h0 shared by every row, and each row's mean cross-entropy over its
scored span. eval_core.py scores CORE's rows with it and harness.py the lm-evaluation-harness's requests.

    h0_table = initial_state_table(model, model.config.seq_len, seed=1234, device=device)
    losses, exact = score_rows(model, rows, T=8, h0_table=h0_table)   # rows: core_tasks.Row
"""

from collections import defaultdict

import torch
import torch.nn.functional as F


def bf16_autocast(device):
    """bf16 autocast on CUDA, as in training; on a CPU only inside a caller's own CPU autocast (train.py
    --dtype=bfloat16), which an inner disabled autocast would otherwise switch off."""
    return torch.autocast(device.type, torch.bfloat16,
                          enabled=device.type == "cuda" or torch.is_autocast_enabled(device.type))


def initial_state_table(model, length, seed, device):
    """One draw of the Parcae initial state h0 for positions 0..length-1, shared by every sequence of an evaluation.
    METHOD.md §1 draws h0 afresh per forward; drawing it once per evaluation (seeded) keeps the distribution and makes
    every sequence's score independent of what else is in its batch and of the number of ranks."""
    generator = torch.Generator().manual_seed(seed)
    return model.initial_state((1, length, model.config.d_model), "cpu", torch.float32, generator).to(device)


def forward_batches(rows, batch_tokens, one_per_forward):
    """Lists of row indices, one list per forward. Batched: longest first, as many rows as fit batch_tokens
    (rows x width). one_per_forward: one item's sequences per forward, the way nanochat runs."""
    if one_per_forward:
        by_example = defaultdict(list)
        for i, row in enumerate(rows):
            by_example[row.example].append(i)
        return list(by_example.values())
    batches, batch = [], []
    for i in sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens)):
        if batch and (len(batch) + 1) * len(rows[batch[0]].tokens) > batch_tokens:  # batch[0] sets the width
            batches.append(batch)
            batch = []
        batch.append(i)
    return batches + [batch] if batch else batches


@torch.no_grad()
def score_rows(model, rows, T, h0_table, batch_tokens=1024, one_per_forward=False):
    """-> (mean cross-entropy over each row's span, whether greedy argmax reproduces the span), per row."""
    device = h0_table.device
    losses, exact = [0.0] * len(rows), [False] * len(rows)
    for batch in forward_batches(rows, batch_tokens, one_per_forward):
        width = max(len(rows[i].tokens) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # pad id 0: causal attention never looks right
        for j, i in enumerate(batch):
            ids[j, :len(rows[i].tokens)] = torch.tensor(rows[i].tokens)
        ids = ids.to(device)
        with bf16_autocast(device):
            logits = model(ids, T=T, h0=h0_table[:, :width].expand(len(batch), -1, -1))
        batch_losses, batch_exact = [], []
        for j, i in enumerate(batch):
            row = rows[i]
            predicted, targets = logits[j, row.start - 1:row.end - 1], ids[j, row.start:row.end]
            batch_losses.append(F.cross_entropy(predicted, targets))
            batch_exact.append((predicted.argmax(-1) == targets).all())
        for i, loss, hit in zip(batch, torch.stack(batch_losses).tolist(), torch.stack(batch_exact).tolist()):
            losses[i], exact[i] = loss, hit
    return losses, exact

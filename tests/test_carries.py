"""conftest.carries, which the message tests use: it finds each word whole and in order, so that a test of a
message fails when a flag, value or path is missing or swapped, and not when the sentence around them changes.

Run: python -m pytest -q tests/test_carries.py"""

from conftest import carries

MESSAGE = ("error: run halves (/tmp/base/runs/halves/ckpt_000002.pt) was started with other flags: d_model 64 there, "
           "96 here; adamw_lr 3.0 there, 0.008 here; --run=NAME to start another")


def test_carries_finds_flags_values_and_paths_whole_and_in_order():
    assert carries(MESSAGE, "halves", "/tmp/base/runs/halves/ckpt_000002.pt", "d_model", "64", "96")
    assert carries(MESSAGE, "adamw_lr", "3.0", "0.008") and carries(MESSAGE, "--run")
    assert carries("d_model: 96 now, 64 in the checkpoint", "d_model", "96", "64")  # other words, same content
    assert not carries(MESSAGE, "d_model", "96", "64")  # swapped
    assert not carries(MESSAGE, "d_model", "6")  # not inside 64
    assert not carries(MESSAGE, "adamw_lr", "3")  # not the 3 of 3.0
    assert not carries(MESSAGE, "--run_path") and not carries(MESSAGE, "mu_rec")  # absent
    assert not carries(MESSAGE, "ckpt_000002")  # not a prefix of a longer name

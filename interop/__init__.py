"""nanoparcae and other people's tools: the authors' released checkpoints and their format (hub.py), and the
lm-evaluation-harness (harness.py). Each runs from the repository's root as `python -m interop.NAME`; they import
the root's modules, never the other way round."""

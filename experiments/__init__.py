"""The paper's experiments on this code: the evidence suite, the isoFLOP scaling study and its fits, the figures,
the benchmarks and the GPU check's table. Each runs from the repository's root as `python -m experiments.NAME`;
they import the root's modules, never the other way round."""

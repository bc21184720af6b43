"""The paper's experiments on this code, with the evidence suite, the isoFLOP scaling study and its fits, the
figures, the benchmarks, the GPU check's table and a run's report card. Each runs from the repository's root as
`python -m experiments.NAME`, and imports the root's modules, never the other way round."""

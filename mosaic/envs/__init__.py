"""mosaic.envs: the offline deep-search environment (docs/algorithm.md §7).

- ``deepsearch``  the public entry point (re-exports the pieces below)
- ``names``       fictional names from a syllable grammar; disjoint name partitions
- ``world``       seeded world: entities, relations, attributes, documents
- ``questions``   k-hop questions with unique answers and gold chains
- ``search``      BM25 index (bm25s), cached on disk, and the search tool's output
- ``splits``      train / validation / test from disjoint worlds, cached
- ``rewards``     ``<answer>`` extraction, normalisation, exact match, token F1
- ``export``      verl-layout Parquet export / import
- ``calibrate``   searches and sessions a k-hop question needs under a context budget
- ``cli``         ``mosaic data …``
"""

"""Grids of training runs (arms x settings x seeds), held-out evaluation and reports (`mosaic experiment`)."""

"""mosaic.envs."""

"""mosaic.core."""

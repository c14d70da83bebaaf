"""mosaic.train."""

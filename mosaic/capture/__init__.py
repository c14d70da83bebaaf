"""mosaic.capture."""

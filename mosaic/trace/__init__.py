"""mosaic.trace."""

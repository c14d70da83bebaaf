"""mosaic.integrations."""

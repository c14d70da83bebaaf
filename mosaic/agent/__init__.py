"""mosaic.agent."""

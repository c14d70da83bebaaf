"""The configuration grammar, on the package's ground floor (just above ``mosaic.core``).

- ``mosaic.config.sections`` — the frozen, validated sections of a run (model, data, rollout,
  algo, optim, train, sft) and :class:`~mosaic.config.sections.ConfigError`;
- ``mosaic.config.harness``  — :class:`~mosaic.config.harness.HarnessConfig` (the agent loop's
  settings) and the fixed texts the harness shows the model;
- ``mosaic.config.loader``   — :class:`~mosaic.config.loader.Config`, the presets, YAML and dotted
  ``key=value`` overrides, dumping and diffing;
- ``mosaic.config.cliargs``  — the command-line grammar every verb shares.

Every other area imports its configuration from here, never the other way round. Submodules are
imported on demand: ``mosaic --help`` stays fast because nothing here is loaded for it.
"""

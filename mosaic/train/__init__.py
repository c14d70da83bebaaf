"""mosaic.train: the trainer's infrastructure.

| module | what |
| --- | --- |
| ``config`` | frozen, validated config sections, presets (cpu / smollm2 / paper), YAML + ``key=value`` overrides |
| ``scorer`` | information gains (docs/algorithm.md §4.4): deduped states, one cached pass per session, batched probes; slow reference; turn-level variant (§4.7) |
| ``checkpoint`` | atomic checkpoints (model, tokenizer, optimizer, scheduler, RNGs, cursor), resume, pruning |
| ``optim`` | AdamW and the warm-up / cosine LR schedule |
| ``runlog`` | the run directory: config.yaml, metrics.jsonl, TensorBoard, samples, console line, plots, summary.md |
| ``metrics`` | rollout / session metric names and values |
| ``stats`` | accuracy CIs, paired bootstrap comparison of two runs |
| ``cli`` | ``mosaic train | sft | eval | compare`` |

Submodules are imported on demand (``import mosaic.config.loader`` pulls in no torch).
"""

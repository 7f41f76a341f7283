"""Observability: what a run tells a person while and after it runs.

`catalogue` declares every metric key once (meaning, unit, reduction); `metrics` writes them
(`metrics.jsonl`, wandb offline, the console progress line); `logs` routes engine/Ray/vLLM output to
`RUN_DIR/logs/` and keeps the terminal readable; `memory` samples each part's peak memory;
`report`, `report_figures` and `report_viewer` turn a run directory into `report.html`.
Nothing here imports the driver: the driver (`streaming/`) imports this.
"""

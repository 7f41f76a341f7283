"""The metrics catalogue: every key streamrl logs, declared once with its unit, reduction and meaning.

Writers log under these keys; the progress line, the report and its figures import the keys they
read from here (`REWARD`, `LAG`, ...). `tests/observability/test_catalogue.py` fails when a reader names
a key nobody declares or two declarations could match one key, and the end-to-end test fails when a
real run logs a key that is not declared here, or does not log one that a reader needs.

A key is either exact (`rollout/reward_mean`) or a pattern whose `{placeholders}` stand for one of
the values in `PLACEHOLDERS` (`is/{is_stat}/{bucket}` covers `is/ratio_mean/lag_0`).

Lag is defined in `buffer.admission` (`trajectory_lag`, `token_lag`): the served version when a row
is consumed minus the policy version that generated it (per trajectory: its oldest sampled token's
version; per token: that token's). The loss uses the same function against the learner's own
version (`learner.step_inputs.token_lags` calls `token_lag` on torch tensors), and so does the
offline report (`buffer.staleness`). The keys below only report it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from functools import cache


class Reduction(StrEnum):
    """What one logged value is, and how to combine values across log lines."""

    COUNT = "count"  # an increment since the previous log line (sum them over time)
    TOTAL = "total"  # a running total since the run (or the process) started
    MEAN = "mean"  # a mean over the interval or the trained batch
    MAX = "max"  # a maximum over the interval, the batch or the run so far
    LAST = "last"  # a gauge read when the line was logged
    FRACTION = "fraction"  # one bucket's share of a histogram (the buckets of one line sum to 1)


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    unit: str
    reduction: Reduction
    meaning: str
    when: str | None = None  # None: every run logs it; else the condition under which it is logged

    @property
    def always(self) -> bool:
        return self.when is None


IS_STATS = (
    "ratio_mean",
    "ratio_max",
    "ratio_min",
    "ratio_p50",
    "ratio_p90",
    "ratio_p99",
    "policy_ratio_mean",
    "weight_mean",
    "clip_frac",
    "mask_frac",
    "mismatch_kl",
    "ess",
    "num_tokens",
)
GROUP_PHASES = ("open", "ready", "consumed", "filtered", "dropped", "evicted", "over_age")  # buffer.groups.GroupPhase
MEMORY_PARTS = ("driver", "engine", "rollout_worker", "buffer", "learner")
PLACEHOLDERS = {
    "is_stat": "|".join(IS_STATS),
    "bucket": r"lag_\d+(?:plus)?",  # learner.is_metrics.lag_bucket_names
    "lag_scope": "batch|tokens|trajectories",  # the trained batch's trajectories; run so far: tokens, trajectories
    "lag_k": r"\d+|over",  # core.versions.lag_histogram bins: 0..max_staleness, then "over"
    "lag_stat": "mean|std|min|max|p50|p90|p99",  # streaming.metrics.summarize
    "phase": "|".join(GROUP_PHASES),
    "length_kind": "generated|trained|dropped_over_age",
    "tokens": r"\d+",
    "part": "|".join(MEMORY_PARTS),
    "engine": r"engine-\d+",
    "program_metric": r"[a-z0-9_]{1,48}",  # rollout.gateway.command.METRIC_NAME
}

M, R = Metric, Reduction
PPO = "algo = ppo (critic)"
KL = "learner.kl_coef > 0 (reference model)"
TOOLS = "a tool was called in the interval"
TOOLSET = "rollout.agent.tool_config is set"
MCP = "the tool config has an `mcp:` entry"
EVAL = "eval.num_prompts > 0, on the evaluation lines only"
GATEWAY = "rollout.agent.gateway is set (the gateway agent loop)"
PROGRAM = "a gateway command wrote $STREAMRL_METRICS_FILE (a harness's exit status, a rubric's parts)"
FILTER = "data.prompt_filter.enabled"
DISTILL = "[distill] is set (a teacher engine)"
METRICS: tuple[Metric, ...] = (
    # ---- the line itself (streaming.metrics.MetricsLogger)
    M("time", "unix s", R.LAST, "wall clock when the line was logged"),
    M("elapsed_s", "s", R.LAST, "seconds since this process started the run (the timeline's x axis)"),
    M("learner_step", "steps", R.LAST, "learner steps done"),
    M("policy_version", "version", R.LAST, "label of the weights the engines serve"),
    M("time/elapsed_s", "s", R.TOTAL, "seconds of training over every process of the run (each resume starts one)"),
    M(
        "metrics/num_wandb_errors",
        "errors",
        R.TOTAL,
        "wandb calls that failed (the local log kept the line)",
        when="wandb raised",
    ),
    # ---- rollout workers (rollout.worker.RolloutWorker.metrics, summed over workers by the driver)
    M("rollout/num_running", "trajectories", R.LAST, "trajectories a worker is running now"),
    M("rollout/num_held", "trajectories", R.LAST, "parked trajectories waiting for a resume"),
    M("rollout/num_finished", "trajectories", R.COUNT, "trajectories finished and saved"),
    M("rollout/num_partial", "rows", R.COUNT, "partial rows saved (parks and snapshots)"),
    M("rollout/num_failed", "trajectories", R.COUNT, "trajectories failed with a reason"),
    M("rollout/num_resumed", "trajectories", R.COUNT, "trajectories resumed from a saved AgentData"),
    M("rollout/num_sink_retries", "appends", R.COUNT, "row appends retried (refused or raised)"),
    M("rollout/reward_sum", "reward", R.COUNT, "sum of the rewards of the trajectories finished"),
    M("rollout/turns_sum", "turns", R.COUNT, "assistant + tool turns of the trajectories finished"),
    M("rollout/tool_calls_sum", "calls", R.COUNT, "tool calls of the trajectories finished"),
    M("rollout/num_interrupts", "generations", R.COUNT, "generations interrupted by a weight sync"),
    M("rollout/num_parse_errors", "turns", R.COUNT, "assistant turns whose tool call did not parse"),
    M("rollout/num_tool_calls", "calls", R.COUNT, "tool calls made"),
    M("rollout/num_tool_errors", "calls", R.COUNT, "tool calls that returned an error observation"),
    M(
        "rollout/num_tool_calls_interrupted",
        "calls",
        R.COUNT,
        "journaled non-idempotent calls found in doubt after a crash: answered 'interrupted', not re-run",
    ),
    M("rollout/num_generated_tokens", "tokens", R.COUNT, "tokens sampled by the policy"),
    M(
        "rollout/num_reprefill_tokens",
        "tokens",
        R.COUNT,
        "prompt tokens re-sent to an engine after an interrupt or a progress cut",
    ),
    M(
        "rollout/num_progress_rows",
        "rows",
        R.COUNT,
        "partial rows made durable because rollout.agent.progress_every_s had passed",
    ),
    M(
        "rollout/num_progress_cuts",
        "requests",
        R.COUNT,
        "generations cut at rollout.agent.progress_every_s, their turn continued by a new request",
    ),
    M("rollout/num_in_flight", "requests", R.LAST, "generation requests in flight through the workers' routers"),
    M("rollout/num_sticky_keys", "trajectories", R.LAST, "trajectories pinned to an engine (prefix-cache affinity)"),
    M("rollout/num_engine_failures", "requests", R.COUNT, "generation requests that failed on an engine"),
    M("rollout/num_engines_restored", "engines", R.COUNT, "unhealthy engines probed back into routing"),
    M("rollout/tools/num_calls", "calls", R.COUNT, "tool calls received by the tool registry", when=TOOLSET),
    M("rollout/tools/num_executed", "calls", R.COUNT, "tool calls that ran", when=TOOLSET),
    M("rollout/tools/num_errors", "calls", R.COUNT, "tool calls answered with an error", when=TOOLSET),
    M("rollout/tools/num_timeouts", "calls", R.COUNT, "tool calls past their timeout", when=TOOLSET),
    M("rollout/tools/num_parse_errors", "calls", R.COUNT, "tool calls whose arguments were not JSON", when=TOOLSET),
    M(
        "rollout/tools/num_validation_errors",
        "calls",
        R.COUNT,
        "tool calls whose arguments failed the schema",
        when=TOOLSET,
    ),
    M("rollout/tools/num_exceptions", "calls", R.COUNT, "tool calls that raised", when=TOOLSET),
    M("rollout/tools/num_rejected", "calls", R.COUNT, "tool calls refused (beyond max_parallel)", when=TOOLSET),
    M(
        "rollout/tools/num_interrupted",
        "calls",
        R.COUNT,
        "journaled calls in doubt after a crash, not re-run",
        when=TOOLSET,
    ),
    M("rollout/tools/latency_sum_s", "s", R.COUNT, "seconds spent running tools", when=TOOLSET),
    M("rollout/tools/num_mcp_restarts", "connections", R.COUNT, "MCP connections remade after one was lost", when=MCP),
    M("rollout/tools/num_mcp_connect_failures", "attempts", R.COUNT, "MCP connection attempts that failed", when=MCP),
    M("rollout/tools/num_mcp_lost_calls", "calls", R.COUNT, "MCP calls in flight when the connection broke", when=MCP),
    M("rollout/tools/num_mcp_timeouts", "calls", R.COUNT, "MCP calls past the toolset's timeout_s", when=MCP),
    M(
        "rollout/tools/mean_latency_s",
        "s",
        R.MEAN,
        "seconds per tool call run in the interval",
        when="a tool ran in the interval",
    ),
    M("rollout/tokens_per_s", "tokens/s", R.MEAN, "rollout/num_generated_tokens over the interval's seconds"),
    M(
        "rollout/finished_reward_mean",
        "reward",
        R.MEAN,
        "mean reward of every trajectory finished in the interval",
        when="a trajectory finished in the interval",
    ),
    M(
        "rollout/num_turns_mean",
        "turns",
        R.MEAN,
        "turns per trajectory finished in the interval",
        when="a trajectory finished in the interval",
    ),
    M(
        "rollout/tool_calls_mean",
        "calls",
        R.MEAN,
        "tool calls per trajectory finished in the interval",
        when="a trajectory finished in the interval",
    ),
    M("rollout/tool_error_rate", "fraction", R.MEAN, "rollout/num_tool_errors / rollout/num_tool_calls", when=TOOLS),
    # ---- the agent gateway (rollout.gateway.server), per rollout worker
    M("rollout/gateway/num_sessions", "sessions", R.LAST, "gateway sessions open on the worker", when=GATEWAY),
    M("rollout/gateway/num_requests", "requests", R.COUNT, "API calls the gateway received", when=GATEWAY),
    M("rollout/gateway/num_errors", "requests", R.COUNT, "API calls answered with an error status", when=GATEWAY),
    M("rollout/gateway/num_sampled", "calls", R.COUNT, "API calls answered by sampling the policy", when=GATEWAY),
    M(
        "rollout/gateway/num_retries_answered",
        "calls",
        R.COUNT,
        "retried calls answered from the session's journal (nothing sampled again)",
        when=GATEWAY,
    ),
    M(
        "rollout/gateway/num_replayed",
        "calls",
        R.COUNT,
        "calls of a program restarted after a crash answered from an earlier attempt's journal",
        when=GATEWAY,
    ),
    M("rollout/gateway/num_forks", "calls", R.COUNT, "calls that rewrote the history (a session fork)", when=GATEWAY),
    M(
        "rollout/gateway/num_calls_across_sync",
        "calls",
        R.COUNT,
        "calls whose generation a weight sync parked or interrupted (the call only took longer)",
        when=GATEWAY,
    ),
    M(
        "rollout/gateway/overhead_sum_s",
        "s",
        R.COUNT,
        "seconds sampled calls spent in the gateway outside the engine (parse, render, durable journal, reply)",
        when=GATEWAY,
    ),
    M(
        "rollout/gateway/overhead_mean_ms",
        "ms",
        R.MEAN,
        "rollout/gateway/overhead_sum_s per sampled call in the interval",
        when="the gateway sampled a call in the interval",
    ),
    # A gateway command's named numbers (rollout/gateway/command.py, $STREAMRL_METRICS_FILE)
    M("rollout/program/num_samples", "samples", R.COUNT, "samples whose command left named numbers", when=PROGRAM),
    M("rollout/program/{program_metric}/sum", "value", R.COUNT, "its sum over those samples", when=PROGRAM),
    M(
        "rollout/program/{program_metric}/mean",
        "value",
        R.MEAN,
        "its mean over the interval's samples that left named numbers, 0 where a sample left out the name "
        "(a 0/1 flag: the share of samples that set it)",
        when=PROGRAM,
    ),
    # ---- distillation (rollout.teacher: workers' counters; learner.distill: the trained batch)
    M("distill/num_scored", "trajectories", R.COUNT, "finished trajectories the teacher scored", when=DISTILL),
    M("distill/num_scored_tokens", "tokens", R.COUNT, "sampled tokens the teacher scored", when=DISTILL),
    M("distill/score_s_sum", "s", R.COUNT, "seconds of the teacher's scoring requests", when=DISTILL),
    M(
        "distill/teacher_latency_mean_s",
        "s",
        R.MEAN,
        "distill/score_s_sum per trajectory scored in the interval (one request each)",
        when="the teacher scored a trajectory in the interval",
    ),
    M(
        "distill/kl_mean",
        "nats/token",
        R.MEAN,
        "mean of log π_student − log π_teacher over the step's scored tokens (a reverse-KL estimate)",
        when=DISTILL,
    ),
    M(
        "distill/teacher_share",
        "fraction",
        R.MEAN,
        "the teacher's share of the advantage's magnitude, Σ|coef·k| / (Σ|coef·k| + Σ|A_task|); 0 if both are 0",
        when=DISTILL,
    ),
    M("distill/coverage", "fraction", R.MEAN, "share of the step's action tokens the teacher scored", when=DISTILL),
    # ---- the trained batch (streaming.actors.learner.LearnerActor.train_step)
    M("rollout/reward_mean", "reward", R.MEAN, "mean reward of the trained batch"),
    # ---- held-out evaluation (streaming.heldout): its own lines, at step 0, every eval.every_steps and the last
    M(
        "eval/reward_mean",
        "reward",
        R.LAST,
        "avg@k: mean reward over every held-out sample (a failed one scores 0)",
        when=EVAL,
    ),
    M(
        "eval/pass_at_1",
        "fraction",
        R.LAST,
        "mean share of a prompt's samples with reward >= eval.pass_threshold",
        when=EVAL,
    ),
    M("eval/pass_at_k", "fraction", R.LAST, "unbiased pass@k (Chen et al. 2021) over the held-out prompts", when=EVAL),
    M("eval/pass_hat_k", "fraction", R.LAST, "pass^k: chance that all k samples of a prompt pass", when=EVAL),
    M("eval/k", "samples", R.LAST, "samples per held-out prompt (eval.k)", when=EVAL),
    M("eval/num_prompts", "prompts", R.LAST, "held-out prompts evaluated, eval.k samples each", when=EVAL),
    M("eval/num_failed", "trajectories", R.LAST, "held-out trajectories that failed or never came back", when=EVAL),
    M(
        "eval/response_length_mean",
        "tokens",
        R.LAST,
        "mean response length of the finished held-out trajectories",
        when=EVAL,
    ),
    M(
        "eval/served_step",
        "steps",
        R.LAST,
        "learner step of the evaluated weights (all of one policy_version)",
        when=EVAL,
    ),
    M(
        "eval/elapsed_s",
        "s",
        R.LAST,
        "training wall time over every segment of the run when the evaluation began",
        when=EVAL,
    ),
    M(
        "eval/num_abandoned",
        "evaluations",
        R.LAST,
        "evaluations cancelled at eval.max_hold_s so a sync could go on",
        when=EVAL,
    ),
    M(
        "eval/sync_held_s",
        "s",
        R.LAST,
        "how long this step's weight sync waited for a running evaluation",
        when="eval.num_prompts > 0, on steps that published",
    ),
    M("eval/seconds", "s", R.LAST, "wall time of the evaluation", when=EVAL),
    M("rollout/reward_std", "reward", R.MEAN, "reward standard deviation of the trained batch"),
    M("rollout/response_len_mean", "tokens", R.MEAN, "mean response length of the trained batch"),
    M("staleness/lag_{lag_stat}", "steps", R.MEAN, "trajectory lag of the trained batch (see the module docstring)"),
    M(
        "staleness/lag_frac/{lag_scope}/{lag_k}",
        "fraction",
        R.FRACTION,
        "share at this lag (core.versions.lag_fractions) of: the trained batch's trajectories (batch), "
        "all tokens consumed so far (tokens), all trajectories consumed so far (trajectories)",
    ),
    # ---- the learner (learner.engine.TrainingEngine.train_step, learner.is_metrics)
    M("learner/loss", "loss", R.MEAN, "total loss, mean over the step's minibatches"),
    M("learner/pg_loss", "loss", R.MEAN, "policy-gradient loss"),
    M("learner/entropy", "nats", R.MEAN, "policy entropy of the action tokens"),
    M("learner/grad_norm", "norm", R.MEAN, "gradient norm before clipping"),
    M("learner/kl", "nats", R.MEAN, "KL penalty to the reference model", when=KL),
    M("learner/value_loss", "loss", R.MEAN, "critic loss", when=PPO),
    M("learner/value_clip_frac", "fraction", R.MEAN, "tokens whose value update was clipped", when=PPO),
    M("learner/policy_version", "version", R.LAST, "the learner's weights version after the step"),
    M("learner/num_optimizer_steps", "steps", R.TOTAL, "optimizer steps taken"),
    M(
        "learner/num_nonfinite_steps",
        "steps",
        R.COUNT,
        "optimizer steps of this learner step skipped for a NaN/inf loss or gradient norm (weights unchanged)",
    ),
    M("learner/lr", "lr", R.LAST, "learning rate after the step"),
    M("learner/num_seqs", "sequences", R.LAST, "sequences in the trained batch"),
    M("learner/num_action_tokens", "tokens", R.LAST, "policy-sampled tokens in the trained batch"),
    M("learner/tokens_per_s", "tokens/s", R.MEAN, "tokens trained (prompt + response, x ppo_epochs) per second"),
    M("learner/update_s", "s", R.LAST, "seconds of forward/backward/optimizer work in the step"),
    M("learner/recompute_time_s", "s", R.LAST, "seconds recomputing proximal/old log-probs"),
    M("learner/step_s", "s", R.LAST, "seconds of the whole train_step call (batch padding included)"),
    M("learner/busy_fraction", "fraction", R.MEAN, "share of the learner actor's life spent in train_step"),
    M("learner/idle_ratio", "fraction", R.MEAN, "share of the run the driver waited for a batch"),
    M("learner/num_workers", "ranks", R.LAST, "learner ranks"),
    M("learner/reward_mean", "reward", R.MEAN, "mean reward the learner saw (equals rollout/reward_mean)"),
    M("learner/advantage_mean", "advantage", R.MEAN, "mean advantage of the action tokens"),
    M("learner/advantage_std", "advantage", R.MEAN, "advantage standard deviation"),
    M("is/{is_stat}", "ratio", R.MEAN, "importance-correction statistic over the step's action tokens"),
    M(
        "is/{is_stat}/{bucket}",
        "ratio",
        R.MEAN,
        "the same statistic over the tokens at one token lag",
        when="tokens at that lag in the batch",
    ),
    M("is/token_frac/{bucket}", "fraction", R.FRACTION, "share of the step's action tokens at this token lag"),
    # ---- the buffer (buffer.store.ReplayBuffer.stats)
    M("buffer/rows_appended", "rows", R.TOTAL, "rows appended since the buffer opened"),
    M("buffer/live_rows", "rows", R.LAST, "rows held in memory"),
    M("buffer/ready_trajectories", "trajectories", R.LAST, "finished trajectories of complete, unconsumed groups"),
    M("buffer/ready_groups", "groups", R.LAST, "complete groups waiting to be sampled"),
    M("buffer/partial_trajectories", "trajectories", R.LAST, "trajectories whose latest row is partial"),
    M("buffer/in_flight_trajectories", "trajectories", R.LAST, "admitted trajectories not finished or failed"),
    M("buffer/accepted_trajectories", "trajectories", R.LAST, "admitted trajectories not yet consumed"),
    M("buffer/trajectories_consumed", "trajectories", R.TOTAL, "trajectories sampled into a batch"),
    M("buffer/batches_sampled", "batches", R.TOTAL, "batches sampled"),
    M("buffer/evicted_over_age", "trajectories", R.TOTAL, "trajectories dropped as older than max_staleness"),
    M("buffer/over_age_kept", "groups", R.TOTAL, "over-age groups kept unsampled (over_age = keep)"),
    M("buffer/over_age_trained", "groups", R.TOTAL, "over-age groups trained with the lag-aware correction"),
    M("buffer/groups_over_token_budget", "groups", R.TOTAL, "groups larger than max_batch_tokens"),
    M("buffer/late_rows_ignored", "rows", R.TOTAL, "rows of already-closed trajectories ignored"),
    M("buffer/stale_attempt_rows", "rows", R.TOTAL, "rows refused: attempt older than their trajectory's current one"),
    M("buffer/flushes", "flushes", R.TOTAL, "log flushes"),
    M("buffer/backpressure_waits", "appends", R.TOTAL, "appends that waited for room (capacity_rows)"),
    M("buffer/backpressure_timeouts", "appends", R.TOTAL, "appends refused after waiting append_timeout_s"),
    M("buffer/memory_bytes", "bytes", R.LAST, "bytes of the rows held in memory"),
    M("buffer/chunks", "chunks", R.LAST, "Arrow record batches held in memory"),
    M("buffer/recovered_rows", "rows", R.LAST, "rows read back from the log at start"),
    M("buffer/recovery_problems", "problems", R.LAST, "torn tails / corrupt batches skipped at recovery"),
    M("buffer/groups_{phase}", "groups", R.LAST, "groups in this phase"),
    M("buffer/trajectories_generated", "trajectories", R.TOTAL, "finished members of settled groups"),
    M("buffer/trajectories_trained", "trajectories", R.TOTAL, "finished members of groups the learner used"),
    M(
        "buffer/gradient_share",
        "fraction",
        R.LAST,
        "share of generated trajectories that reached a gradient (trained / generated)",
    ),
    # ---- the prompt filter (streaming.prompt_filter.PromptFilter.metrics)
    M("data/prompts_easy", "prompts", R.LAST, "prompts whose recent pass rate is >= easy_pass_rate", when=FILTER),
    M("data/prompts_hard", "prompts", R.LAST, "prompts whose recent pass rate is <= hard_pass_rate", when=FILTER),
    M(
        "data/prompts_retired",
        "prompts",
        R.LAST,
        "prompts of a difficulty admitted with probability 0: none of their appearances is admitted now",
        when=FILTER,
    ),
    M(
        "data/prompts_skipped_easy",
        "appearances",
        R.TOTAL,
        "prompt appearances passed over at admission as easy (saved with the cursor: survives a resume)",
        when=FILTER,
    ),
    M(
        "data/prompts_skipped_hard",
        "appearances",
        R.TOTAL,
        "prompt appearances passed over at admission as hard (saved with the cursor: survives a resume)",
        when=FILTER,
    ),
    M("staleness/batch_token_lag_mean", "steps", R.MEAN, "token lag of the last sampled batch"),
    M("staleness/batch_token_lag_max", "steps", R.MAX, "largest token lag of the last sampled batch"),
    M("staleness/batch_trajectory_lag_max", "steps", R.MAX, "largest trajectory lag of the last sampled batch"),
    M(
        "staleness/batch_version_span_mean",
        "versions",
        R.MEAN,
        "policy versions one trajectory of the last batch crosses (max - min version of its sampled tokens)",
    ),
    M("staleness/batch_version_span_max", "versions", R.MAX, "largest version span in the last sampled batch"),
    M("staleness/batch_interrupts_mean", "count", R.MEAN, "weight-sync interruptions per trajectory of the last batch"),
    M(
        "staleness/batch_in_flight_s_mean",
        "s",
        R.MEAN,
        "time from admission to the final row, last batch's trajectories",
    ),
    M(
        "staleness/batch_in_queue_s_mean",
        "s",
        R.MEAN,
        "time from the final row to being sampled, last batch's trajectories",
    ),
    M("staleness/token_lag_mean", "steps", R.MEAN, "mean token lag of everything consumed so far"),
    M("staleness/trajectory_lag_mean", "steps", R.MEAN, "mean trajectory lag of everything consumed so far"),
    M(
        "staleness/length_bias",
        "ratio",
        R.MEAN,
        "trained / generated mean length bucket (1 = no length bias)",
        when="a trajectory was generated and trained",
    ),
    M("length/{length_kind}_mean_bucket", "tokens", R.MEAN, "mean power-of-two length bucket, run so far"),
    M(
        "length/{length_kind}_le_{tokens}",
        "trajectories",
        R.TOTAL,
        "trajectories in this length bucket, run so far",
        when="a trajectory of that kind fell in the bucket",
    ),
    # ---- engines and weight sync
    M("engine/busy_fraction", "fraction", R.MEAN, "engines' generating time over their uptime (mean over engines)"),
    M("engine/busy_fraction/{engine}", "fraction", R.MEAN, "one engine's generating time over its uptime"),
    M("engine/busy_s", "s", R.TOTAL, "seconds generating (mean over engines)"),
    M("engine/uptime_s", "s", R.TOTAL, "seconds since the engine started (mean over engines)"),
    M("sync/pause_s", "s", R.LAST, "last sync: pausing generation"),
    M("sync/transfer_s", "s", R.LAST, "last sync: moving the weights"),
    M("sync/verify_s", "s", R.LAST, "last sync: checking the staged weights"),
    M("sync/load_s", "s", R.LAST, "last sync: committing the staged weights"),
    M("sync/resume_s", "s", R.LAST, "last sync: resuming generation"),
    M(
        "sync/paused_s",
        "s",
        R.LAST,
        "last sync: engines out of generation, pause to resumed (with "
        "weight_sync.overlap only the commit; without, transfer and verify too)",
    ),
    M("sync/total_s", "s", R.LAST, "last sync, end to end"),
    M("sync/gather_s", "s", R.LAST, "last sync: gathering sharded weights on rank 0", when="learner.num_workers > 1"),
    M("sync/bytes", "bytes", R.LAST, "bytes moved by the last sync"),
    M("sync/failed", "0/1", R.LAST, "1 if the last sync failed (engines kept the previous version)"),
    M("sync/policy_version", "version", R.LAST, "version the last sync published"),
    M("sync/num_engines_dropped", "engines", R.LAST, "engines the last sync removed from the sync set"),
    M("sync/num_engines_excluded", "engines", R.LAST, "engines out of the sync set so far, kept out of routing"),
    M("sync/num_syncs", "syncs", R.TOTAL, "syncs attempted"),
    M("sync/num_failed", "syncs", R.TOTAL, "syncs that failed"),
    M(
        "sync/num_versions_skipped",
        "versions",
        R.TOTAL,
        "learner versions the engines never served (coalesced: the newest weights go, never a queue)",
    ),
    M("sync/num_engines", "engines", R.LAST, "engines in the sync set"),
    # ---- memory and health
    M("memory/{part}_peak_gb", "GB", R.MAX, "peak RSS of the part's process (and its children) so far"),
    M("memory/{part}_gpu_peak_gb", "GB", R.MAX, "torch.cuda.max_memory_allocated of the part", when="on GPU"),
    M("memory/learner_rss_gb", "GB", R.LAST, "the learner's RSS after the step"),
    M("invariants/stranded_checks", "checks", R.TOTAL, "I2 checks that found a stranded trajectory (must stay 0)"),
)
del M, R

# Keys readers name (the progress line, the report's summary table and figures).
REWARD = "rollout/reward_mean"
EVAL_REWARD = "eval/reward_mean"
LAG = "staleness/lag_mean"
LAG_FRAC = "staleness/lag_frac/"  # + "<scope>/<lag>": the one lag-histogram family (writers and the report)
ENGINE_BUSY = "engine/busy_fraction"
ROLLOUT_TOKENS_PER_S = "rollout/tokens_per_s"
LEARNER_TOKENS_PER_S = "learner/tokens_per_s"
WANDB_ERRORS = "metrics/num_wandb_errors"
RESERVED = frozenset({"time", "elapsed_s", "learner_step", "policy_version"})  # the line's own fields


def _regex(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", pattern)
    body = "".join(re.escape(p) if i % 2 == 0 else f"(?:{PLACEHOLDERS[p]})" for i, p in enumerate(parts))
    return re.compile(body + r"\Z")


@cache
def _compiled() -> tuple[tuple[Metric, re.Pattern[str]], ...]:
    return tuple((m, _regex(m.key)) for m in METRICS)


def matches(key: str) -> list[Metric]:
    """The declarations that cover `key` (exactly one for a well-formed key)."""
    return [m for m, rx in _compiled() if rx.match(key)]


def reduction(key: str) -> Reduction | None:
    """The declared reduction of `key`; None when it is not declared (the e2e test catches that)."""
    found = matches(key)
    return found[0].reduction if len(found) == 1 else None


def lookup(key: str) -> Metric:
    found = matches(key)
    if len(found) != 1:
        raise KeyError(f"{key!r} is {'not declared' if not found else 'declared twice'} in core/catalogue.py")
    return found[0]


def undeclared(keys: set[str] | list[str]) -> list[str]:
    """Logged keys no declaration covers."""
    return sorted(k for k in keys if not matches(k))

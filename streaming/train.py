"""`streamrl train`: make (or reopen) the run directory, place the parts, run the driver, report.

Resume (`--resume RUN_DIR`) reloads the resolved config saved in the run, the latest complete
checkpoint (learner weights + optimizer + versions), the buffer from its durable log (finished,
partial and consumption records), and the data cursor; partial trajectories are resubmitted and
continue from their AgentData; consumption after the checkpoint is rolled back so nothing is trained
on twice or skipped.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from streamrl.core.run_dir import Checkpoint, RunDir, RunInfo
from streamrl.streaming.checkpoints import use_newest_complete
from streamrl.streaming.config import StreamRLConfig, load_config
from streamrl.streaming.driver_state import DriverState
from streamrl.streaming.pipeline import Pipeline, make_worker

if TYPE_CHECKING:
    from streamrl.engines.config import EngineConfig
    from streamrl.streaming.actors.clients import BufferClient, LearnerClient
    from streamrl.streaming.actors.engine import RayEngineClient

logger = logging.getLogger(__name__)


RAY_ENV = {"GLOO_SOCKET_IFNAME": "lo", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}


def _init_ray(cfg: StreamRLConfig, run_dir: Path) -> None:
    from streamrl.core.faults import forwarded_env
    from streamrl.observability.logs import connect_options, link_ray_logs, ray_init_options

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **connect_options(address), **ray_init_options(run_dir, forwarded_env()))
        return
    ray.init(
        address="local",  # always a fresh local cluster unless RAY_ADDRESS names one
        num_cpus=16,  # a scheduling count: actors ask for fractions; the OS shares the cores
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        object_store_memory=512 * 1024 * 1024,
        **ray_init_options(run_dir, {**RAY_ENV, **forwarded_env()}),  # actor output into RUN_DIR/logs
    )
    link_ray_logs(run_dir)


def open_run(
    config: str | None, overrides: list[str], resume: str | None
) -> tuple[StreamRLConfig, Path, DriverState | None]:
    if resume:
        from streamrl.rollout.data import load_records
        from streamrl.streaming.resume import check_prompts, resume_config

        run_dir = Path(resume)
        cfg, info = resume_config(run_dir, overrides)  # refuses overrides that change what is trained on
        check_prompts(
            run_dir, info, load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
        )
        if cfg.rollout.agent.verifiers is not None:  # its venv may have left the cache since
            from streamrl.rollout.verifiers.prepare import ensure_prepared

            ensure_prepared(cfg.rollout.agent.verifiers)
        if cfg.rollout.agent.mini_swe is not None:  # the harness's venv, likewise
            from streamrl.rollout.mini_swe.prepare import ensure_prepared as ensure_harness

            ensure_harness(cfg.rollout.agent.mini_swe)
        state_path = RunDir(run_dir).driver_state
        state = DriverState.load(state_path) if state_path.exists() else DriverState()
        use_newest_complete(state)  # a torn newest checkpoint: resume from the one before
        return cfg, run_dir, state
    cfg = load_config(config, overrides)
    name = cfg.trainer.run_name or f"{Path(config).stem if config else 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(cfg.trainer.run_root) / name
    held = RunDir(run_dir).started_parts()
    if held:  # a fresh learner on an old buffer log would mix two runs' trajectories and versions
        raise ValueError(
            f"{run_dir} already holds a run ({', '.join(held)}): continue it with `streamrl train --resume {run_dir}`, "
            "or choose another trainer.run_name"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return prepare_harness(cfg, run_dir), run_dir, None


def prepare_harness(cfg: StreamRLConfig, folder: Path) -> StreamRLConfig:
    """The config with its verifiers environment or coding harness prepared, before anything starts:
    the venv built (or found in the cache), the dataset written into `folder` and made the prompt
    stream, the gateway's command set. Unchanged without either section. `streamrl train` prepares
    into the run directory, `streamrl rollout` into a folder beside its output."""
    if cfg.rollout.agent.verifiers is not None:
        from streamrl.rollout.verifiers.prepare import prepare_environment

        cfg = cfg.with_verifiers(*prepare_environment(cfg.rollout.agent.verifiers, cfg.rollout.agent.gateway, folder))
    if cfg.rollout.agent.mini_swe is not None:
        from streamrl.rollout.mini_swe.prepare import prepare_mini_swe

        cfg = cfg.with_mini_swe(*prepare_mini_swe(cfg.rollout.agent.mini_swe, cfg.rollout.agent.gateway, folder))
    return cfg


def _prepare_run(cfg: StreamRLConfig, run_dir: Path, resuming: bool) -> tuple[StreamRLConfig, list]:
    """The run's config with its model resolved (once: `prepare_model`, or the path a resumed run
    recorded) and its prompts; a new run records both in its `RunInfo` (a resume refuses a dataset
    changed under the run)."""
    from streamrl.observability.logs import log_dir
    from streamrl.rollout.data import load_records
    from streamrl.streaming.resume import prompts_sha256
    from streamrl.streaming.sft import prepare_model

    if resuming:
        model_path = RunDir(run_dir).info().model_path
    else:  # conversion and SFT warm-up run in a child process: the driver never holds a model
        model_path = prepare_model(cfg, log_file=log_dir(run_dir) / "prepare_model.log")
    cfg = cfg.with_model(model_path)
    cfg.buffer.root_dir = str(RunDir(run_dir).buffer)
    records = load_records(cfg.data.source, cfg.data.num_prompts, cfg.data.seed, cfg.data.difficulty)
    if not resuming:
        info = RunInfo(
            run_name=run_dir.name,
            model_path=model_path,
            mode=cfg.trainer.mode,
            config=cfg.model_dump(mode="json"),
            started_at=time.time(),
            prompts_sha256=prompts_sha256(records),
            num_prompts=len(records),
        )
        RunDir(run_dir).write_info(info)
    return cfg, records


def _launch_learner(cfg: StreamRLConfig, checkpoint: str | None) -> LearnerClient:
    """The learner actor (from `checkpoint` when resuming from one)."""
    from streamrl.core.memory import learner_runtime_env
    from streamrl.streaming.actors.clients import LearnerClient
    from streamrl.streaming.actors.learner import LearnerActor, learner_actor_options

    # Ray pins OMP_NUM_THREADS to an actor's num_cpus (1); the learner's matmuls want every core;
    # glibc's allocator is configured so the learner's resident set stays flat across steps.
    cores = cfg.placement.learner_cores
    learner_env = {"env_vars": learner_runtime_env(len(cores) if cores else None)}
    # @ray.remote makes LearnerActor an ActorClass; pyrefly types the decorated name as the plain class
    actor = LearnerActor.options(**learner_actor_options(cfg), runtime_env=learner_env)  # pyrefly: ignore[missing-attribute]
    return LearnerClient(
        actor.remote(cfg, checkpoint), timeout_s=cfg.trainer.step_timeout_s, timeouts=cfg.trainer.actor_timeouts
    )


async def build_pipeline(cfg: StreamRLConfig, run_dir: Path, state: DriverState | None) -> Pipeline:
    from streamrl.observability.metrics import MetricsLogger
    from streamrl.streaming.prompt_filter import PromptFilter
    from streamrl.streaming.prompts import PromptStream

    resuming = state is not None
    from_ckpt = resuming and state.checkpoint is not None
    cfg, records = _prepare_run(cfg, run_dir, resuming)
    model_path = cfg.model
    state = state or DriverState()

    timeout_s = cfg.trainer.step_timeout_s
    buffer = _launch_buffer(cfg, state.checkpoint_step if resuming else None)
    if resuming:  # versions continue above every label the buffer or the driver has seen (I4)
        state.rewind_to_checkpoint(await buffer.max_policy_version())
        state.save(RunDir(run_dir).driver_state)
    engines, engine_cfg, engine_version = _launch_engines(cfg, state, from_ckpt=from_ckpt)
    start_version = state.policy_version
    teachers = _launch_teachers(cfg, model_path, run_dir)
    learner = _launch_learner(cfg, state.checkpoint if from_ckpt else None)
    stream = PromptStream(
        records, seed=cfg.data.seed, shuffle=cfg.data.shuffle, num_epochs=cfg.data.num_epochs, cursor=state.cursor
    )
    metrics = MetricsLogger(run_dir, wandb_cfg=cfg.wandb, console=True, total_steps=cfg.trainer.total_steps)
    pipeline = Pipeline(
        cfg=cfg,
        run_dir=run_dir,
        model_path=model_path,
        engines=engines,
        teachers=teachers,
        workers=[],
        buffer=buffer,
        learner=learner,
        stream=stream,
        # a resume rebuilds it from the recovered buffer's groups at its first admission
        prompt_filter=PromptFilter.for_run(cfg.data.prompt_filter, records, seed=cfg.data.seed),
        metrics=metrics,
        state=state,
        elapsed_base_s=state.elapsed_s,
    )
    pipeline.fleet.engine_cfg, pipeline.fleet.next_index = engine_cfg, len(engines)  # `streamrl scale`
    pipeline.workers = [make_worker(pipeline, f"worker-{i}") for i in range(cfg.rollout.num_workers)]
    startup = cfg.rollout.engine.startup_timeout_s
    await asyncio.gather(*[e.wait_ready() for e in [*engines, *teachers]])
    learner.timeout_s = startup  # the first calls wait for the learner actor to load the model
    if await learner.policy_version() != start_version:
        await learner.set_policy_version(start_version)
    await learner.connect(engines, pipeline.workers, engine_version)
    if engine_version != start_version:  # a LoRA adapter resume: the checkpoint's adapter, before any request
        await serve_checkpoint_adapter(learner, start_version)
    learner.timeout_s = timeout_s
    await pipeline.write_placement()
    if resuming:
        await pipeline.reconcile_cursor()
        n = await pipeline.resubmit_orphans()
        logger.info("resumed run at learner step %d: %d unfinished trajectories resubmitted", state.learner_step, n)
    return pipeline


def _launch_buffer(cfg: StreamRLConfig, resume_learner_step: int | None) -> BufferClient:
    """The buffer actor, on the driver's node: its log lives in RUN_DIR (or a shared filesystem in a
    cluster)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from streamrl.streaming.actors.buffer import create_buffer_actor
    from streamrl.streaming.actors.clients import BufferClient

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    actor = create_buffer_actor(cfg.buffer, resume_learner_step=resume_learner_step, scheduling_strategy=here)
    return BufferClient(actor, timeout_s=cfg.trainer.step_timeout_s, timeouts=cfg.trainer.actor_timeouts)


def _launch_engines(
    cfg: StreamRLConfig, state: DriverState, *, from_ckpt: bool
) -> tuple[list[RayEngineClient], EngineConfig, int]:
    """The rollout engine actors on the weights the run starts from (`engine_start`); returns them,
    their config (kept for `streamrl scale`) and the version they serve."""
    from streamrl.streaming.actors.engine import RayEngineClient

    engine_path, weights, engine_version = engine_start(cfg, state, from_ckpt=from_ckpt)
    engine_cfg = cfg.rollout.engine.model_copy(update={"model": engine_path})
    engines = [
        RayEngineClient.launch(
            cfg.placement.engine_config(engine_cfg.for_engine(i), i, cfg.rollout.num_engines),
            f"engine-{i}",
            policy_version=engine_version,
            weights=weights,
            timeouts=cfg.trainer.actor_timeouts,
        )
        for i in range(cfg.rollout.num_engines)
    ]
    return engines, engine_cfg, engine_version


def _launch_teachers(cfg: StreamRLConfig, model_path: str, run_dir: Path) -> list[RayEngineClient]:
    """The distillation teacher's engine actors (none without `[distill]`): its model prepared as the
    student's is (a built-in is built in a child process, cached), checked to read token ids as the
    student does. They are never handed to the weight sync."""
    from streamrl.observability.logs import log_dir
    from streamrl.rollout.teacher import check_same_tokenizer
    from streamrl.streaming.actors.engine import RayEngineClient
    from streamrl.streaming.config import SFTConfig
    from streamrl.streaming.sft import prepare_model

    if cfg.distill is None:
        return []
    teacher_cfg = cfg.model_copy(update={"model": cfg.distill.teacher, "sft": SFTConfig()})
    teacher_path = prepare_model(teacher_cfg, log_file=log_dir(run_dir) / "prepare_teacher.log")
    check_same_tokenizer(model_path, teacher_path)
    engine_cfg = cfg.distill.engine.model_copy(update={"model": teacher_path})
    return [
        RayEngineClient.launch(engine_cfg.for_engine(i), f"teacher-{i}", timeouts=cfg.trainer.actor_timeouts)
        for i in range(cfg.distill.num_engines)
    ]


def engine_start(cfg: StreamRLConfig, state: DriverState, *, from_ckpt: bool) -> tuple[str, str | None, int]:
    """(model folder, weights folder or None, policy_version) the engines start with.

    Without a checkpoint: the run's model at the driver's version. A resume from one: its weights under
    its policy version from the first request (an in-process engine builds from its hf/ folder, a server
    engine loads it into its server first); with LoRA adapter sync the base model instead, as a joining
    engine (`JOINING_VERSION`): `serve_checkpoint_adapter` then publishes the checkpoint's adapter into
    it before any worker starts."""
    from streamrl.learner.config import LoraSync
    from streamrl.streaming.actors.engine import JOINING_VERSION

    if not from_ckpt or state.checkpoint is None:
        return cfg.model, None, state.policy_version
    lora = cfg.learner.lora
    if lora is not None and lora.sync is LoraSync.ADAPTER:
        return cfg.model, None, JOINING_VERSION
    hf = str(Checkpoint(step=state.checkpoint_step, path=Path(state.checkpoint)).hf)
    return hf, hf, state.policy_version


async def serve_checkpoint_adapter(learner: LearnerClient, policy_version: int) -> None:
    """Publish the resumed learner's adapter (restored from the checkpoint) as `policy_version` into
    the engines started on the base model; the run does not start without it."""
    published = await learner.publish()
    if published.policy_version != policy_version:
        raise RuntimeError(
            f"the checkpoint's LoRA adapter (policy_version {policy_version}) could not be loaded into the engines; "
            f"they serve {published.policy_version}, dropped: {published.dropped_engines}"
        )
    logger.info("engines serve the checkpoint's LoRA adapter as policy_version %d", policy_version)


async def _train(cfg: StreamRLConfig, run_dir: Path, state: DriverState | None) -> DriverState:
    from streamrl.streaming.driver import run_async, run_sync
    from streamrl.streaming.heldout import Evaluator

    pipeline = await build_pipeline(cfg, run_dir, state)
    pipeline.evaluator = Evaluator.open(pipeline.cfg, run_dir, pipeline.stream.records)
    try:
        pipeline.evaluator.maybe_start(pipeline)  # the starting policy (a resume goes on with the schedule)
        await (run_async(pipeline) if cfg.trainer.mode == "async" else run_sync(pipeline))
        await pipeline.evaluator.drain()
        await pipeline.write_accounting()  # parks the workers: the engines are left to the last evaluation
        pipeline.evaluator.maybe_start(pipeline, final=True)  # the last weights, also when the prompts ran out early
        await pipeline.evaluator.drain()
    finally:
        await pipeline.evaluator.close()  # a failed run does not wait for its evaluation
        await _settle_checkpoint_on_failure(pipeline)
        pipeline.metrics.close()
        await pipeline.shutdown()
    return pipeline.state


async def _settle_checkpoint_on_failure(pipeline: Pipeline) -> None:
    """A run that failed while a checkpoint was being written records it if the write succeeds (a
    resume then retrains less); a failed write or a lost learner leaves the older records."""
    if pipeline.checkpoint_in_flight is None:
        return
    try:
        await pipeline.settle_checkpoint()
    except Exception:
        logger.exception("the checkpoint written when the run failed could not be recorded")


def finished_already(cfg: StreamRLConfig, run_dir: Path, state: DriverState | None) -> bool:
    """A resumed run that has nothing left to do: every step trained and checkpointed, and the
    end-of-run accounting written at that step (a job killed before it resumes as usual). Resuming
    with a larger `trainer.total_steps` goes on training."""
    if state is None or state.learner_step < cfg.trainer.total_steps or state.checkpoint_step < state.learner_step:
        return False
    try:
        accounting = RunDir(run_dir).accounting_record()
    except ValueError:  # torn by a kill mid-write: redo the end of the run
        return False
    return accounting is not None and accounting["learner_step"] == state.learner_step


def train_main(*, config: str | None, overrides: list[str], resume: str | None) -> int:
    from streamrl.observability.logs import FILE_ONLY, attach_run_log, name_worker_logs, run_summary
    from streamrl.streaming.errors import StreamRLError, explain_failure

    cfg, run_dir, state = open_run(config, overrides, resume)
    if state is not None and finished_already(cfg, run_dir, state):
        print(
            f"{run_dir} already finished at learner step {state.learner_step}/{cfg.trainer.total_steps}; "
            "nothing to resume (raise trainer.total_steps to train further)"
        )
        return 0
    attach_run_log(run_dir)
    from streamrl.streaming.trust import warn_untrusted_code

    warn_untrusted_code(cfg)  # configs are trusted input; code from outside the project is named
    _init_ray(cfg, run_dir)
    try:
        final = asyncio.run(_train(cfg, run_dir, state))
    except Exception as exc:
        why = explain_failure(exc, run_dir)
        if why is None:
            raise
        logger.error("run failed", exc_info=exc, extra=FILE_ONLY)  # traceback to driver.log only
        raise StreamRLError(why) from None
    finally:
        ray.shutdown()
        name_worker_logs(run_dir)
    logger.info("run finished at learner step %d; writing report", final.learner_step)
    from streamrl.observability.report import write_report

    path = write_report(run_dir)
    from streamrl.streaming.heldout import summary_line

    print(
        run_summary(
            run_dir,
            learner_step=final.learner_step,
            total_steps=cfg.trainer.total_steps,
            elapsed_s=final.elapsed_s,
            report=path,
        )
    )
    if (heldout := summary_line(run_dir)) is not None:
        print(heldout)
    if final.learner_step == 0:  # nothing trained is a failure, not a clean end
        from streamrl.streaming.failures import no_steps_message

        message = no_steps_message(cfg.trainer.total_steps)
        logger.error("%s", message, extra=FILE_ONLY)
        print(f"streamrl: error: {message}", file=sys.stderr)
        return 1
    return 0

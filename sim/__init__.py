"""A discrete-event simulator of the streamrl pipeline (docs/simulator.md): engines with continuous
batching, tool latency, the learner and weight syncs, with admission, staleness and group completion
decided by the project's own buffer code. Calibrated from a run's metrics on this machine
(`sim.calibrate`), projected to large clusters with published component costs (`sim.published`),
and used by `streamrl plan` (`sim.plan`)."""

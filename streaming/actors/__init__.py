"""The Ray actors and their typed clients: the only place that hosts a part in Ray.

buffer (`BufferActor`), engine (`EngineActor` + `RayEngineClient`), worker (`RolloutWorkerActor`),
learner (`LearnerActor` + the FSDP-group backend), and `clients` (the typed clients the driver holds).
"""

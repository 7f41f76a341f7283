"""LoRA adapter sync without an engine: what the learner sends (A and B under peft's names), the
manifest that says it is an adapter, the worker's commit that writes it as a peft folder and adds it to
vLLM under the version's name (a fake vLLM worker here; tests/learner/test_lora_adapter_vllm.py runs
the real one), the run config that turns LoRA serving on or refuses engines that cannot serve
adapters, and where engines start on a resume."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file

from streamrl.engines.config import EngineConfig, LoraServing
from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from streamrl.streaming.actors.learner_backends import adapter_spec
from streamrl.streaming.config import StreamRLConfig
from streamrl.streaming.driver_state import DriverState
from streamrl.streaming.train import engine_start
from streamrl.weight_sync.buckets import pack_bucket, plan_buckets
from streamrl.weight_sync.config import SyncTimeouts, TransportKind, WeightSyncConfig
from streamrl.weight_sync.coordinator import WeightSyncCoordinator
from streamrl.weight_sync.types import AdapterSpec, SyncManifest
from tests.weight_sync.fakes import DictWorker, ThreadEngine

pytestmark = pytest.mark.timeout(120)

SPEC = AdapterSpec(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])


def _learner(sync: str) -> TrainingEngine:
    engine = TrainingEngine(
        LearnerConfig(model="tiny", device="cpu", seed=3, lora={"rank": 4, "alpha": 8, "sync": sync})
    )
    with torch.no_grad():
        for name, p in engine.policy.lm.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    return engine


def test_an_adapter_publish_sends_a_and_b_under_peft_names_and_a_merged_one_the_base_names():
    adapter = _learner("adapter")
    sent = dict(adapter.named_parameters_for_sync())
    state = adapter.lora.adapter_state()
    assert sent.keys() == state.keys() and len(sent) == 2 * 7 * 2  # A and B of 7 targets in 2 layers
    assert all(k.startswith("base_model.model.model.layers.") and (".lora_A." in k or ".lora_B." in k) for k in sent)
    for name, tensor in sent.items():
        assert torch.equal(tensor, state[name]) and not tensor.requires_grad
    merged = dict(_learner("merged").named_parameters_for_sync())
    assert "model.layers.0.self_attn.q_proj.weight" in merged and not any("lora_" in k for k in merged)
    assert sum(t.numel() for t in sent.values()) == adapter.lora.num_adapter_params
    assert sum(t.numel() for t in merged.values()) == 112_960  # every weight of the tiny model, 14x the adapter
    assert adapter_spec(adapter.cfg) == AdapterSpec(
        rank=4, alpha=8, target_modules=list(adapter.cfg.lora.target_modules)
    )
    assert adapter_spec(_learner("merged").cfg) is None


def test_the_manifest_carries_the_adapter_spec_through_json():
    tensors = [("base_model.model.x.lora_A.weight", torch.ones(4, 8))]
    manifest = SyncManifest(policy_version=7, buckets=plan_buckets(tensors, 1 << 20), adapter=SPEC)
    assert SyncManifest.from_json(manifest.to_json()) == manifest
    full = SyncManifest(policy_version=7, buckets=plan_buckets(tensors, 1 << 20))
    assert SyncManifest.from_json(full.to_json()).adapter is None


class _FakeWorker(DictWorker):
    """The vLLM worker API the extension relies on for adapters: add/remove/list LoRAs (recorded); a
    full-weight reload lands in `DictWorker.loaded` (and counts in `num_loads`)."""

    vllm_config = SimpleNamespace(model_config=SimpleNamespace(model="/models/base"))

    def __init__(self) -> None:
        super().__init__()
        self.loras: dict[int, object] = {}
        self.calls: list[str] = []

    def add_lora(self, request) -> bool:
        self.calls.append(f"add {request.lora_int_id}")
        self.loras[request.lora_int_id] = request
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(f"remove {lora_id}")
        return self.loras.pop(lora_id, None) is not None

    def list_loras(self) -> set[int]:
        return set(self.loras)


def _stage(worker: _FakeWorker, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
    manifest = SyncManifest(policy_version=version, buckets=plan_buckets(tensors, 256), adapter=SPEC)
    buffers = [pack_bucket(b, dict(tensors), "cpu") for b in manifest.buckets]
    worker._ws_stage(manifest, buffers, [None] * len(buffers), 0)


def test_the_worker_commits_a_staged_adapter_as_a_peft_folder_under_the_version_s_name():
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", torch.randn(4, 64, generator=g)),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", torch.randn(64, 4, generator=g)),
    ]
    worker = _FakeWorker()
    _stage(worker, tensors, 5)
    out = worker.commit_weights(5)
    adapter = out["adapter"]
    assert adapter["name"] == "policy-v5" and adapter["adapter_id"] == 6
    folder = Path(adapter["path"])
    request = worker.loras[6]
    assert request.lora_name == "policy-v5" and request.lora_path == str(folder) and not request.load_inplace
    written = load_file(str(folder / "adapter_model.safetensors"))
    assert written.keys() == dict(tensors).keys()
    for name, tensor in tensors:
        assert torch.equal(written[name], tensor)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == "/models/base" and config["peft_type"] == "LORA"
    with pytest.raises(RuntimeError, match="nothing staged"):
        worker.commit_weights(5)  # staging is freed once the adapter loaded

    _stage(worker, tensors, 5)  # a re-commit of the same version replaces the adapter
    worker.commit_weights(5)
    assert worker.calls == ["remove 6", "add 6", "remove 6", "add 6"]
    assert worker.loaded_adapters() == [6]
    assert worker.unload_adapter(5) and not folder.exists() and worker.loaded_adapters() == []


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "paused"])
@pytest.mark.parametrize("transport", list(TransportKind))
async def test_an_adapter_sync_commits_a_new_adapter_through_every_transport(tmp_path, transport, overlap):
    """The coordinator's real transports and phases into a worker extension: the engine ends up serving
    the adapter under the version's name, the base weights are never reloaded."""
    learner = _learner("adapter")
    tensors = list(learner.named_parameters_for_sync())
    engine = ThreadEngine("e0")
    engine.worker = _FakeWorker()
    timeouts = SyncTimeouts(transfer=20.0, load=10.0, pause=5.0, resume=5.0, verify=5.0)
    config = WeightSyncConfig(
        transport=transport, fs_dir=str(tmp_path / "fs"), overlap=overlap, bucket_bytes=16 * 1024, timeouts=timeouts
    )
    coordinator = WeightSyncCoordinator(config, [engine])
    try:
        for version in (1, 2):
            result = await coordinator.sync(tensors, version, adapter=adapter_spec(learner.cfg))
            assert result.ok, result.error
            assert engine.policy_version == version and engine.worker.num_loads == 0
    finally:
        await coordinator.close()
    assert sorted(engine.worker.loras) == [2, 3]  # v1 and v2: the engine's table decides what goes (vLLM engine)
    written = load_file(str(Path(engine.worker.loras[3].lora_path) / "adapter_model.safetensors"))
    assert written.keys() == dict(tensors).keys()
    for name, tensor in tensors:
        assert torch.equal(written[name], tensor), name


def _run_cfg(**over) -> StreamRLConfig:
    raw = {"learner": {"lora": {"rank": 4, "sync": "adapter"}}}
    for key, value in over.items():
        section, _, field = key.partition("__")
        raw.setdefault(section, {}).setdefault("engine", {})[field] = value
    return StreamRLConfig.model_validate(raw)


def test_the_run_config_serves_adapters_where_the_engine_can_and_refuses_where_it_cannot():
    assert _run_cfg().rollout.engine.lora == LoraServing(max_loras=2, max_lora_rank=8)
    for rank, vllm_rank in ((8, 8), (16, 16), (17, 32)):
        cfg = StreamRLConfig.model_validate({"learner": {"lora": {"rank": rank, "sync": "adapter"}}})
        assert cfg.rollout.engine.lora.max_lora_rank == vllm_rank
    with pytest.raises(ValidationError, match="needs engines that serve LoRA adapters.*'vllm_server'"):
        _run_cfg(
            rollout__backend="vllm_server", rollout__server_urls=["http://127.0.0.1:8000"]
        )  # weight_sync.transport is not even looked at: the adapter refusal comes first
    with pytest.raises(ValidationError, match="needs engines that serve LoRA adapters"):
        _run_cfg(rollout__worker_extension_cls=None)
    with pytest.raises(ValidationError, match="above vLLM's largest max_lora_rank"):
        StreamRLConfig.model_validate({"learner": {"lora": {"rank": 600, "sync": "adapter"}}})
    with pytest.raises(ValidationError, match="max_lora_rank=8 < learner.lora.rank=16"):
        StreamRLConfig.model_validate(
            {
                "learner": {"lora": {"rank": 16, "sync": "adapter"}},
                "rollout": {"engine": {"lora": {"max_lora_rank": 8}}},
            }
        )
    with pytest.raises(ValidationError, match="with a VLM.*drop the vision tower's adapters"):
        _run_cfg(rollout__max_images_per_prompt=1)
    with pytest.raises(ValidationError, match="publish_lag=1 is not built"):
        StreamRLConfig.model_validate(
            {
                "learner": {"lora": {"rank": 4, "sync": "adapter"}},
                "weight_sync": {"publish_lag": 1},
                "trainer": {"mode": "sync", "sync_every": 1},
            }
        )
    with pytest.raises(ValidationError, match='only learner.lora.sync = "adapter" sends'):
        StreamRLConfig.model_validate({"rollout": {"engine": {"lora": {}}}})
    assert StreamRLConfig.model_validate({"learner": {"lora": {"rank": 4}}}).rollout.engine.lora is None  # merged


def test_the_engine_config_refuses_lora_serving_it_cannot_do():
    with pytest.raises(ValidationError, match="needs backend"):
        EngineConfig(backend="sglang_server", server_urls=["http://127.0.0.1:1"], lora={})
    with pytest.raises(ValidationError, match="greater than or equal to 2"):
        LoraServing(max_loras=1)
    with pytest.raises(ValidationError, match="must be one of"):
        LoraServing(max_lora_rank=4)


def test_a_resume_with_adapter_sync_starts_the_engines_on_the_base_model_as_joining(tmp_path):
    merged = StreamRLConfig.model_validate({"model": "/m/base", "learner": {"lora": {"rank": 4}}})
    adapter = _run_cfg().model_copy(update={"model": "/m/base"})
    state = DriverState(policy_version=6, checkpoint=str(tmp_path / "step_3"), checkpoint_step=3)
    assert engine_start(adapter, state, from_ckpt=True) == ("/m/base", None, -1)  # JOINING_VERSION
    hf = engine_start(merged, state, from_ckpt=True)
    assert hf[0] == hf[1] and hf[0].startswith(str(tmp_path / "step_3")) and hf[2] == 6
    assert engine_start(adapter, state, from_ckpt=False) == ("/m/base", None, 6)

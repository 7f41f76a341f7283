"""LoRA training with merged-weight sync (`learner.lora`): only the adapter (and PPO's value head)
trains, the merged weights are W + B·A·α/r under the base names and score tokens as the LoRA model
does, the step composes with checkpointing, micro-batching, shared prefixes and every correction,
checkpoints restore the adapter exactly (inline and in the background), and bad configs are refused.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from streamrl.learner.config import LearnerConfig
from streamrl.learner.engine import TrainingEngine
from tests.learner.helpers import padded_batch
from tests.learner.test_checkpoint import _files, _gated_writes
from tests.learner.test_engine import _batch
from tests.learner.test_shared_prefix import (
    _assert_same_grads,
    _assert_same_losses,
    _capture_grads,
    _near_policy,
    group_batch,
)

pytestmark = pytest.mark.timeout(300)

LAYER = "model.layers.0.self_attn.q_proj"


def _cfg(**kw) -> LearnerConfig:
    base = dict(model="tiny", device="cpu", lr=1e-2, micro_batch_tokens=64, seed=3, lora={"rank": 4, "alpha": 8})
    base.update(kw)
    return LearnerConfig(**base)


def _engine(seed_b: int | None = 0, **kw) -> TrainingEngine:
    """A LoRA engine whose B matrices are drawn (seeded) instead of zero, so the adapter has a delta and
    A a gradient from the first step."""
    engine = TrainingEngine(_cfg(**kw))
    if seed_b is not None:
        g = torch.Generator().manual_seed(seed_b)
        with torch.no_grad():
            for name, p in engine.policy.lm.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return engine


def _base(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.policy.lm.named_parameters() if not p.requires_grad}


# ---- what trains -----------------------------------------------------------------------------------


def test_only_the_adapter_and_the_value_head_train_and_the_base_stays_put():
    engine = _engine(algo="ppo", gradient_checkpointing=True)
    adapter = {n for n, p in engine.policy.named_parameters() if p.requires_grad}
    assert adapter and all(".lora_A." in n or ".lora_B." in n or n.startswith("value_head.") for n in adapter)
    assert {"value_head.weight", "value_head.bias"} <= adapter
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for n, p in engine.policy.named_parameters() if n in adapter}
    # gradient checkpointing with a frozen trunk: the embeddings' output carries the gradient in
    ids = torch.tensor([[5, 6, 7]])
    assert engine.policy.lm.get_input_embeddings()(ids).requires_grad
    base, before = _base(engine), {n: p.detach().clone() for n, p in engine.policy.named_parameters()}
    grads = _capture_grads(engine)
    engine.train_step(_batch())
    assert set(grads[0]) <= adapter and any(".lora_A." in n for n in grads[0])
    after = _base(engine)
    assert base.keys() == after.keys() and all(torch.equal(base[n], after[n]) for n in base)
    moved = [n for n, p in engine.policy.named_parameters() if not torch.equal(p, before[n])]
    assert moved and set(moved) <= adapter


# ---- the merged weights ----------------------------------------------------------------------------


def test_sync_sends_base_plus_the_scaled_low_rank_delta_under_the_base_names():
    engine = _engine()
    engine.train_step(_batch())
    live = dict(engine.policy.lm.named_parameters())
    synced = dict(engine.named_parameters_for_sync())
    full = TrainingEngine(LearnerConfig(model="tiny", device="cpu"))
    assert list(synced) == list(dict(full.named_parameters_for_sync()))  # a full fine-tune's names, in order
    w, a, b = (live[f"{LAYER}.{k}"] for k in ("base_layer.weight", "lora_A.default.weight", "lora_B.default.weight"))
    by_hand = w + b @ a * (8.0 / 4)
    assert torch.allclose(synced[f"{LAYER}.weight"], by_hand, rtol=0, atol=1e-7)
    assert not torch.allclose(synced[f"{LAYER}.weight"], w)  # the adapter moved it
    assert torch.equal(synced[f"{LAYER}.bias"], live[f"{LAYER}.base_layer.bias"])
    embed = "model.embed_tokens.weight"
    assert synced[embed].data_ptr() == live[embed].data_ptr()  # untouched weights are sent as they are


def test_a_vision_language_model_syncs_the_names_of_its_full_fine_tune():
    engine = TrainingEngine(LearnerConfig(model="tiny-vlm", device="cpu", lora={"rank": 4}))
    full = TrainingEngine(LearnerConfig(model="tiny-vlm", device="cpu"))
    assert [n for n, _ in engine.named_parameters_for_sync()] == [n for n, _ in full.named_parameters_for_sync()]
    assert {path.split(".")[1] for path in engine.lora.layers} == {"text_model", "vision_model"}


def _merged_model(engine: TrainingEngine):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine.model_path, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(dict(engine.named_parameters_for_sync()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    return model.eval()


def test_the_merged_model_scores_tokens_as_the_lora_model():
    engine = _engine()
    engine.train_step(_batch())
    merged = _merged_model(engine)
    ids = torch.randint(10, 400, (3, 11), generator=torch.Generator().manual_seed(1))
    engine.policy.lm.eval()
    with torch.no_grad():
        lora_logits, merged_logits = engine.policy.lm(ids).logits, merged(ids).logits
    assert torch.allclose(lora_logits, merged_logits, rtol=1e-5, atol=1e-5)
    base = TrainingEngine(LearnerConfig(model="tiny", device="cpu")).policy.lm.eval()
    with torch.no_grad():
        assert not torch.allclose(base(ids).logits, lora_logits, atol=1e-3)  # the adapter changed the policy


def test_a_lora_step_has_the_loss_of_the_full_model_with_the_merged_weights():
    lora = _engine(algo="ppo", correction={"mode": "tis"})
    lora.train_step(_batch())
    full = TrainingEngine(_cfg(lora=None, algo="ppo", correction={"mode": "tis"}))
    full.policy.lm.load_state_dict(dict(lora.named_parameters_for_sync()), strict=False)
    full.policy.value_head.load_state_dict(lora.policy.value_head.state_dict())
    batch = _batch(versions=(1, 0, 1, 1), seed=2)
    assert torch.allclose(lora.compute_logprobs(batch), full.compute_logprobs(batch), atol=1e-5)
    full.policy_version = lora.policy_version
    ml, mf = lora.train_step(batch), full.train_step(batch)
    for key in ("learner/loss", "learner/pg_loss", "learner/value_loss", "learner/entropy", "is/ratio_mean"):
        assert ml[key] == pytest.approx(mf[key], rel=1e-5, abs=1e-7), key


def test_save_hf_writes_the_merged_model(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    engine = _engine()
    engine.train_step(_batch())
    out = engine.save_hf(tmp_path / "hf")
    saved = load_file(out / "model.safetensors")
    synced = dict(engine.named_parameters_for_sync())
    assert set(saved) == set(synced) and all(torch.equal(saved[k], synced[k]) for k in saved)
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # a plain HF model: what vLLM and eval load
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        ref = reloaded(ids).logits.log_softmax(-1)[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    batch = padded_batch([([5, 6], [7, 8], [1, 1])], rewards=[0.0], group_index=[0])
    assert torch.allclose(engine.compute_logprobs(batch)[0, 1:], ref, atol=1e-5)


# ---- the step composes with the learner's options --------------------------------------------------


def _step_pair(first: dict, second: dict, **common) -> tuple[tuple[dict, list], tuple[dict, list]]:
    """One step of two LoRA engines (same adapter) on the same grouped batch: (metrics, grads) of each."""
    base = dict(micro_batch_tokens=4096, logits_chunk_tokens=16, shuffle_minibatches=False, **common)
    engines = [_engine(**(base | first)), _engine(**(base | second))]
    batch = _near_policy(engines[0], group_batch(engines[0].policy.lm.config.vocab_size))
    tb = engines[1].to_train_batch(batch)
    if engines[1].shared_prefix:
        assert any(p.is_shared for p in engines[1].train_micro_batches(tb, torch.arange(tb.batch_size)))
    out = []
    for engine in engines:
        engine.policy_version = 2
        grads = _capture_grads(engine)
        out.append((engine.train_step(batch), grads))
    return out[0], out[1]


@pytest.mark.parametrize("mode", ["none", "tis", "decoupled", "masked", "m2po"])
def test_shared_prefix_gives_the_dense_lora_step_for_every_correction(mode):
    common = dict(correction={"mode": mode}, clip_low=0.1, clip_high=0.1)
    (md, gd), (ms, gs) = _step_pair(dict(shared_prefix=False), dict(shared_prefix=True), **common)
    _assert_same_losses(md, ms)
    _assert_same_grads(gd, gs)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (dict(shared_prefix=False), dict(shared_prefix=True, gradient_checkpointing=True, micro_batch_tokens=40)),
        (dict(shared_prefix=False), dict(shared_prefix=False, gradient_checkpointing=True, micro_batch_tokens=24)),
        (dict(logits_chunk_tokens=0), dict(logits_chunk_tokens=16, gradient_checkpointing=True)),
        (dict(algo="ppo", shared_prefix=False), dict(algo="ppo", gradient_checkpointing=True, micro_batch_tokens=48)),
    ],
    ids=["shared-checkpointed-chunked-groups", "dense-checkpointed-microbatched", "lm-head-chunks", "ppo"],
)
def test_checkpointing_micro_batching_and_head_chunks_leave_the_lora_step_unchanged(first, second):
    (m1, g1), (m2, g2) = _step_pair(first, second)
    _assert_same_losses(m1, m2)
    if "learner/value_loss" in m1:
        assert m2["learner/value_loss"] == pytest.approx(m1["learner/value_loss"], rel=1e-5, abs=1e-8)
    _assert_same_grads(g1, g2)
    assert all(".lora_" in n or n.startswith("value_head.") for n in g1[0])


# ---- checkpoints -----------------------------------------------------------------------------------


def _adapter(engine: TrainingEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.lora.adapter_state().items()}


def test_a_checkpoint_restores_the_adapter_and_optimizer_exactly(tmp_path):
    first = _engine(algo="ppo", num_minibatches=2)
    first.train_step(_batch())
    first.save_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter.pt").is_file()
    expected = first.train_step(_batch(versions=(1, 0, 1, 1), seed=2))

    resumed = _engine(seed_b=7, algo="ppo", num_minibatches=2)  # another adapter until the load
    resumed.load_checkpoint(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / "adapter.pt", weights_only=True)
    got_adapter = _adapter(resumed)
    assert saved.keys() == got_adapter.keys() and all(torch.equal(saved[k], got_adapter[k]) for k in saved)
    so, lo = torch.load(tmp_path / "ckpt" / "optimizer.pt", weights_only=True), resumed.optimizer.state_dict()
    assert so["param_groups"] == lo["param_groups"] and so["state"].keys() == lo["state"].keys()
    assert all(torch.equal(v, lo["state"][i][k]) for i, s in so["state"].items() for k, v in s.items())
    got = resumed.train_step(_batch(versions=(1, 0, 1, 1), seed=2))
    assert got["learner/loss"] == expected["learner/loss"] and got["learner/grad_norm"] == expected["learner/grad_norm"]
    a, b = dict(first.named_parameters_for_sync()), dict(resumed.named_parameters_for_sync())
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_checkpoint_hf_folder_is_the_merged_model(tmp_path):
    from safetensors.torch import load_file

    engine = _engine()
    engine.train_step(_batch())
    engine.save_checkpoint(tmp_path / "ckpt")
    saved = load_file(tmp_path / "ckpt" / "hf" / "model.safetensors")
    synced = dict(engine.named_parameters_for_sync())
    assert set(saved) == set(synced) and all(torch.equal(saved[k], synced[k]) for k in saved)


def test_a_background_lora_checkpoint_equals_the_inline_one(tmp_path, monkeypatch):
    engine = _engine()
    engine.train_step(_batch())
    engine.save_checkpoint(tmp_path / "inline")
    gate, _ = _gated_writes(monkeypatch)
    engine.start_checkpoint(tmp_path / "background")
    engine.train_step(_batch())  # moves the adapter and the optimizer state while the write waits
    gate.set()
    assert engine.finish_checkpoint() == str(tmp_path / "background")
    assert _files(tmp_path / "background") == _files(tmp_path / "inline")
    engine.save_checkpoint(tmp_path / "later")
    assert _files(tmp_path / "later")["adapter.pt"] != _files(tmp_path / "inline")["adapter.pt"]


def test_a_snapshot_shares_no_storage_with_the_live_model(tmp_path):
    from streamrl.learner.checkpoint import take_snapshot

    engine = _engine()
    engine.train_step(_batch())
    snap = take_snapshot(engine.train_state(), tmp_path / "ckpt")
    assert snap is not None and snap.adapter_state is not None
    live = {t.untyped_storage().data_ptr() for t in engine.policy.state_dict().values()}
    live |= {t.untyped_storage().data_ptr() for s in engine.optimizer.state.values() for t in s.values()}
    copies = [*snap.lm_state.values(), *snap.adapter_state.values()]
    copies += [t for s in snap.optimizer_state["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert copies and not any(t.untyped_storage().data_ptr() in live for t in copies)
    embed, head = snap.lm_state["model.embed_tokens.weight"], snap.lm_state["lm_head.weight"]
    assert embed.data_ptr() == head.data_ptr()  # tied weights stay tied in the copy


def test_a_resume_on_another_base_or_without_lora_is_refused(tmp_path):
    engine = _engine()
    engine.train_step(_batch())
    engine.save_checkpoint(tmp_path / "lora")
    other = _engine()
    with torch.no_grad():
        other.policy.lm.get_submodule(f"{LAYER}.base_layer").weight.add_(1e-2)
    with pytest.raises(ValueError, match="do not merge"):
        other.load_checkpoint(tmp_path / "lora")
    with pytest.raises(ValueError, match="disagree on LoRA"):
        TrainingEngine(LearnerConfig(model="tiny", device="cpu", seed=3)).load_checkpoint(tmp_path / "lora")
    full = TrainingEngine(LearnerConfig(model="tiny", device="cpu", seed=3))
    full.save_checkpoint(tmp_path / "full")
    with pytest.raises(ValueError, match="disagree on LoRA"):
        _engine().load_checkpoint(tmp_path / "full")
    wider = TrainingEngine(_cfg(lora={"rank": 8}))
    with pytest.raises(ValueError, match="does not fit learner.lora"):
        wider.load_checkpoint(tmp_path / "lora")


# ---- config ----------------------------------------------------------------------------------------


def test_config_refuses_what_is_not_built():
    with pytest.raises(ValidationError, match="num_workers=2 is not built"):
        _cfg(num_workers=2)
    with pytest.raises(ValidationError, match="extra"):
        _cfg(lora={"r": 8})
    with pytest.raises(ValidationError, match="greater than 0"):
        _cfg(lora={"rank": 0})
    assert _cfg().lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert LearnerConfig().lora is None  # full fine-tuning unless asked


def test_an_unknown_or_tied_target_module_is_refused_with_the_model_s_names():
    with pytest.raises(ValueError, match=r"\['qkv_proj'\] name no nn.Linear layer .*'q_proj'"):
        TrainingEngine(_cfg(lora={"target_modules": ["q_proj", "qkv_proj"]}))
    with pytest.raises(ValueError, match="tied to the input embeddings"):
        TrainingEngine(_cfg(lora={"target_modules": ["lm_head"]}))


def test_preflight_counts_adapter_moments_only():
    from streamrl.models.dims import lora_params, lora_target_params, model_dims
    from streamrl.streaming.config import StreamRLConfig
    from streamrl.streaming.preflight import estimate_parts

    dims, targets = model_dims("tiny"), ["q_proj", "v_proj", "down_proj"]
    engine = TrainingEngine(_cfg(lora={"rank": 4, "target_modules": targets}))
    assert lora_params(dims, 4, targets) == engine.lora.num_adapter_params
    target_weights = sum(layer.base_layer.weight.numel() for layer in engine.lora.layers.values())
    assert lora_target_params(dims, targets) == target_weights

    def parts(**lora) -> dict[str, int]:
        cfg = StreamRLConfig.model_validate({"learner": {"lora": lora or None}, "trainer": {"async_checkpoint": True}})
        return {p.name: p.bytes for p in estimate_parts(cfg, dims)}

    def weights(**lora) -> tuple[int, int]:
        found = parts(**lora)
        return found["learner weights+grads+AdamW"], found["learner checkpoint snapshot"]

    adapter = lora_params(dims, 16, list(_cfg().lora.target_modules))
    assert weights() == (16 * dims.num_params, 12 * dims.num_params)
    assert weights(rank=16) == (4 * dims.num_params + 16 * adapter, 4 * dims.num_params + 8 * adapter)
    assert parts(rank=4, target_modules=targets)["learner merged LoRA weights"] == 4 * target_weights
    assert "learner merged LoRA weights" not in parts()

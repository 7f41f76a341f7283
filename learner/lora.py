"""LoRA on the policy LM: the adapter trains, the base weights stay frozen, and what leaves the
learner — the weights a publish sends, an HF export, a checkpoint's `hf/` — is the merged model.

`LoraAdapter(lm, cfg)` injects peft's LoRA layers into `lm` in place (`peft.get_peft_model`): each
target nn.Linear becomes a `lora.Linear` whose `base_layer` is the original layer, frozen, beside the
adapter `lora_A` [r, in] and `lora_B` [out, r] (B starts at zero, so the merged model starts as the
base). Its forward is W·x + B·A·dropout(x)·α/r. `PolicyModel.lm` stays the HF model, so the decoder,
the LM head (chunked or fused; it is not a target and frozen, so the fused head skips its weight
gradient), the packed shared-prefix forward and gradient checkpointing run the modules they run in a
full fine-tune; the value head lives outside `lm` and trains as before. peft also makes the input
embeddings' output require grad when the model checkpoints its layers (`enable_input_require_grads`):
with every weight below the first adapter frozen, nothing else would carry a gradient into them.

Inside `lm` the names change (`...q_proj.base_layer.weight`, `...q_proj.lora_A.default.weight`);
`merged` maps them back: every base tensor under its HF name, a target's weight as W + B·A·α/r,
adapter tensors left out — what a full fine-tune with those weights would send, so the engines, the
weight-sync transports and vLLM's loader see no difference. A merged weight is computed per tensor
from the live W and adapter, never by merging in place: W + Δ − Δ is not W in floating point, and
the frozen base must stay exactly the weights the run started from.

With `learner.lora.sync = "adapter"` a publish sends `adapter_state()` instead: A and B of every target
under peft's names (`base_model.model.<path>.lora_A.weight`), the names a saved peft adapter holds and
vLLM's LoRA loader reads; the engines add the base weights they already serve.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from streamrl.learner.config import LoraConfig

ADAPTER = "default"  # peft's adapter name; one adapter per policy
_BASE = ".base_layer."


def check_targets(lm: PreTrainedModel, targets: Iterable[str]) -> None:
    """ValueError unless every target names nn.Linear layers of `lm` (by the last part of their module
    name, as peft matches a plain name) and none is an LM head tied to the input embeddings."""
    linears = {name.rpartition(".")[2]: module for name, module in lm.named_modules() if isinstance(module, nn.Linear)}
    missing = [t for t in targets if t not in linears]
    if missing:
        raise ValueError(
            f"learner.lora.target_modules {missing} name no nn.Linear layer of {type(lm).__name__}; "
            f"its Linear layers are named {sorted(linears)}"
        )
    head = lm.get_output_embeddings()
    tied = getattr(lm.config, "tie_word_embeddings", False)
    for target in targets:
        if tied and head is not None and linears[target] is head:
            raise ValueError(
                f"learner.lora.target_modules names {target!r}, the LM head, whose weight is tied to the input "
                "embeddings: a merged head would differ from the embedding it shares its weight with"
            )


class LoraAdapter:
    """The LoRA adapter of one policy LM (module doc): its parameters, the merged weights, and the
    adapter's state for checkpoints."""

    def __init__(self, lm: PreTrainedModel, cfg: LoraConfig) -> None:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer

        check_targets(lm, cfg.target_modules)
        self.cfg = cfg
        self.lm = lm
        peft_cfg = PeftLoraConfig(
            r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=list(cfg.target_modules)
        )
        # freezes every weight of `lm` but the adapter's; `lm` itself is modified in place
        self.peft = get_peft_model(lm, peft_cfg, adapter_name=ADAPTER)
        self.layers: dict[str, LoraLinear] = {n: m for n, m in lm.named_modules() if isinstance(m, LoraLinear)}
        # every target is an nn.Linear (`check_targets`), so every adapter layer is a LoRA Linear
        assert len(self.layers) == sum(isinstance(m, LoraLayer) for m in lm.modules()), "a non-Linear LoRA layer"
        self.adapter_names = frozenset(
            f"{path}.{name}"
            for path, layer in self.layers.items()
            for name, _ in layer.named_parameters()
            if not name.startswith("base_layer.")
        )

    @property
    def num_adapter_params(self) -> int:
        return sum(p.numel() for n, p in self.lm.named_parameters() if n in self.adapter_names)

    def merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """`named` (`lm.named_parameters()` or `lm.state_dict().items()`) as the base model's entries:
        adapter tensors dropped, `x.base_layer.y` renamed `x.y`, a target's weight merged (a new tensor,
        detached; every other tensor is passed through as given)."""
        for name, tensor in named:
            if name in self.adapter_names:
                continue
            path, base, leaf = name.partition(_BASE)
            if not base or path not in self.layers:
                yield name, tensor
                continue
            if leaf == "weight":
                with torch.no_grad():
                    tensor = tensor.detach() + self.layers[path].get_delta_weight(ADAPTER)
            yield f"{path}.{leaf}", tensor

    def merged_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every parameter of the base model, targets merged, tied weights once:
        exactly the names and values `named_parameters()` gives for the merged model."""
        for name, tensor in self.merged(self.lm.named_parameters()):
            yield name, tensor.detach()

    def merged_state_dict(self) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """The merged model's state dict with its merged entries on CPU, computed one at a time (one
        weight's delta on the device at once), and the names of those entries (new tensors; the rest
        are the live frozen ones)."""
        state: dict[str, torch.Tensor] = {}
        fresh: set[str] = set()
        for name, tensor in self.merged(self.lm.state_dict().items()):
            if name.endswith(".weight") and name.removesuffix(".weight") in self.layers:
                tensor = tensor.to("cpu")
                fresh.add(name)
            state[name] = tensor
        return state, frozenset(fresh)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's weights in peft's format (`get_peft_model_state_dict`: live tensors)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft, adapter_name=ADAPTER)

    def adapter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(peft name, tensor) of every A and B, detached: what an adapter sync sends (module doc)."""
        for name, tensor in self.adapter_state().items():
            yield name, tensor.detach()

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy `adapter_state()`'s output into the adapter; ValueError when it is not this adapter's."""
        from peft import set_peft_model_state_dict

        expected = self.adapter_state()
        shapes = {k: tuple(v.shape) for k, v in expected.items()}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if got != shapes:
            missing, unexpected = sorted(shapes.keys() - got.keys()), sorted(got.keys() - shapes.keys())
            wrong = sorted(k for k in shapes.keys() & got.keys() if shapes[k] != got[k])
            raise ValueError(
                f"the checkpoint's adapter does not fit learner.lora (rank {self.cfg.rank}, targets "
                f"{self.cfg.target_modules}): missing {missing[:4]}, unexpected {unexpected[:4]}, "
                f"other shape {wrong[:4]}"
            )
        set_peft_model_state_dict(self.peft, state, adapter_name=ADAPTER)

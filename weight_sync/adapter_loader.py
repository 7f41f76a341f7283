"""Engine side of a LoRA adapter sync: the staged A and B matrices become a new vLLM adapter.

Mixed into the vLLM worker with `WeightSyncWorkerExtension` (it relies on the worker's `rank`,
`add_lora`, `remove_lora` and `list_loras`, vLLM's worker LoRA API). A sync stages an adapter exactly
as it stages full weights (the same buckets and checksums); its commit writes the checksummed tensors
as a peft adapter folder (`adapter_config.json` + `adapter_model.safetensors`, a few MB) under this
worker's adapter root and adds it through `add_lora` with the version's name and id
(`weight_sync.types.adapter_name` / `adapter_id`). vLLM loads LoRA adapters only from a folder; the
folder stays until the adapter is unloaded, so vLLM can reload it from there should its own LRU cache
ever drop it (the engine keeps the number of adapters below that cache's capacity, so it does not).
Which adapter may be unloaded when is the engine's decision (`engines.adapters.AdapterTable`);
`unload_adapter` only carries it out.
"""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamrl.weight_sync.types import adapter_id, adapter_name

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch

    from streamrl.weight_sync.types import AdapterSpec

logger = logging.getLogger(__name__)


class AdapterLoaderExtension:
    """Mixin for vLLM workers started with `enable_lora` (see the module doc)."""

    _lora_root: Path | None = None

    def _adapter_dir(self, policy_version: int) -> Path:
        if self._lora_root is None:
            rank = int(getattr(self, "rank", 0))
            self._lora_root = Path(tempfile.mkdtemp(prefix=f"streamrl-lora-rank{rank}-"))
            atexit.register(shutil.rmtree, self._lora_root, True)
        return self._lora_root / adapter_name(policy_version)

    def load_adapter(
        self, policy_version: int, spec: AdapterSpec, tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> dict[str, Any]:
        """Serve `tensors` (peft names) as the adapter of `policy_version`: replaces an adapter of that
        version already loaded (a re-commit). Returns the adapter's name, id and folder."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        folder = self._adapter_dir(policy_version)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        # staged tensors are views into one flat bucket: safetensors needs each in its own storage
        save_file({name: t.contiguous().clone() for name, t in tensors}, str(folder / "adapter_model.safetensors"))
        base = str(self.vllm_config.model_config.model)  # type: ignore[attr-defined]
        (folder / "adapter_config.json").write_text(json.dumps(spec.peft_config(base)))
        request = LoRARequest(
            lora_name=adapter_name(policy_version), lora_int_id=adapter_id(policy_version), lora_path=str(folder)
        )
        self.remove_lora(request.lora_int_id)  # type: ignore[attr-defined]
        if not self.add_lora(request):  # type: ignore[attr-defined]
            raise RuntimeError(f"vLLM did not add adapter {request.lora_name} from {folder}")
        return {"name": request.lora_name, "adapter_id": request.lora_int_id, "path": str(folder)}

    def unload_adapter(self, policy_version: int) -> bool:
        """Remove the adapter of `policy_version` from vLLM and delete its folder; returns whether vLLM
        held it. Only called for an adapter no request names any more (the engine's `AdapterTable`)."""
        removed = bool(self.remove_lora(adapter_id(policy_version)))  # type: ignore[attr-defined]
        shutil.rmtree(self._adapter_dir(policy_version), ignore_errors=True)
        logger.info("unloaded adapter %s (held: %s)", adapter_name(policy_version), removed)
        return removed

    def loaded_adapters(self) -> list[int]:
        """vLLM's ids of the adapters this worker holds, sorted."""
        return sorted(self.list_loras())  # type: ignore[attr-defined]

"""Lightning's ``DeepSpeedStrategy`` and ``FSDPStrategy`` (FSDP1) on CPU gloo ranks, for tests only.

Both strategies refuse a CPU accelerator; these subclasses change only the device checks:

- :class:`CPUDeepSpeedStrategy` skips the "only supported on CUDA GPUs" check of ``setup_environment`` and
  gives its devices an index (``cpu:<local rank>``), which DeepSpeed's engine and Lightning's check
  that device indices match local ranks both read.
  Under a CPU accelerator DeepSpeed itself uses gloo (its accelerator is settled when it is imported).
- :class:`CPUFSDPStrategy` wraps the model with ``device_id=torch.device("cpu")`` (Lightning passes
  ``root_device.index``, ``None`` on CPU, which FSDP1 refuses) and lets Lightning's ``_setup_model`` take
  it from there (it leaves a model already wrapped alone). The accelerator connector's GPU check
  compares ``type(strategy) is FSDPStrategy``, so a subclass passes it as is.

Everything else (the engine, its optimizer, sharding, gradient reduction) is Lightning's own.
"""

from __future__ import annotations

import torch
from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy
from pytorch_lightning.strategies.ddp import DDPStrategy
from torch import nn

__all__ = ["CPUDeepSpeedStrategy", "CPUFSDPStrategy"]


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` without its CUDA-only check (test only)."""

    strategy_name = "deepspeed_cpu_test"

    def setup_environment(self) -> None:
        # ``cpu:<local rank>``: DeepSpeed's engine and Lightning's device-index check read the index.
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices or ()))]
        DDPStrategy.setup_environment(self)  # DeepSpeedStrategy's own only adds the CUDA check


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` (FSDP1) wrapping on CPU with ``device_id=torch.device("cpu")`` (test only)."""

    strategy_name = "fsdp_cpu_test"

    def _setup_model(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
        return super()._setup_model(model)

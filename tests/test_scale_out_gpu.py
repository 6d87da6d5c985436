"""GPU only (skipped without CUDA; with CUDA, a missing DeepSpeed is an error): DeepSpeed's bf16 mode casts the
parameters to bf16, DDP's autocast keeps them in fp32; with the recurrent ops' gate and decay arithmetic in fp32
either way, the losses agree to bf16 precision."""

import pytest
from gpu_helpers import require_gpu
from test_scale_out import base_config, losses, train

require_gpu("deepspeed")


@pytest.mark.parametrize("mixer", ["gated_deltanet", "mesa"])
def test_deepspeed_bf16_matches_ddp_autocast(kjv_data, tmp_path, mixer):
    config = base_config(tmp_path, kjv_data)
    common = ["--model.mixer", mixer, "--strategy.accelerator", "gpu", "--strategy.devices", "1",
              "--strategy.precision", "bf16-mixed", "--data.micro_batch", "4"]
    train(config, tmp_path / "ddp", *common, "--strategy.name", "ddp")
    train(config, tmp_path / "deepspeed", *common, "--strategy.name", "deepspeed", "--strategy.zero_stage", "2")
    assert losses(tmp_path / "deepspeed") == pytest.approx(losses(tmp_path / "ddp"), rel=2e-2)

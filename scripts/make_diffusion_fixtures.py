"""Regenerates crates/tessera-cli/tests/fixtures/diffusers_unet/ (run by scripts/make-diffusion-fixtures.sh).

- sd15/config.json, sd2/config.json: the published UNet configs of Stable Diffusion 1.5
  (runwayml/stable-diffusion-v1-5, unet/config.json) and 2 (stabilityai/stable-diffusion-2-base,
  unet/config.json), reproduced here; parameter_counts.json: diffusers' own count of each
  (`sum(p.numel() for p in UNet2DConditionModel.from_config(cfg).parameters())`, built on the
  meta device, so no weights are made).
- tiny_sd2/, tiny_sd15/: small `UNet2DConditionModel`s written by `save_pretrained`
  (config.json + diffusion_pytorch_model.safetensors) in SD 2's style (linear projections, a
  head count per block) and SD 1.5's (1x1-conv projections, one head count), with
  inputs.safetensors (sample, timestep, encoder_hidden_states, target) and
  outputs.safetensors: `sample` (the model's prediction), `loss` (F.mse_loss of the prediction
  against target, as diffusers' training scripts) and `grad.<name>` for every parameter.
- versions.json: the library versions used.

Deterministic (seeded, CPU, float32): a re-run writes identical bytes.
"""
import json
import os
import sys

import diffusers
import safetensors
import safetensors.torch
import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel

OUT = sys.argv[1] if len(sys.argv) > 1 else "crates/tessera-cli/tests/fixtures/diffusers_unet"

SD_DOWN = ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]
SD_UP = ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]

SD15 = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": SD_DOWN,
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": SD_UP,
}

SD2 = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.10.0.dev0",
    "act_fn": "silu",
    "attention_head_dim": [5, 10, 20, 20],
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 1024,
    "down_block_types": SD_DOWN,
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": SD_UP,
    "use_linear_projection": True,
}

TINY = {
    "tiny_sd2": dict(
        block_out_channels=[8, 16],
        down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
        up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
        attention_head_dim=[1, 2],
        use_linear_projection=True,
    ),
    "tiny_sd15": dict(
        block_out_channels=[8, 16],
        down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
        up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"],
        attention_head_dim=2,
        use_linear_projection=False,
    ),
}


def write_json(path, value):
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")


def count(cfg):
    with torch.device("meta"):
        model = UNet2DConditionModel.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def tiny(name, arch, seed):
    torch.manual_seed(seed)
    model = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        norm_num_groups=4,
        cross_attention_dim=8,
        **arch,
    ).float()
    # Perturb every parameter so no zero-initialised or identity weight hides a mistake.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d = os.path.join(OUT, name)
    model.save_pretrained(d, safe_serialization=True)
    batch, tokens = 2, 5
    g = torch.Generator().manual_seed(seed + 1)
    inputs = {
        "sample": torch.randn(batch, 4, 8, 8, generator=g),
        "timestep": torch.tensor([7.0, 421.0]),
        "encoder_hidden_states": torch.randn(batch, tokens, 8, generator=g),
        "target": torch.randn(batch, 4, 8, 8, generator=g),
    }
    model.zero_grad()
    pred = model(inputs["sample"], inputs["timestep"], inputs["encoder_hidden_states"]).sample
    loss = F.mse_loss(pred.float(), inputs["target"].float(), reduction="mean")
    loss.backward()
    outputs = {"sample": pred.detach().contiguous(), "loss": loss.detach().reshape([])}
    for n, p in model.named_parameters():
        outputs["grad." + n] = p.grad.detach().contiguous()
    safetensors.torch.save_file(inputs, os.path.join(d, "inputs.safetensors"))
    safetensors.torch.save_file(outputs, os.path.join(d, "outputs.safetensors"))
    return sum(p.numel() for p in model.parameters())


def main():
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    os.makedirs(OUT, exist_ok=True)
    counts = {}
    for name, cfg in [("sd15", SD15), ("sd2", SD2)]:
        os.makedirs(os.path.join(OUT, name), exist_ok=True)
        write_json(os.path.join(OUT, name, "config.json"), cfg)
        counts[name] = count(cfg)
    for i, (name, arch) in enumerate(TINY.items()):
        counts[name] = tiny(name, arch, seed=10 * i)
    write_json(os.path.join(OUT, "parameter_counts.json"), counts)
    write_json(
        os.path.join(OUT, "versions.json"),
        {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "safetensors": safetensors.__version__,
        },
    )


if __name__ == "__main__":
    main()

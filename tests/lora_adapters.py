"""LoRA adapters made in the tests with PEFT (`init_lora_weights=False`, a fixed seed: both factors
random, so each adapter changes the output), and the reference: transformers + PEFT at float32."""

from __future__ import annotations

import json
from pathlib import Path

# name -> (rank, targets, seed): ranks and targets differ, the MLP's projections and attention's.
ADAPTERS = {
    "sql": (8, ["q_proj", "v_proj"], 1),
    "chat": (16, ["q_proj", "k_proj", "v_proj", "o_proj"], 2),
    "mlp": (4, ["gate_proj", "up_proj", "down_proj"], 3),
}


def make_adapter(base_dir: str | Path, out_dir: str | Path, rank: int, targets: list[str], seed: int) -> Path:
    """A PEFT LoRA directory for the model in `base_dir`, its factors drawn from `seed`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out_dir)
    return Path(out_dir)


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of the base model, or of it with the adapter, by transformers + PEFT at float32."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# The tiny Llama's projections (conftest `tiny_model_dir`): hidden 64, 4 heads of 16, 2 KV heads, MLP 128.
OUT = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64}


def write_adapter(directory: Path, seed: int, rank: int = 4, config: object = None, tensors: dict | None = None,
                  module: str = "model.layers.{i}.self_attn.{p}") -> Path:
    """A PEFT directory by hand: random factors for q/k/v/o of both layers, or `tensors`; the
    config PEFT writes, or `config` as given (any JSON)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    if tensors is None:
        tensors = {}
        for i in range(2):
            for projection, out in OUT.items():
                name = f"base_model.model.{module.format(i=i, p=projection)}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, 64, generator=generator)
                tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=generator)
    save_file(tensors, directory / "adapter_model.safetensors")
    spec = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(OUT)} \
        if config is None else config
    (directory / "adapter_config.json").write_text(json.dumps(spec))
    return directory

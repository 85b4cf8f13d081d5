"""Tiny random causal LMs of many transformers architectures, for tests that compare a
compressed model with the untouched one. Not a test module: imported by those tests."""

import pytest
import torch

# Architectures beyond the built-ins, each with its own parts (norm formulas, rotations,
# MLPs, heads); test_llm.py says what `llm` must find in each.
NAMES = ("Mistral", "Qwen3", "Gemma", "Gemma2", "Qwen3Next", "Phi3", "Olmo2", "Granite",
         "Cohere", "StableLm", "GPTNeoX", "Mixtral", "Falcon", "OPT")
CONFIGS = {"Qwen3Next": dict(layer_types=["full_attention"] * 2, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32),
           # Mamba hybrids, small and fast: a gated norm in each Mamba mixer; Falcon-H1's MLP
           # scales gate(x) and the output, as its released models do
           "FalconH1": dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8,
                            mamba_chunk_size=8, mamba_rms_norm=True, mlp_multipliers=[0.5, 2.0]),
           "Bamba": dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=8,
                         attn_layer_indices=[1])}
# Mixture-of-experts models whose loss adds the router's load-balancing term, each with 4
# experts, 2 per token.
MOE = ("Olmoe", "Mixtral", "Qwen2Moe", "GptOss")
MOE_CONFIGS = {"Olmoe": dict(num_experts=4, num_experts_per_tok=2, eos_token_id=None),
               "Mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
               "Qwen2Moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32),
               "GptOss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                              layer_types=["sliding_attention", "full_attention"],
                              sliding_window=8, rope_parameters=dict(
                                  rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                  truncate=False, original_max_position_embeddings=2))}


def architecture(name, **options):
    """A tiny random model of the architecture, every dropout off; `options` set config
    fields (the MoE ones come from MOE_CONFIGS)."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, name + "Config", None)
    if config is None:
        pytest.skip(f"this transformers has no {name}")
    config = config(hidden_size=64, intermediate_size=96, ffn_dim=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    max_position_embeddings=64, pad_token_id=0,
                    **CONFIGS.get(name, {}) | MOE_CONFIGS.get(name, {}) | options)
    for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout",
                "resid_pdrop", "embd_pdrop", "layerdrop"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return getattr(transformers, name + "ForCausalLM")(config).train()


def perturb_norms(model, seed=0):
    """Norm weights drawn from [0.5, 1.5] (from [-0.5, 0.5] where γ = 1 + w) and biases from
    [-0.5, 0.5], as in a trained model: a γ or β handled wrong shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith(("LayerNorm", "RMSNorm", "LayerNorm1P")):
                w, b = getattr(m, "weight", None), getattr(m, "bias", None)
                if isinstance(w, torch.Tensor):
                    offset = 0.0 if float(w.float().mean()) == 0.0 else 1.0  # 1 + w from 0
                    w.copy_(torch.rand(w.shape, generator=g) - 0.5 + offset)
                if isinstance(b, torch.Tensor):
                    b.copy_(torch.rand(b.shape, generator=g) - 0.5)
    return model

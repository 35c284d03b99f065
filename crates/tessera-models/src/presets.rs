//! Named configurations. Those named after a Hugging Face checkpoint reproduce its
//! config.json field for field (`gpt2`, `gpt2-medium`, `gpt2-large`, `gpt2-xl`,
//! `meta-llama/Llama-2-{7,13,70}b-hf`, `meta-llama/Meta-Llama-3-8B`, `bert-large-uncased`,
//! `google/vit-base-patch16-224`); `gpt3-175b` is GPT-3's largest model (Brown et al. 2020,
//! table 2.1) in GPT-2's architecture, `mixtral-8x7b` / `mixtral-8x22b`, `qwen1.5-moe-a2.7b` /
//! `qwen2-57b-a14b` and `qwen3-30b-a3b` / `qwen3-235b-a22b` the architecture dims of
//! `mistralai/Mixtral-8x{7,22}B-v0.1`, `Qwen/Qwen1.5-MoE-A2.7B`, `Qwen/Qwen2-57B-A14B` and
//! `Qwen/Qwen3-{30B-A3B,235B-A22B}`, `deepseek-v3` the config.json of
//! `deepseek-ai/DeepSeek-V3` (its multi-token-prediction layer excluded, as transformers
//! drops it), and `mt-nlg-530b` (Smith et al. 2022, MT-NLG: 105
//! layers, hidden 20480, 128 heads) and `gpt-1t` (Narayanan et al. 2021, table 1: 128 layers,
//! hidden 25600, 160 heads) the largest GPTs Megatron-LM's papers train and time, in the same
//! architecture (GPT-2's vocabulary, 2048 positions); `bloom-560m`, `bloom-7b1` and
//! `bloom-176b` have the architecture dims of `bigscience/bloom-560m`, `bigscience/bloom-7b1`
//! and `bigscience/bloom` (BigScience 2022; a 250,880-token vocabulary) with
//! `BloomConfig`'s defaults for the rest (no dtype stated); the rest are our own.

use crate::config::*;
use crate::diffusion::{DitConfig, DitParams};
use crate::error::{ModelError, Result};
use crate::ModelConfig;
use tessera_ir::DType;

/// Every preset name, in the order they are listed to users.
pub const PRESETS: &[&str] = &[
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "gpt3-175b",
    "mt-nlg-530b",
    "gpt-1t",
    "mpt-1b",
    "mpt-3b",
    "gpt2-tiny",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "llama-1.3b",
    "llama-tiny",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "mixtral-tiny",
    "qwen1.5-moe-a2.7b",
    "qwen2-57b-a14b",
    "qwen2-moe-tiny",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "qwen3-moe-tiny",
    "deepseek-v3",
    "deepseek-v3-tiny",
    "bloom-560m",
    "bloom-7b1",
    "bloom-176b",
    "bloom-tiny",
    "bert-large",
    "bert-tiny",
    "vit-base",
    "vit-tiny",
    "mlp",
    "dit-xl-2",
    "dit-tiny",
];

pub(crate) fn preset(name: &str) -> Result<ModelConfig> {
    let gpt2 = |n_embd, n_layer, n_head| {
        gpt2_cfg(Gpt2Params::new(name, 50257, 1024, n_embd, n_layer, n_head))
    };
    let llama2 = |hidden, intermediate, layers, heads, kv_heads| {
        let mut p =
            LlamaParams::new(LlamaVariant::Llama, name, 32000, hidden, intermediate, layers, heads);
        p.num_key_value_heads = kv_heads;
        p.max_position_embeddings = 4096;
        p.rms_norm_eps = 1e-5;
        p.dtype = Some(DType::F16);
        llama_cfg(p)
    };
    // LLaMA 3: a 128k vocabulary, 8 KV heads, RoPE base 500000, 8192 positions, bf16 weights.
    let llama3 = |hidden, ffn, layers, heads| {
        let mut p = LlamaParams::new(LlamaVariant::Llama, name, 128256, hidden, ffn, layers, heads);
        p.num_key_value_heads = 8;
        p.max_position_embeddings = 8192;
        p.rms_norm_eps = 1e-5;
        p.rope_theta = 500000.0;
        p.dtype = Some(DType::BF16);
        llama_cfg(p)
    };
    let mixtral = |vocab, hidden, intermediate, layers, heads, positions| {
        let mut p = LlamaParams::new(
            LlamaVariant::Mixtral,
            name,
            vocab,
            hidden,
            intermediate,
            layers,
            heads,
        );
        p.num_key_value_heads = 8;
        p.max_position_embeddings = positions;
        p.rms_norm_eps = 1e-5;
        p.rope_theta = 1e6;
        p.dtype = Some(DType::BF16);
        p.moe = Some(MoeParams { router_aux_loss_coef: 0.02, ..MoeParams::mixtral(intermediate) });
        llama_cfg(p)
    };
    // Qwen2-MoE: q/k/v biases, a shared expert beside the routed ones, RoPE base 1e6, bf16.
    let qwen2_moe = |shape: [usize; 5], kv_heads, positions, experts: [usize; 3]| {
        let [hidden, intermediate, layers, heads, shared] = shape;
        let [num_experts, top_k, expert] = experts;
        let mut p = LlamaParams::new(
            LlamaVariant::Qwen2Moe,
            name,
            151936,
            hidden,
            intermediate,
            layers,
            heads,
        );
        p.num_key_value_heads = kv_heads;
        p.max_position_embeddings = positions;
        p.rope_theta = 1e6;
        p.dtype = Some(DType::BF16);
        p.moe = Some(MoeParams {
            num_experts,
            num_experts_per_tok: top_k,
            expert_intermediate_size: expert,
            shared_expert_intermediate_size: Some(shared),
            ..MoeParams::qwen2_moe()
        });
        llama_cfg(p)
    };
    let qwen3_moe = |hidden, intermediate, expert, layers, heads| {
        let mut p = LlamaParams::new(
            LlamaVariant::Qwen3Moe,
            name,
            151936,
            hidden,
            intermediate,
            layers,
            heads,
        );
        p.num_key_value_heads = 4;
        p.head_dim = Some(128);
        p.max_position_embeddings = 40960;
        p.rope_theta = 1e6;
        p.dtype = Some(DType::BF16);
        let moe = MoeParams {
            expert_intermediate_size: expert,
            norm_topk_prob: true,
            ..MoeParams::qwen3_moe()
        };
        p.moe = Some(moe);
        llama_cfg(p)
    };
    match name {
        "gpt2" => gpt2(768, 12, 12),
        "gpt2-medium" => gpt2(1024, 24, 16),
        "gpt2-large" => gpt2(1280, 36, 20),
        "gpt2-xl" => gpt2(1600, 48, 25),
        "gpt3-175b" => gpt2_cfg(Gpt2Params::new(name, 50257, 2048, 12288, 96, 96)),
        "mt-nlg-530b" => gpt2_cfg(Gpt2Params::new(name, 50257, 2048, 20480, 105, 128)),
        "gpt-1t" => gpt2_cfg(Gpt2Params::new(name, 50257, 2048, 25600, 128, 160)),
        "mpt-1b" => gpt2_cfg(Gpt2Params::new(name, 50368, 2048, 2048, 24, 16)),
        "mpt-3b" => gpt2_cfg(Gpt2Params::new(name, 50368, 2048, 2560, 32, 20)),
        "gpt2-tiny" => {
            // Byte-level vocabulary, no dropout: the model the CPU tests and demos train.
            let mut p = Gpt2Params::new(name, 256, 256, 256, 8, 8);
            p.embd_pdrop = 0.0;
            p.resid_pdrop = 0.0;
            p.attn_pdrop = 0.0;
            gpt2_cfg(p)
        }
        "llama2-7b" => llama2(4096, 11008, 32, 32, 32),
        "llama2-13b" => llama2(5120, 13824, 40, 40, 40),
        "llama2-70b" => llama2(8192, 28672, 80, 64, 8),
        "llama3-8b" => llama3(4096, 14336, 32, 32),
        "llama3-70b" => llama3(8192, 28672, 80, 64),
        "llama-1.3b" => {
            let p = LlamaParams::new(LlamaVariant::Llama, name, 32000, 2048, 5504, 24, 16);
            llama_cfg(p)
        }
        "llama-tiny" => {
            let mut p = LlamaParams::new(LlamaVariant::Llama, name, 256, 256, 688, 8, 8);
            p.num_key_value_heads = 4;
            p.max_position_embeddings = 256;
            p.rms_norm_eps = 1e-5;
            llama_cfg(p)
        }
        // mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 config.json: 8 experts, top 2,
        // RoPE base 1e6, no window, bf16.
        "mixtral-8x7b" => mixtral(32000, 4096, 14336, 32, 32, 32768),
        "mixtral-8x22b" => mixtral(32000, 6144, 16384, 56, 48, 65536),
        "mixtral-tiny" => {
            let mut p = LlamaParams::new(LlamaVariant::Mixtral, name, 256, 64, 96, 2, 4);
            p.num_key_value_heads = 2;
            p.max_position_embeddings = 256;
            p.moe = Some(MoeParams { num_experts: 4, ..MoeParams::mixtral(96) });
            llama_cfg(p)
        }
        // Qwen/Qwen1.5-MoE-A2.7B and Qwen/Qwen2-57B-A14B config.json: 60 experts top 4 with
        // a 5632-wide shared expert, and 64 experts top 8 with a 20480-wide one; both without
        // renormalisation (norm_topk_prob false), a sparse block in every layer.
        "qwen1.5-moe-a2.7b" => qwen2_moe([2048, 5632, 24, 16, 5632], 16, 8192, [60, 4, 1408]),
        "qwen2-57b-a14b" => qwen2_moe([3584, 18944, 28, 28, 20480], 4, 131072, [64, 8, 2560]),
        "qwen2-moe-tiny" => {
            let mut p = LlamaParams::new(LlamaVariant::Qwen2Moe, name, 256, 64, 128, 2, 4);
            p.num_key_value_heads = 2;
            p.max_position_embeddings = 256;
            let moe = MoeParams {
                num_experts: 4,
                num_experts_per_tok: 2,
                expert_intermediate_size: 32,
                shared_expert_intermediate_size: Some(48),
                ..MoeParams::qwen2_moe()
            };
            p.moe = Some(moe);
            llama_cfg(p)
        }
        // Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B config.json: 128 experts, top 8, head_dim 128,
        // 4 KV heads, RoPE base 1e6, norm_topk_prob, bf16.
        "qwen3-30b-a3b" => qwen3_moe(2048, 6144, 768, 48, 32),
        "qwen3-235b-a22b" => qwen3_moe(4096, 12288, 1536, 94, 64),
        "qwen3-moe-tiny" => {
            let mut p = LlamaParams::new(LlamaVariant::Qwen3Moe, name, 256, 64, 128, 2, 4);
            p.num_key_value_heads = 2;
            p.head_dim = Some(32);
            p.max_position_embeddings = 256;
            let moe = MoeParams {
                num_experts: 8,
                num_experts_per_tok: 2,
                expert_intermediate_size: 32,
                norm_topk_prob: true,
                ..MoeParams::qwen3_moe()
            };
            p.moe = Some(moe);
            llama_cfg(p)
        }
        // deepseek-ai/DeepSeek-V3 config.json: MLA (q rank 1536, kv rank 512, 128 + 64 q/k
        // head dims, v 128), 3 dense layers, 256 routed experts in 8 groups (4 kept), top 8,
        // one shared expert, scaling 2.5, YaRN ×40 over 4096 positions, bf16.
        "deepseek-v3" => {
            let mut p =
                LlamaParams::new(LlamaVariant::DeepseekV3, name, 129280, 7168, 18432, 61, 128);
            p.max_position_embeddings = 163840;
            p.rope_scaling = crate::rope::RopeScaling::Yarn {
                factor: 40.0,
                original_max_position_embeddings: 4096,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: Some(1.0),
                mscale_all_dim: Some(1.0),
                attention_factor: None,
                truncate: true,
            };
            p.dtype = Some(DType::BF16);
            llama_cfg(p)
        }
        "deepseek-v3-tiny" => {
            let mut p = LlamaParams::new(LlamaVariant::DeepseekV3, name, 256, 64, 96, 2, 4);
            p.max_position_embeddings = 256;
            p.mla = Some(MlaParams {
                q_lora_rank: Some(48),
                kv_lora_rank: 32,
                qk_nope_head_dim: 16,
                qk_rope_head_dim: 8,
                v_head_dim: 16,
                rope_interleave: true,
            });
            p.head_dim = Some(24);
            p.moe = Some(MoeParams {
                num_experts: 8,
                num_experts_per_tok: 2,
                expert_intermediate_size: 32,
                first_dense_layers: 1,
                deepseek: Some(DeepseekRouting {
                    n_group: 4,
                    topk_group: 2,
                    routed_scaling_factor: 2.5,
                    n_shared_experts: 1,
                }),
                ..MoeParams::deepseek_v3()
            });
            llama_cfg(p)
        }
        "bloom-560m" => bloom_cfg(BloomParams::new(name, 250880, 1024, 24, 16)),
        "bloom-7b1" => bloom_cfg(BloomParams::new(name, 250880, 4096, 30, 32)),
        "bloom-176b" => bloom_cfg(BloomParams::new(name, 250880, 14336, 70, 112)),
        "bloom-tiny" => {
            // Byte-level vocabulary, no dropout (BloomConfig's default): small enough for the
            // f64 reference interpreter.
            bloom_cfg(BloomParams::new(name, 256, 64, 2, 4))
        }
        "bert-tiny" => {
            // Byte-level: ids 0..=255 are bytes, 256 is [MASK] (257..=259 reserved, so the
            // vocabulary splits over 2 and 4 devices).
            let p = BertParams::new(name, 260, 128, 4, 4, 512, 256);
            Ok(ModelConfig::Bert(BertConfig::new(p)?))
        }
        "bert-large" => {
            let p = BertParams::new(name, 30522, 1024, 24, 16, 4096, 512);
            Ok(ModelConfig::Bert(BertConfig::new(p)?))
        }
        "vit-base" => {
            let mut p = VitParams::new(name, 768, 12, 12, 3072);
            p.num_labels = 1000;
            Ok(ModelConfig::Vit(VitConfig::new(p)?))
        }
        "vit-tiny" => {
            // 8×8 grey images in 2×2 patches (16 patches + [CLS]), 10 classes: the handwritten
            // digits data set `scripts/setup.sh` installs (data/README.md).
            let mut p = VitParams::new(name, 64, 3, 4, 128);
            p.image_size = [8, 8];
            p.patch_size = [2, 2];
            p.num_channels = 1;
            p.num_labels = 10;
            Ok(ModelConfig::Vit(VitConfig::new(p)?))
        }
        // diffusers' DiT-XL/2 at 256 px (a 32×32×4 latent, learned sigma, ImageNet classes).
        "dit-xl-2" => Ok(ModelConfig::Dit(DitConfig::new(DitParams::xl_2(name))?)),
        "dit-tiny" => {
            // Class-conditional diffusion on the 8×8 grey digits (data/digits.csv): 2×2
            // patches (16 tokens), width 64, 3 blocks, ε-prediction (no learned sigma).
            let mut p = DitParams::xl_2(name);
            (p.num_attention_heads, p.attention_head_dim, p.num_layers) = (4, 16, 3);
            (p.in_channels, p.out_channels, p.sample_size, p.patch_size) = (1, Some(1), 8, 2);
            p.num_embeds_ada_norm = 10;
            Ok(ModelConfig::Dit(DitConfig::new(p)?))
        }
        "mlp" => {
            let p = MlpParams {
                name: name.to_string(),
                input_dim: 784,
                hidden_dims: vec![1024, 1024],
                num_classes: 10,
                dtype: None,
            };
            Ok(ModelConfig::Mlp(MlpConfig::new(p)?))
        }
        _ => Err(ModelError::UnknownPreset { name: name.to_string(), presets: PRESETS.join(", ") }),
    }
}

fn gpt2_cfg(p: Gpt2Params) -> Result<ModelConfig> {
    Ok(ModelConfig::Gpt2(Gpt2Config::new(p)?))
}

fn bloom_cfg(p: BloomParams) -> Result<ModelConfig> {
    Ok(ModelConfig::Bloom(BloomConfig::new(p)?))
}

fn llama_cfg(p: LlamaParams) -> Result<ModelConfig> {
    Ok(ModelConfig::Llama(LlamaConfig::new(p)?))
}

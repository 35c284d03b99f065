//! Parameter counts of built graphs against Hugging Face `transformers`' figures (trainable
//! tensors, tied ones once, buffers excluded). Each case is checked twice: the built graph's
//! `num_parameters()` and the config's closed-form `num_parameters()` must both equal it.

use std::path::PathBuf;
use tessera_ir::DType;
use tessera_models::{build, BuildOptions, ModelConfig};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Both counts of `cfg` against `expected`; the error names the case.
fn check(case: &str, cfg: &ModelConfig, expected: u64) -> Result<(), String> {
    let model = build(cfg, &BuildOptions::new(1, 16, DType::F32))
        .map_err(|e| format!("{case}: build failed: {e}"))?;
    let graph = model.builder.graph.num_parameters();
    let closed_form = cfg.num_parameters();
    if graph != expected || closed_form != expected {
        return Err(format!(
            "{case}: expected {expected}, graph has {graph}, closed form gives {closed_form}"
        ));
    }
    Ok(())
}

#[test]
fn presets_match_hugging_face_counts() {
    let cases: &[(&str, u64)] = &[
        ("gpt2", 124_439_808),
        ("gpt2-medium", 354_823_168),
        ("gpt2-large", 774_030_080),
        ("gpt2-xl", 1_557_611_200),
        // llm-foundry's benchmark table (`scripts/train/benchmarking/README.md`, NumParams).
        ("mpt-1b", 1_315_950_592),
        ("mpt-3b", 2_651_837_440),
        ("llama2-7b", 6_738_415_616),
        ("llama2-13b", 13_015_864_320),
        ("llama2-70b", 68_976_648_192),
        ("llama3-8b", 8_030_261_248),
        ("llama3-70b", 70_553_706_496),
        // BertForMaskedLM (no pooler), decoder tied to the word embeddings.
        ("bert-large", 335_174_458),
        // ViTForImageClassification, 1000 labels, no pooler.
        ("vit-base", 86_567_656),
        // 784·1024+1024 + 1024·1024+1024 + 1024·10+10.
        ("mlp", 1_863_690),
    ];
    let failures: Vec<String> = cases
        .iter()
        .filter_map(|&(name, expected)| {
            let cfg = match ModelConfig::preset(name) {
                Ok(cfg) => cfg,
                Err(e) => return Some(format!("{name}: preset failed: {e}")),
            };
            check(name, &cfg, expected).err()
        })
        .collect();
    assert!(failures.is_empty(), "parameter count mismatches:\n{}", failures.join("\n"));
}

#[test]
fn bloom_presets_match_hugging_face_counts() {
    // BloomForCausalLM, lm_head tied to the word embeddings. By hand: V·H + 2H (embedding
    // LayerNorm) + L·(12H² + 13H) + 2H (ln_f), per layer query_key_value 3H² + 3H, dense
    // H² + H, dense_h_to_4h 4H² + 4H, dense_4h_to_h 4H² + H, two LayerNorms 4H; V = 250880.
    // bloom-560m, H = 1024, L = 24: 256,901,120 + 24·12,596,224 + 4,096 = 559,214,592.
    // bloom-7b1, H = 4096, L = 30: 1,027,604,480 + 30·201,379,840 + 16,384 = 7,069,016,064.
    // bloom-176b, H = 14336, L = 70: 3,596,615,680 + 70·2,466,437,120 + 57,344
    // = 176,247,271,424. All three are the counts published for the checkpoints.
    for (name, want) in
        [("bloom-560m", 559_214_592), ("bloom-7b1", 7_069_016_064), ("bloom-176b", 176_247_271_424)]
    {
        check(name, &ModelConfig::preset(name).unwrap(), want).unwrap();
    }
}

#[test]
fn gpt3_175b_has_175b_parameters() {
    // GPT-3 paper, table 2.1: "175.0B". By hand: per layer 12·d² + 13·d at d = 12288
    // (c_attn 3d²+3d, c_proj d²+d, c_fc 4d²+4d, mlp c_proj 4d²+d, two LayerNorms 4d) =
    // 1,812,099,072, × 96 = 173,961,510,912; wte 50257·12288 = 617,558,016; wpe
    // 2048·12288 = 25,165,824; ln_f 24,576. Sum 174,604,259,328.
    let cfg = ModelConfig::preset("gpt3-175b").unwrap();
    check("gpt3-175b", &cfg, 174_604_259_328).unwrap();
}

#[test]
fn megatron_530b_and_1t_have_the_papers_counts() {
    // Narayanan et al. 2021, table 1: "529.6" and "1008.0" billion. By hand, as above:
    // d = 20480, 105 layers: (12·d² + 13·d) × 105 = 528,510,259,200; wte 1,029,263,360;
    // wpe 41,943,040; ln_f 40,960: 529,581,506,560.
    // d = 25600, 128 layers: 1,006,675,558,400; wte 1,286,579,200; wpe 52,428,800; ln_f
    // 51,200: 1,008,014,617,600.
    for (name, want) in [("mt-nlg-530b", 529_581_506_560), ("gpt-1t", 1_008_014_617_600)] {
        check(name, &ModelConfig::preset(name).unwrap(), want).unwrap();
    }
}

#[test]
fn mistral_7b_fixture_matches_published_count() {
    // Mistral-7B-v0.1's config.json (GQA 32/8 heads, head_dim 128, untied head).
    // By hand: embed 32000·4096 = 131,072,000 and lm_head the same;
    // per layer q 4096² = 16,777,216, k and v 4096·1024 = 4,194,304 each, o 16,777,216,
    // MLP 3·4096·14336 = 176,160,768, two norms 8,192: 218,112,000 × 32 = 6,979,584,000;
    // final norm 4,096. Total 131,072,000·2 + 6,979,584,000 + 4,096 = 7,241,732,096, the
    // figure published for the checkpoint.
    let cfg = ModelConfig::from_path(&fixture("mistral-7b-v0.1.json")).unwrap();
    check("mistral-7b-v0.1", &cfg, 7_241_732_096).unwrap();
}

#[test]
fn qwen2_0_5b_fixture_matches_published_count() {
    // Qwen2-0.5B's config.json (14 heads of 64, 2 KV heads, q/k/v biases, tied embeddings).
    // By hand: embed 151936·896 = 136,134,656 (tied: counted once);
    // per layer q 896·896 + 896 = 803,712, k and v 896·128 + 128 = 114,816 each,
    // o 896·896 = 802,816, MLP 3·896·4864 = 13,074,432, norms 1,792: 14,912,384 × 24 =
    // 357,897,216; final norm 896. Total 494,032,768, the figure published for Qwen2-0.5B.
    let cfg = ModelConfig::from_path(&fixture("qwen2-0.5b.json")).unwrap();
    check("qwen2-0.5b", &cfg, 494_032_768).unwrap();
}

#[test]
fn transformers_v5_style_fixture_matches_published_count() {
    // SmolLM2-135M written with transformers 5 keys (`rope_parameters`, `dtype`).
    // By hand: embed 49152·576 = 28,311,552 (tied); per layer q 576² = 331,776, k and v
    // 576·192 = 110,592 each, o 331,776, MLP 3·576·1536 = 2,654,208, norms 1,152:
    // 3,540,096 × 30 = 106,202,880; final norm 576. Total 134,515,008.
    let cfg = ModelConfig::from_path(&fixture("smollm2-135m-v5.json")).unwrap();
    check("smollm2-135m", &cfg, 134_515_008).unwrap();
}

#[test]
fn llama3_rope_scaling_fixture_matches_published_count() {
    // Llama-3.2-1B: embed 128256·2048 = 262,668,288 (tied); per layer q 2048² = 4,194,304,
    // k and v 2048·512 = 1,048,576 each, o 4,194,304, MLP 3·2048·8192 = 50,331,648, norms
    // 4,096: 60,821,504 × 16 = 973,144,064; final norm 2,048. Total 1,235,814,400.
    let cfg = ModelConfig::from_path(&fixture("llama-3.2-1b.json")).unwrap();
    check("llama-3.2-1b", &cfg, 1_235_814_400).unwrap();
}

#[test]
fn moe_presets_match_hugging_face_counts() {
    // By hand, per layer: attention d·h·e + 2·d·kv·e + h·e·d, two RMSNorms 2d (+ q/k norms 2e
    // on Qwen3), the experts E·3·d·f and the router E·d; plus the embedding and the untied
    // head 2·v·d and the final norm d. Architecture dims from each checkpoint's config.json.
    // Mixtral-8x7B-v0.1 (v 32000, d 4096, L 32, h 32, kv 8, E 8, f 14336): 46,702,792,704,
    // transformers' count for the checkpoint (published "46.7B").
    // Mixtral-8x22B-v0.1 (v 32000, d 6144, L 56, h 48, kv 8, E 8, f 16384): 140.6B
    // (published "141B").
    // Qwen3-30B-A3B (v 151936, d 2048, L 48, h 32, kv 4, e 128, E 128, f 768): 30.5B as its
    // model card says; Qwen3-235B-A22B (d 4096, L 94, h 64, f 1536): 235.1B ("235B").
    // Qwen1.5-MoE-A2.7B (d 2048, L 24, h 16, E 60, f 1408, shared 5632, q/k/v biases): 14.3B
    // as its model card says; Qwen2-57B-A14B (d 3584, L 28, h 28, kv 4, E 64, f 2560, shared
    // 20480): 57.4B. All six are transformers' meta-device counts of the checkpoints' configs
    // (crates/tessera-cli/tests/fixtures/hf_moe/param_counts.json).
    for (name, want) in [
        ("qwen1.5-moe-a2.7b", 14_315_784_192),
        ("qwen2-57b-a14b", 57_408_658_944),
        ("mixtral-8x7b", 46_702_792_704),
        ("mixtral-8x22b", 140_620_634_112),
        ("qwen3-30b-a3b", 30_532_122_624),
        ("qwen3-235b-a22b", 235_093_634_560),
        // DeepSeek-V3 (v 129280, d 7168, L 61 of which 3 dense with i 18432, h 128, MLA q rank
        // 1536, kv rank 512, q/k 128 + 64, v 128; E 256, f 2048, one shared expert):
        // transformers' meta-device count 671,026,404,352 (no MTP layer;
        // crates/tessera-cli/tests/fixtures/hf_moe/deepseek_v3_params.json) plus the 58 MoE
        // layers' e_score_correction_bias buffers, 58 · 256 = 14,848, held as parameters here.
        ("deepseek-v3", 671_026_419_200),
    ] {
        check(name, &ModelConfig::preset(name).unwrap(), want).unwrap();
    }
}

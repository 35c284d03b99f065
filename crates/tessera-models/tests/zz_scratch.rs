use tessera_models::*;
use tessera_ir::DType;
#[test]
fn show() {
    let cases = [
        r#"{"model_type": "t5"}"#,
        "{\n \"a\": 1\n \"b\": 2}",
        r#"{"hidden_size": 64}"#,
        r#"{"model_type": "llama", "vocab_size": 100}"#,
        r#"{"model_type": "bert", "vocab_size": 100, "hidden_size": 100, "num_hidden_layers": 1, "num_attention_heads": 3, "intermediate_size": 64, "max_position_embeddings": 32}"#,
        r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}"#,
        r#"{"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "hidden_act": "quick_gelu"}"#,
        r#"{"model_type": "gpt2", "vocab_size": "x"}"#,
        "[1]",
    ];
    for c in cases { println!("{}", ModelConfig::from_hf_json(c).err().unwrap()); }
    println!("{}", ModelConfig::preset("gpt5").err().unwrap());
    println!("{}", ModelConfig::from_path(std::path::Path::new("/nonexistent")).err().unwrap());
    let g = ModelConfig::preset("gpt2").unwrap();
    println!("{}", build(&g, &BuildOptions::new(1, 4096, DType::F32)).err().unwrap());
    println!("{}", build(&g, &BuildOptions::new(0, 4096, DType::F32)).err().unwrap());
    println!("{}", build(&g, &BuildOptions::new(1, 4, DType::I64)).err().unwrap());
    let t = std::time::Instant::now();
    let m = build(&ModelConfig::preset("llama2-70b").unwrap(), &BuildOptions::new(1, 16, DType::BF16)).unwrap();
    println!("70b build {:?} nodes {}", t.elapsed(), m.builder.graph.nodes.len());
    let t = std::time::Instant::now();
    let tg = tessera_ir::build_training_graph(m.builder, m.loss, &Default::default()).unwrap();
    println!("70b train {:?} nodes {}", t.elapsed(), tg.graph.nodes.len());
    let m = build(&ModelConfig::preset("gpt2-tiny").unwrap(), &BuildOptions::new(1, 16, DType::F32)).unwrap();
    for n in m.builder.graph.nodes.iter().take(40) { println!("{:?} {:?} {} {:?}", n.block, n.op.name(), m.builder.graph.scope_name(n.scope), n.outputs.iter().map(|&t| m.builder.graph.meta(t).to_string()).collect::<Vec<_>>()); }
}

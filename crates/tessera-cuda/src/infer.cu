// ---- Generation ops (infer.rs): KV-cache write, position selection, quantised matmuls ----

//! Reference interpreter (placeholder until written).

//! The one counter-based mixer every deterministic draw is built from (parameter init, batch
//! offsets, per-step seeds): keyed by (seed, name or step, index), never by call order or by
//! which device asks, so every plan on every device count draws the same numbers.

/// splitmix64's output function: a bijective 64-bit mixer (Steele, Lea & Flood 2014).
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

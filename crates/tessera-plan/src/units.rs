//! Memory sizes with units: `512MiB`, `20GiB`, `1.5GiB`, `80GB`, `1024` ↔ bytes (u64).
//!
//! Decimal units (`KB`, `MB`, `GB`, `TB`, `PB`) are powers of 1000, binary units (`KiB`, `MiB`,
//! `GiB`, `TiB`, `PiB`) powers of 1024, as in IEC 80000-13; a plain integer is bytes. Units are
//! case-insensitive. The bare prefixes `K`, `M`, `G`, `T` are rejected as ambiguous.

use crate::{PlanError, Result};

const HINT: &str = "write a number with a unit, e.g. 512MiB or 20GiB";

/// Most significant digits a size may carry (keeps the exact u128 arithmetic in range).
const MAX_DIGITS: usize = 22;

/// `512MiB`, `20GiB`, `1.5GiB`, `80GB`, `100 KiB`, `1024` → bytes.
///
/// Fractions are exact (no float rounding) and rounded to the nearest byte; a fraction of a
/// byte (`1.5B`, `1.5`) is an error, as is a size beyond `u64::MAX`.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = (&t[..split], t[split..].trim());
    let invalid = |why: &str| PlanError::Invalid(format!("invalid memory size `{s}`{why}: {HINT}"));
    if num.is_empty() || num == "." || num.matches('.').count() > 1 {
        return Err(invalid(""));
    }
    let scale: u128 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "pb" => 1_000_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        "pib" => 1 << 50,
        "k" | "m" | "g" | "t" | "p" => {
            let u = unit.to_ascii_uppercase();
            return Err(PlanError::Invalid(format!(
                "invalid memory size `{s}`: the unit `{unit}` is ambiguous; write {u}iB (powers \
                 of 1024) or {u}B (powers of 1000), e.g. 20GiB"
            )));
        }
        _ => return Err(invalid(&format!(" (unknown unit `{unit}`)"))),
    };
    let (int_part, frac_part) = num.split_once('.').unwrap_or((num, ""));
    if frac_part.len() > MAX_DIGITS {
        return Err(invalid(" (too many decimals)"));
    }
    let digits = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > MAX_DIGITS {
        return Err(invalid(" (too large)"));
    }
    let mantissa: u128 =
        if digits.is_empty() { 0 } else { digits.parse().map_err(|_| invalid(""))? };
    // bytes = mantissa * scale / 10^decimals, rounded to nearest.
    let denom = 10u128.pow(frac_part.len() as u32);
    let scaled = mantissa * scale;
    if scale == 1 && !scaled.is_multiple_of(denom) {
        return Err(invalid(" (a byte count must be whole)"));
    }
    let bytes = (scaled + denom / 2) / denom;
    u64::try_from(bytes).map_err(|_| invalid(" (more than 2^64 bytes)"))
}

/// `1.5 GiB`-style rendering with two decimals (`1.50 GiB`, `512.00 MiB`); below 1 KiB, whole
/// bytes (`17 B`).
pub fn format_bytes(b: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn parses_binary_decimal_and_plain() {
        let cases: &[(&str, u64)] = &[
            ("512MiB", 512 * MIB),
            ("20GiB", 20 * GIB),
            ("1.5GiB", 3 * GIB / 2),
            ("80GB", 80_000_000_000),
            ("1024", 1024),
            ("100 KiB", 100 * 1024),
            ("2TiB", 2 << 40),
            ("2tib", 2 << 40),
            ("7 b", 7),
            ("3kb", 3000),
            ("0.5MB", 500_000),
            ("  64 mib  ", 64 * MIB),
            ("0", 0),
            ("1.", 1),
            (".5KiB", 512),
            ("18446744073709551615", u64::MAX),
        ];
        for &(s, want) in cases {
            assert_eq!(parse_bytes(s).ok(), Some(want), "{s}");
        }
    }

    #[test]
    fn rejects_malformed_sizes_with_a_hint() {
        for s in [
            "",
            "GiB",
            "abc",
            "-1GiB",
            "1.2.3MiB",
            "1e9",
            "12 parsecs",
            "inf",
            "NaN",
            "1.5B",
            "1.5",
            "18446744073709551616",
            "99999999999TiB",
            ".",
            "1 G",
        ] {
            let e = parse_bytes(s).expect_err(s).to_string();
            assert!(e.contains(&format!("`{s}`")), "{s}: {e}");
            assert!(e.contains("e.g.") || e.contains("20GiB"), "{s}: {e}");
        }
        let e = parse_bytes("4G").unwrap_err().to_string();
        assert!(e.contains("ambiguous") && e.contains("GiB") && e.contains("GB"), "{e}");
    }

    #[test]
    fn formats_human_sizes() {
        assert_eq!(format_bytes(17), "17 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(1536), "1.50 KiB");
        assert_eq!(format_bytes(512 * MIB), "512.00 MiB");
        assert_eq!(format_bytes(3 * GIB / 2), "1.50 GiB");
        assert_eq!(format_bytes(u64::MAX), "16.00 EiB");
    }

    #[test]
    fn format_then_parse_is_close() {
        for b in [1u64, 999, 4096, 123_456_789, 80 * GIB] {
            let back = parse_bytes(&format_bytes(b)).unwrap();
            assert!((back as f64 - b as f64).abs() <= b as f64 * 0.005, "{b} -> {back}");
        }
    }
}

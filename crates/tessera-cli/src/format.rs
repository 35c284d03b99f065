//! Human-readable numbers for tables.

/// `1536` → `1.50 KiB` (one formatter for the whole CLI: the planner's).
pub fn bytes(b: u64) -> String {
    tessera_plan::units::format_bytes(b)
}

/// `874944921600` → `874.94 G`.
pub fn count(n: u64) -> String {
    const UNITS: [&str; 6] = ["", "K", "M", "G", "T", "P"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

/// `124439808` → `124,439,808`.
pub fn grouped(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(1536), "1.50 KiB");
        assert_eq!(bytes(3 << 30), "3.00 GiB");
        assert_eq!(count(874_944_921_600), "874.94 G");
        assert_eq!(grouped(124_439_808), "124,439,808");
        assert_eq!(grouped(12), "12");
    }
}

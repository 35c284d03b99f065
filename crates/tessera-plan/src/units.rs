//! Memory sizes with units. (Skeleton.)

/// `1.5 GiB`-style rendering.
pub fn format_bytes(b: u64) -> String {
    format!("{b} B")
}

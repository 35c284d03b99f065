//! Schedules (filled in).

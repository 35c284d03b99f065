//! Parallelism config strings. (Skeleton.)

//! Resharding. (Skeleton.)

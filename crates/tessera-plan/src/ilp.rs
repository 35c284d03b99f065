//! The strategy ILP. (Skeleton.)

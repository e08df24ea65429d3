//! GPU benchmark: pool (filled in by its issue).

//! GPU benchmark: shared (filled in by its issue).

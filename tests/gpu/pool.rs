//! GPU tests: pool (filled in by its issue).

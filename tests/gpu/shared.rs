//! GPU tests: shared (filled in by its issue).

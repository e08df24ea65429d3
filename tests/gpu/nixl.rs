//! GPU tests: nixl (filled in by its issue).

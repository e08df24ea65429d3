//! GPU tests: core (filled in by its issue).

//! GPU benchmark: core (filled in by its issue).

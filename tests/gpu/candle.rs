//! GPU tests: candle (filled in by its issue).

//! GPU benchmark: candle (filled in by its issue).

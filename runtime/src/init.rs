//! Seeded, reproducible parameter initializers.

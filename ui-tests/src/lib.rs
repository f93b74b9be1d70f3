//! Compile-fail and compile-pass tests of nitro's macros; the cases live in `tests/ui/`.

//! Runs the trybuild ui tests: every file under `tests/ui/<category>/` must fail to compile with
//! the error in its `.stderr` snapshot, and every file under `tests/ui/pass/` must compile.
//!
//! Regenerate snapshots with `TRYBUILD=overwrite cargo test -p nitro-ui-tests`, then read the diff.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/unhashable/*.rs");
    t.compile_fail("tests/ui/attributes/*.rs");
    t.compile_fail("tests/ui/shape/*.rs");
    t.compile_fail("tests/ui/device/*.rs");
    t.compile_fail("tests/ui/view/*.rs");
    t.pass("tests/ui/pass/*.rs");
}

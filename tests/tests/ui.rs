//! Compile-time behaviour of `#[idempotent]`: every supported shape compiles (`ui/pass`), and
//! every misuse is one precise error at the offending token (`ui/fail`, expected output in the
//! `.stderr` beside each file). Regenerate the expected output with `TRYBUILD=overwrite`, then
//! read every changed `.stderr`.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("ui/pass/*.rs");
    cases.compile_fail("ui/fail/*.rs");
}

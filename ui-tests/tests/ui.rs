//! Compile-time behaviour of `#[idempotent]`: every supported shape compiles (`ui/pass`), and
//! every misuse is one precise error at the offending token (`ui/fail`, expected output in the
//! `.stderr` beside each file). And the capabilities (`ui/capabilities`): a store that
//! implements only `Store` cannot be given to a session call, steps, kept requests, a resume
//! call or the completer, nor a store to a runtime whose capabilities it lacks. Regenerate the expected output with `TRYBUILD=overwrite`, then
//! read every changed `.stderr`.

#[test]
fn ui() {
    let cases = trybuild::TestCases::new();
    cases.pass("ui/pass/*.rs");
    cases.compile_fail("ui/fail/*.rs");
    cases.compile_fail("ui/capabilities/*.rs");
}

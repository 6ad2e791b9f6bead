//! Cross-crate tests of the idempotent workspace. The tests are in `tests/tests/`; this library
//! is empty.

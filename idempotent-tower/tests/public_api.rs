//! The crate docs' "Public API" table names every public item: each item exported at the
//! crate root (`pub use`, `pub mod`, `pub struct`, …) and in its public modules must be the
//! target of a link in that table, and every item the table links to at the root or in a
//! public module must exist.
//!
//! The items are read from the sources (`src/lib.rs`, and the file of each public module),
//! whatever their `cfg`: a feature's items are listed too. The table is read from the crate
//! docs: the `//!` lines of `src/lib.rs` and the files its `#![doc = include_str!(..)]`
//! attributes include. The reading and the check are `idempotent_test_kit::api_table`'s,
//! shared with the other crates' tables.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use idempotent_test_kit::api_table::{self, Table};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The table: in the crate docs, under "Public API"; its links to the core and to `http`
/// are other crates'.
const TABLE: Table<'static> = Table::new("idempotent_tower").external(&["idempotent_core", "http"]);

fn crate_items() -> BTreeSet<String> {
    api_table::exported_items(&src())
}

fn crate_docs() -> String {
    api_table::crate_docs(&src())
}

fn check(items: &BTreeSet<String>, docs: &str) -> (Vec<String>, Vec<String>) {
    api_table::check(items, docs, &TABLE)
}

#[test]
fn the_public_api_table_names_every_public_item() {
    let items = crate_items();
    // The sources were read: the known items of both sides are there.
    for known in [
        "IdempotencyLayer",
        "SessionHeader",
        "IDEMPOTENCY_SESSION_SEQ",
        "client",
        "client::ClientLayer",
        "client::ClientSession",
        "client::HttpSink",
        "client::IdempotencyMiddleware",
    ] {
        assert!(items.contains(known), "{known} not found among {items:?}");
    }
    assert!(
        items.len() >= 45,
        "only {} items found: {items:?}",
        items.len()
    );

    let (missing, unknown) = check(&items, &crate_docs());
    assert!(
        missing.is_empty(),
        "the crate docs' \"Public API\" table (docs/tower-api.md) does not name {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "the crate docs' \"Public API\" table names {unknown:?}, which the crate does not export"
    );
}

#[test]
fn an_item_left_out_of_the_table_is_reported() {
    let items = crate_items();
    let docs = crate_docs();
    for (link, item) in [
        ("[`SessionProblem`]", "SessionProblem"),
        ("[`client::SessionSeq`]", "client::SessionSeq"),
        ("[`client`]", "client"),
    ] {
        assert!(docs.contains(link), "the table links {link}");
        let without = docs.replace(link, "");
        let (missing, _) = check(&items, &without);
        assert_eq!(missing, [item], "once {link} is gone from the table");
    }
    // An item the crate does not export, named in the table.
    let extra = docs.replace("[`BoxError`]", "[`BoxError`], [`NoSuchItem`]");
    assert_eq!(check(&items, &extra).1, ["NoSuchItem"]);
}

#[test]
fn exports_are_read_from_declarations_and_use_trees() {
    let code = r#"
        //! pub struct InADocComment;
        #![doc = include_str!("x.md")]
        pub use a::{b, c as d, e::{self, f}};
        #[cfg(feature = "x")]
        pub use g::H;
        pub struct I { pub field: u8 }
        pub(crate) fn hidden() {}
        pub const fn j() {}
        pub const K: &str = "pub struct NotAnItem;";
        mod private { pub fn l() {} }
        impl I { pub fn method(&self) {} }
        pub mod m { pub enum N {} pub mod o { pub trait P {} } }
    "#;
    let items = api_table::exported_in(code, Path::new("/nonexistent"));
    let expected = [
        "H", "I", "K", "b", "d", "e", "f", "j", "m", "m::N", "m::o", "m::o::P",
    ];
    assert_eq!(
        items.iter().map(String::as_str).collect::<Vec<_>>(),
        expected
    );
}

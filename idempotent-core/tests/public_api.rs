//! The guide's "Public API" table names every public item: each item exported at the crate
//! root (`pub use`, `pub mod`, `pub struct`, …, and the `#[macro_export]` macros) and in its
//! public modules must be the target of a link in that table, and every item the table links
//! to at the root or in a public module must exist.
//!
//! The items are read from the sources (`src/lib.rs`, and the file of each public module,
//! `conformance`'s glob re-exports included), whatever their `cfg`: a feature's items are
//! listed too; `#[doc(hidden)]` items (`__private`, what the attribute expands into) are not
//! public API and are left out. The table is read from `docs/guide.md`, the docs of the
//! doc-only module `guide`, which the crate docs point to. The reading and the check are
//! `idempotent_test_kit::api_table`'s.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use idempotent_test_kit::api_table::{self, Table};

/// The table: in the docs of the module `guide`, under "Public API".
const TABLE: Table<'static> = Table::new("idempotent_core").in_module("guide");

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn crate_items() -> BTreeSet<String> {
    api_table::exported_items(&src())
}

/// The guide, as the module `guide` includes it.
fn guide() -> String {
    api_table::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/guide.md"))
}

fn check(items: &BTreeSet<String>, docs: &str) -> (Vec<String>, Vec<String>) {
    api_table::check(items, docs, &TABLE)
}

#[test]
fn the_public_api_table_names_every_public_item() {
    let items = crate_items();
    // The sources were read: known items of the root and of every public module are there.
    for known in [
        "Idempotency",
        "Call",
        "Key",
        "Store",
        "idempotent",
        "step",
        "default_runtime",
        "guide",
        "clock::Clock",
        "clock::ManualClock",
        "limits::MAX_TTL",
        "limits::check_lease",
        "limits::parse_duration",
        "metrics::REQUESTS",
        "metrics::ProtocolLabel",
        "metrics::Recorded",
        "session::SessionState",
        "session::GateStep",
        "session::MAX_SEQ",
        "steps::Checkpoints",
        "steps::encode_checkpoint",
        "store::ClaimAnswer",
        "store::GIVE_BACK_MAX",
        "store::Store",
        "store::envelope",
        "store::envelope::encoded_len",
        "memory",
        "memory::MemoryStore",
        "memory::RECORD_OVERHEAD",
        "conformance",
        "conformance::FaultyStore",
        "conformance::run",
        // Through `pub use sessions::*;` and `pub use steps::*;`.
        "conformance::session_gate_is_atomic",
        "conformance::checkpoints_round_trip_in_order",
        // `#[macro_export]`: at the root, whichever module defines it.
        "store_conformance_tests",
    ] {
        assert!(items.contains(known), "{known} not found among {items:?}");
    }
    // `#[doc(hidden)]`: not public API.
    assert!(
        !items.iter().any(|i| i.starts_with("__private")),
        "a hidden item among {items:?}"
    );
    assert!(
        items.len() >= 180,
        "only {} items found: {items:?}",
        items.len()
    );

    let (missing, unknown) = check(&items, &guide());
    assert!(
        missing.is_empty(),
        "the guide's \"Public API\" table (docs/guide.md) does not name {missing:?}"
    );
    assert!(
        unknown.is_empty(),
        "the guide's \"Public API\" table names {unknown:?}, which the crate does not export"
    );
}

#[test]
fn the_table_is_the_guides_and_the_crate_docs_point_to_it() {
    let lib = api_table::read(&src().join("lib.rs"));
    assert!(
        lib.contains("pub mod guide {\n    #![doc = include_str!(\"../docs/guide.md\")]"),
        "the module `guide` is docs/guide.md"
    );
    let crate_docs = api_table::crate_docs(&src());
    assert!(
        crate_docs.contains("[`guide`]"),
        "the crate docs link the guide"
    );
    assert!(
        !crate_docs.contains("# Public API"),
        "one table, in the guide"
    );
}

#[test]
fn an_item_left_out_of_the_table_is_reported() {
    let items = crate_items();
    let docs = guide();
    let table = api_table::section(&docs, TABLE.title);
    for (link, item) in [
        ("[`Idempotency`]", "Idempotency"),
        ("[`limits::MAX_TTL`]", "limits::MAX_TTL"),
        ("[`store::ClaimAnswer`]", "store::ClaimAnswer"),
        ("[`store::envelope::decode`]", "store::envelope::decode"),
        ("[`session::SessionState`]", "session::SessionState"),
        ("[`metrics::REQUESTS`]", "metrics::REQUESTS"),
        ("[`memory::MemoryStore`]", "memory::MemoryStore"),
        ("[`conformance::run`]", "conformance::run"),
        ("[`store_conformance_tests!`]", "store_conformance_tests"),
        ("[`guide`](self)", "guide"),
        ("[`steps`]", "steps"),
    ] {
        assert!(table.contains(link), "the table links {link}");
        let without = docs.replace(link, "");
        let (missing, _) = check(&items, &without);
        assert_eq!(missing, [item], "once {link} is gone from the table");
    }
    // Items the crate does not export, named in the table: at the root and in a module.
    let extra = docs.replace(
        "[`limits::MAX_TTL`]",
        "[`limits::MAX_TTL`], [`limits::NO_SUCH_LIMIT`], [`NoSuchItem`]",
    );
    assert_eq!(
        check(&items, &extra).1,
        ["NoSuchItem", "limits::NO_SUCH_LIMIT"]
    );
}

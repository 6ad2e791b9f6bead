//! The crate docs' "Public API" table names every public item: each item exported at the
//! crate root (`pub use`, `pub mod`, `pub struct`, …) and in its public modules must be the
//! target of a link in that table, and every item the table links to at the root or in a
//! public module must exist.
//!
//! The items are read from the sources (`src/lib.rs`, and the file of each public module),
//! whatever their `cfg`: a feature's items are listed too. The table is read from the crate
//! docs: the `//!` lines of `src/lib.rs` and the files its `#![doc = include_str!(..)]`
//! attributes include.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

// ---- the items the sources export ----

/// `text` without its comments, and with the contents of its string literals emptied (so
/// that neither a brace nor a `pub` in them counts).
fn code_only(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if text[i..].starts_with("//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if text[i..].starts_with("/*") {
            let mut depth = 0;
            while i < bytes.len() {
                if text[i..].starts_with("/*") {
                    depth += 1;
                    i += 2;
                } else if text[i..].starts_with("*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if bytes[i] == b'"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The statements of a module's code at its top level: each `…;`, or `… { … }` with its
/// body, attributes included.
fn statements(code: &str) -> Vec<String> {
    let mut statements = Vec::new();
    let mut current = String::new();
    let mut depth = 0i32;
    for c in code.chars() {
        current.push(c);
        match c {
            '{' | '[' | '(' => depth += 1,
            '}' | ']' | ')' => {
                depth -= 1;
                if depth == 0 && c == '}' {
                    statements.push(std::mem::take(&mut current));
                }
            }
            ';' if depth == 0 => statements.push(std::mem::take(&mut current)),
            _ => {}
        }
    }
    statements.push(current);
    statements
        .into_iter()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect()
}

/// `statement` without its leading attributes (`#[..]`, `#![..]`).
fn without_attributes(mut statement: &str) -> &str {
    loop {
        statement = statement.trim_start();
        let rest = match statement.strip_prefix("#!") {
            Some(rest) => rest,
            None => match statement.strip_prefix('#') {
                Some(rest) => rest,
                None => return statement,
            },
        };
        let mut depth = 0;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            match c {
                '[' => depth += 1,
                ']' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(i + 1);
                        break;
                    }
                }
                _ => {}
            }
        }
        statement = &rest[end.expect("an attribute closes")..];
    }
}

/// The names a `pub use` tree brings in: `a::{b, c as d, e::{self, f}}` gives `b`, `d`, `e`
/// and `f`.
fn use_names(tree: &str) -> Vec<String> {
    let mut names = Vec::new();
    use_tree(tree, &mut names);
    names
}

fn use_tree(tree: &str, names: &mut Vec<String>) {
    let tree = tree.trim().trim_start_matches("::");
    if let Some(open) = tree.find('{') {
        assert!(
            tree.ends_with('}'),
            "a use tree `{tree}` ends with its group"
        );
        let parent = tree[..open].trim().trim_end_matches("::");
        let inner = &tree[open + 1..tree.len() - 1];
        let mut depth = 0;
        let mut start = 0;
        let mut parts = Vec::new();
        for (i, c) in inner.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        parts.push(&inner[start..]);
        for part in parts.into_iter().map(str::trim).filter(|p| !p.is_empty()) {
            if part == "self" {
                names.push(parent.rsplit("::").next().unwrap().trim().to_owned());
            } else {
                use_tree(part, names);
            }
        }
    } else {
        assert!(
            !tree.ends_with('*'),
            "a glob re-export (`{tree}`) cannot be listed"
        );
        let words: Vec<&str> = tree.split_whitespace().collect();
        let name = match words.as_slice() {
            [path] => path.rsplit("::").next().unwrap(),
            [_, "as", alias] => alias,
            _ => panic!("a use tree `{tree}`"),
        };
        names.push(name.to_owned());
    }
}

/// The public items a module's code declares or re-exports, each as its path from the
/// crate root (`prefix` is the module's own path, `""` at the root, else ending in `::`),
/// reading the files of its public modules under `dir` too.
fn exported(code: &str, prefix: &str, dir: &Path, items: &mut BTreeSet<String>) {
    for statement in statements(&code_only(code)) {
        let statement = without_attributes(&statement);
        let Some(rest) = statement.strip_prefix("pub ") else {
            continue;
        };
        let rest = rest.trim_start();
        if let Some(tree) = rest.strip_prefix("use ") {
            for name in use_names(tree.trim_end_matches(';')) {
                items.insert(format!("{prefix}{name}"));
            }
            continue;
        }
        let words: Vec<&str> = rest
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .collect();
        // `const fn`, `async fn`, `unsafe fn`, `extern "C" fn`: the name follows `fn`.
        let (kind, name) = match words.iter().position(|w| *w == "fn") {
            Some(at) if at <= 2 => ("fn", words[at + 1]),
            _ => (words[0], words[1]),
        };
        match kind {
            "mod" => {
                let path = format!("{prefix}{name}");
                items.insert(path.clone());
                let inner = if let Some(open) = statement.find('{') {
                    statement[open + 1..statement.len() - 1].to_owned()
                } else {
                    let file = [
                        dir.join(name).join("mod.rs"),
                        dir.join(format!("{name}.rs")),
                    ]
                    .into_iter()
                    .find(|f| f.exists())
                    .unwrap_or_else(|| panic!("the file of module {path}"));
                    read(&file)
                };
                exported(&inner, &format!("{path}::"), &dir.join(name), items);
            }
            "struct" | "enum" | "union" | "trait" | "type" | "const" | "static" | "fn"
            | "macro" => {
                items.insert(format!("{prefix}{name}"));
            }
            other => panic!("unknown public item `{other}` in `{statement}`"),
        }
    }
}

fn crate_items() -> BTreeSet<String> {
    let mut items = BTreeSet::new();
    exported(&read(&src().join("lib.rs")), "", &src(), &mut items);
    items
}

// ---- the items the table names ----

/// The crate docs: the `//!` lines of `src/lib.rs` and the files it includes as docs, in
/// order.
fn crate_docs() -> String {
    let lib = read(&src().join("lib.rs"));
    let mut docs = String::new();
    for line in lib.lines() {
        let line = line.trim_start();
        if let Some(doc) = line.strip_prefix("//!") {
            docs.push_str(doc.strip_prefix(' ').unwrap_or(doc));
            docs.push('\n');
        } else if let Some(attribute) = line.strip_prefix("#![doc") {
            let path = attribute
                .split_once("include_str!(\"")
                .and_then(|(_, rest)| rest.split_once('"'))
                .map(|(path, _)| path)
                .unwrap_or_else(|| panic!("a doc attribute including a file: {line}"));
            docs.push_str(&read(&src().join(path)));
            docs.push('\n');
        }
    }
    docs
}

/// The section under the heading `title`, up to the next heading of its level or above
/// (headings in code blocks do not count).
fn section<'a>(docs: &'a str, title: &str) -> &'a str {
    let mut fenced = false;
    let mut start = None;
    let mut level = 0;
    let mut offset = 0;
    for line in docs.split_inclusive('\n') {
        let trimmed = line.trim();
        if trimmed.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && trimmed.starts_with('#') {
            let hashes = trimmed.chars().take_while(|c| *c == '#').count();
            let heading = trimmed[hashes..].trim();
            match start {
                None if heading == title => {
                    start = Some(offset + line.len());
                    level = hashes;
                }
                Some(from) if hashes <= level => return &docs[from..offset],
                _ => {}
            }
        }
        offset += line.len();
    }
    &docs[start.unwrap_or_else(|| panic!("no \"# {title}\" heading in the crate docs"))..]
}

/// An intra-doc link target as a path from the crate root: `crate::client::ClientLayer` and
/// ``[`client::ClientLayer`]`<P>` `` both give `client::ClientLayer`.
fn normalize(target: &str) -> Option<String> {
    let target = target.trim().trim_matches('`');
    let target = target.split('#').next().unwrap();
    if target.is_empty() || target.contains("://") {
        return None;
    }
    let target = target.split_once('@').map_or(target, |(_, path)| path);
    let target = target.trim_end_matches("()").trim_end_matches('!');
    // Generic arguments are not part of the path: `IdempotencyLayer::<Http>::methods`.
    let mut path = String::new();
    let mut depth = 0;
    for c in target.chars() {
        match c {
            '<' => depth += 1,
            '>' => depth -= 1,
            _ if depth == 0 => path.push(c),
            _ => {}
        }
    }
    let path = path.replace("::::", "::");
    let path = path
        .strip_prefix("crate::")
        .or_else(|| path.strip_prefix("idempotent_tower::"))
        .or_else(|| path.strip_prefix("self::"))
        .unwrap_or(&path);
    let is_path = !path.is_empty()
        && path
            .split("::")
            .all(|s| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_'));
    is_path.then(|| path.to_owned())
}

/// Every link target in `text`: inline (`[text](target)`), reference (`[text][label]`, with
/// the label's definition in `definitions`), and shortcut (``[`target`]``).
fn link_targets(text: &str, definitions: &BTreeMap<String, String>) -> BTreeSet<String> {
    let mut targets = BTreeSet::new();
    let mut fenced = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(open) = rest.find('[') {
            let after = &rest[open + 1..];
            let Some(close) = after.find(']') else { break };
            let label = &after[..close];
            let next = &after[close + 1..];
            let target = if let Some(inline) = next.strip_prefix('(') {
                inline.split(')').next().map(str::to_owned)
            } else if let Some(reference) = next.strip_prefix('[') {
                let key = reference.split(']').next().unwrap_or_default();
                let key = if key.is_empty() { label } else { key };
                definitions.get(key).cloned()
            } else if let Some(definition) = next.strip_prefix(':') {
                Some(definition.trim().to_owned())
            } else {
                Some(
                    definitions
                        .get(label)
                        .cloned()
                        .unwrap_or_else(|| label.to_owned()),
                )
            };
            targets.extend(target.as_deref().and_then(normalize));
            rest = next;
        }
    }
    targets
}

/// The reference definitions (`[label]: target`) of `docs`.
fn definitions(docs: &str) -> BTreeMap<String, String> {
    docs.lines()
        .filter_map(|line| {
            let line = line.trim_start().strip_prefix('[')?;
            let (label, target) = line.split_once("]:")?;
            Some((label.to_owned(), target.trim().to_owned()))
        })
        .collect()
}

/// What the check finds wrong: the exported items the table does not name, and the items
/// it names at the root or in a public module that are not exported.
fn check(items: &BTreeSet<String>, docs: &str) -> (Vec<String>, Vec<String>) {
    let named = link_targets(section(docs, "Public API"), &definitions(docs));
    let missing = items
        .iter()
        .filter(|i| !named.contains(*i))
        .cloned()
        .collect();
    let modules: BTreeSet<&str> = items
        .iter()
        .filter(|i| items.iter().any(|j| j.starts_with(&format!("{i}::"))))
        .map(String::as_str)
        .collect();
    let unknown = named
        .iter()
        .filter(|n| {
            let (module, _) = n.rsplit_once("::").unwrap_or(("", n.as_str()));
            // A root item or a public module's item; methods and other crates are not checked.
            (module.is_empty() || modules.contains(module)) && !items.contains(*n)
        })
        .filter(|n| !n.starts_with("idempotent_core") && !n.starts_with("http"))
        .cloned()
        .collect();
    (missing, unknown)
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
    let mut items = BTreeSet::new();
    exported(code, "", Path::new("/nonexistent"), &mut items);
    let expected = [
        "H", "I", "K", "b", "d", "e", "f", "j", "m", "m::N", "m::o", "m::o::P",
    ];
    assert_eq!(
        items.iter().map(String::as_str).collect::<Vec<_>>(),
        expected
    );
}

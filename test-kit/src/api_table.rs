//! The check that a crate's "Public API" table names every public item: each item the crate
//! exports at its root and in its public modules must be the target of a link in the table,
//! and every item the table links to at the root or in a public module must exist.
//!
//! The items are read from the sources ([`exported_items`]): `src/lib.rs` and the file of
//! each public module, whatever their `cfg` (a feature's items are listed too), without the
//! items marked `#[doc(hidden)]`, with the `#[macro_export]` macros at the root. The table is
//! read from docs text ([`crate_docs`], or any file [`read`]): the section under its heading
//! ([`section`]), and the targets of its links ([`link_targets`]). [`check`] puts the two
//! together:
//!
//! ```ignore
//! use idempotent_test_kit::api_table::{self, Table};
//!
//! let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
//! let items = api_table::exported_items(&src);
//! let (missing, unknown) =
//!     api_table::check(&items, &api_table::crate_docs(&src), &Table::new("my_crate"));
//! assert!(missing.is_empty(), "the table does not name {missing:?}");
//! assert!(unknown.is_empty(), "the table names {unknown:?}, which the crate does not export");
//! ```
//!
//! The sources are read as text, not compiled: comments are dropped, string and character
//! literals emptied, and braces counted, which is enough for code as rustfmt writes it.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

/// Where a crate's table is and how its links read.
#[derive(Clone, Copy, Debug)]
pub struct Table<'a> {
    /// The crate's name in paths (`idempotent_core`): a link to `idempotent_core::Key` names
    /// the root item `Key`, as `crate::Key` does.
    pub crate_name: &'a str,
    /// The path of the module whose docs hold the table, `""` for the crate root: a link to
    /// `self` names that module. Its other links are read as paths from the crate root, so
    /// such a module brings the root's names into scope (`use crate::*;`).
    pub module: &'a str,
    /// The title of the section that holds the table: `"Public API"`.
    pub title: &'a str,
    /// Beginnings of link targets that are not checked: other crates, such as
    /// `"idempotent_core"` or `"http"`. A target is left out if it starts with one of them
    /// (as text, not by path segment).
    pub external: &'a [&'a str],
}

impl<'a> Table<'a> {
    /// The table of the crate `crate_name`: in its root docs, under "Public API", with no
    /// external link.
    pub const fn new(crate_name: &'a str) -> Self {
        Table {
            crate_name,
            module: "",
            title: "Public API",
            external: &[],
        }
    }

    /// The table is in the docs of the module at `path` (`"guide"`).
    pub const fn in_module(self, path: &'a str) -> Self {
        Table {
            module: path,
            ..self
        }
    }

    /// Targets starting with any of `prefixes` are other crates', not checked.
    pub const fn external(self, prefixes: &'a [&'a str]) -> Self {
        Table {
            external: prefixes,
            ..self
        }
    }
}

/// The text of the file at `path`; panics with the path if it cannot be read.
pub fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

// ---- the items the sources export ----

/// Every public item of the crate whose sources are in `src_dir`, as its path from the crate
/// root (`Key`, `limits::MAX_TTL`, `store::envelope::decode`): the items `src_dir/lib.rs`
/// declares or re-exports with `pub`, those of its public modules (read from their files
/// under `src_dir`, or inline) and the `#[macro_export]` macros of the modules read. Items
/// marked `#[doc(hidden)]`, and a hidden module's contents, are left out. A glob re-export
/// (`pub use steps::*;`) of a module whose file is beside the module's own brings in that
/// module's public items; any other glob panics, as it cannot be listed.
pub fn exported_items(src_dir: &Path) -> BTreeSet<String> {
    exported_in(&read(&src_dir.join("lib.rs")), src_dir)
}

/// The public items the crate root's `code` exports, as [`exported_items`] finds them, the
/// files of its modules being under `dir`.
pub fn exported_in(code: &str, dir: &Path) -> BTreeSet<String> {
    let mut items = BTreeSet::new();
    exported(code, "", dir, &mut items);
    items
}

/// `text` without its comments, and with the contents of its string and character literals
/// emptied (so that neither a brace nor a `pub` in them counts).
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
        } else if let Some((open, hashes)) = raw_string_at(text, i) {
            // `r#"…"#` and its byte and C forms: no escapes, closed by `"` and the hashes.
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + open;
            i = text[body..]
                .find(&close)
                .map_or(bytes.len(), |end| body + end + close.len());
            out.push_str("\"\"");
        } else if bytes[i] == b'"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if let Some(len) = char_literal_at(text, i) {
            i += len;
            out.push_str("' '");
        } else {
            let c = text[i..].chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// At `i`, the start of a raw string literal (`r"`, `r#"`, `br##"`, `cr"`, …): the length of
/// its opening and its number of hashes.
fn raw_string_at(text: &str, i: usize) -> Option<(usize, usize)> {
    let before = text[..i].chars().next_back();
    if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
        return None;
    }
    let rest = &text[i..];
    let rest = rest
        .strip_prefix("br")
        .or_else(|| rest.strip_prefix("cr"))
        .or_else(|| rest.strip_prefix('r'))?;
    let prefix = text.len() - i - rest.len();
    let hashes = rest.chars().take_while(|c| *c == '#').count();
    rest[hashes..]
        .starts_with('"')
        .then_some((prefix + hashes + 1, hashes))
}

/// At `i`, a character literal (`'{'`, `'\''`, `'\u{7b}'`; not a lifetime or a label): its
/// length.
fn char_literal_at(text: &str, i: usize) -> Option<usize> {
    let rest = text[i..].strip_prefix('\'')?;
    if let Some(escaped) = rest.strip_prefix('\\') {
        // The escaped character, then up to the closing quote (`\u{…}` is longer).
        let first = escaped.chars().next()?;
        let end = escaped[first.len_utf8()..].find('\'')?;
        return Some(2 + first.len_utf8() + end + 1);
    }
    let c = rest.chars().next()?;
    rest[c.len_utf8()..]
        .starts_with('\'')
        .then_some(1 + c.len_utf8() + 1)
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

/// `statement` split into its leading outer attributes (`#[..]`, each without its spaces)
/// and the rest; inner attributes (`#![..]`, which belong to the enclosing module) are
/// dropped.
fn split_attributes(mut statement: &str) -> (Vec<String>, &str) {
    let mut outer = Vec::new();
    loop {
        statement = statement.trim_start();
        let (inner, rest) = match statement.strip_prefix("#!") {
            Some(rest) => (true, rest),
            None => match statement.strip_prefix('#') {
                Some(rest) => (false, rest),
                None => return (outer, statement),
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
        let end = end.expect("an attribute closes");
        if !inner {
            outer.push(rest[..end].chars().filter(|c| !c.is_whitespace()).collect());
        }
        statement = &rest[end..];
    }
}

/// What a `pub use` tree brings in: a name, or the path of a glob.
enum UseName {
    Name(String),
    Glob(String),
}

/// The names a `pub use` tree brings in: `a::{b, c as d, e::{self, f}}` gives `b`, `d`, `e`
/// and `f`; `a::{b::*}` gives the glob `a::b`.
fn use_names(tree: &str) -> Vec<UseName> {
    let mut names = Vec::new();
    use_tree(tree, "", &mut names);
    names
}

fn use_tree(tree: &str, outer: &str, names: &mut Vec<UseName>) {
    let tree = tree.trim().trim_start_matches("::");
    let joined = |path: &str| {
        if outer.is_empty() {
            path.to_owned()
        } else if path.is_empty() {
            outer.to_owned()
        } else {
            format!("{outer}::{path}")
        }
    };
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
                let name = parent.rsplit("::").next().unwrap().trim();
                names.push(UseName::Name(name.to_owned()));
            } else {
                use_tree(part, &joined(parent), names);
            }
        }
    } else if let Some(glob) = tree.strip_suffix('*') {
        names.push(UseName::Glob(joined(glob.trim().trim_end_matches("::"))));
    } else {
        let words: Vec<&str> = tree.split_whitespace().collect();
        let name = match words.as_slice() {
            [path] => path.rsplit("::").next().unwrap(),
            [_, "as", alias] => alias,
            _ => panic!("a use tree `{tree}`"),
        };
        names.push(UseName::Name(name.to_owned()));
    }
}

/// The file of the module `name` declared in a module whose own modules' files are under
/// `dir`, if there is one.
fn module_file(dir: &Path, name: &str) -> Option<std::path::PathBuf> {
    [
        dir.join(name).join("mod.rs"),
        dir.join(format!("{name}.rs")),
    ]
    .into_iter()
    .find(|f| f.exists())
}

/// The public items a module's code declares or re-exports, each as its path from the
/// crate root (`prefix` is the module's own path, `""` at the root, else ending in `::`),
/// reading the files of its public modules under `dir` too.
fn exported(code: &str, prefix: &str, dir: &Path, items: &mut BTreeSet<String>) {
    for statement in statements(&code_only(code)) {
        let (attributes, statement) = split_attributes(&statement);
        if attributes.iter().any(|a| a.contains("doc(hidden)")) {
            continue;
        }
        if attributes.iter().any(|a| a == "[macro_export]")
            && let Some(rest) = statement.strip_prefix("macro_rules!")
        {
            let name = rest
                .trim_start()
                .split(|c: char| !(c.is_alphanumeric() || c == '_'))
                .next()
                .unwrap_or_default();
            items.insert(name.to_owned());
            continue;
        }
        let Some(rest) = statement.strip_prefix("pub ") else {
            continue;
        };
        let rest = rest.trim_start();
        if let Some(tree) = rest.strip_prefix("use ") {
            for name in use_names(tree.trim_end_matches(';')) {
                match name {
                    UseName::Name(name) => {
                        items.insert(format!("{prefix}{name}"));
                    }
                    UseName::Glob(path) => {
                        let module = path.strip_prefix("self::").unwrap_or(&path);
                        let file = (!module.contains("::"))
                            .then(|| module_file(dir, module))
                            .flatten()
                            .unwrap_or_else(|| {
                                panic!("a glob re-export (`{path}::*`) cannot be listed")
                            });
                        exported(&read(&file), prefix, &dir.join(module), items);
                    }
                }
            }
            continue;
        }
        let words: Vec<&str> = rest
            .split(|c: char| !(c.is_alphanumeric() || c == '_'))
            .filter(|w| !w.is_empty())
            .skip_while(|w| matches!(*w, "unsafe" | "auto"))
            .collect();
        // `const fn`, `async fn`, `unsafe fn`, `extern "C" fn`: the name follows `fn`.
        // (Only after such qualifiers: `trait T { fn f(); }` is a trait.)
        let (kind, name) = match words.iter().position(|w| *w == "fn") {
            Some(at)
                if words[..at]
                    .iter()
                    .all(|w| matches!(*w, "const" | "async" | "unsafe" | "extern" | "C")) =>
            {
                ("fn", words[at + 1])
            }
            _ => (words[0], words[1]),
        };
        match kind {
            "mod" => {
                let path = format!("{prefix}{name}");
                items.insert(path.clone());
                let inner = if let Some(open) = statement.find('{') {
                    statement[open + 1..statement.len() - 1].to_owned()
                } else {
                    let file = module_file(dir, name)
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

// ---- the items the table names ----

/// The crate docs of the crate whose sources are in `src_dir`: the `//!` lines of
/// `src_dir/lib.rs` and the files its crate-level `#![doc = include_str!(..)]` attributes
/// include, in order. Only lines that start at the first column count: a nested module's
/// inner docs are its own.
pub fn crate_docs(src_dir: &Path) -> String {
    let lib = read(&src_dir.join("lib.rs"));
    let mut docs = String::new();
    for line in lib.lines() {
        if let Some(doc) = line.strip_prefix("//!") {
            docs.push_str(doc.strip_prefix(' ').unwrap_or(doc));
            docs.push('\n');
        } else if let Some(attribute) = line.strip_prefix("#![doc") {
            let path = attribute
                .split_once("include_str!(\"")
                .and_then(|(_, rest)| rest.split_once('"'))
                .map(|(path, _)| path)
                .unwrap_or_else(|| panic!("a doc attribute including a file: {line}"));
            docs.push_str(&read(&src_dir.join(path)));
            docs.push('\n');
        }
    }
    docs
}

/// The section of `docs` under the heading `title`, up to the next heading of its level or
/// above (headings in code blocks do not count). Panics if there is no such heading.
pub fn section<'a>(docs: &'a str, title: &str) -> &'a str {
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

/// An intra-doc link target as a path from the crate root: `crate::client::ClientLayer`
/// and ``[`client::ClientLayer`]`<P>` `` both give `client::ClientLayer`; `self` gives the
/// table's module; a URL gives nothing.
fn normalize(target: &str, table: &Table<'_>) -> Option<String> {
    let target = target.trim().trim_matches('`');
    let target = target.split('#').next().unwrap();
    if target.is_empty() || target.contains("://") {
        return None;
    }
    let target = target.split_once('@').map_or(target, |(_, path)| path);
    let target = target.trim_end_matches("()").trim_end_matches('!');
    if target == "self" {
        return (!table.module.is_empty()).then(|| table.module.to_owned());
    }
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
    let own = format!("{}::", table.crate_name);
    let path = path
        .strip_prefix("crate::")
        .or_else(|| path.strip_prefix(&own))
        .or_else(|| path.strip_prefix("self::"))
        .unwrap_or(&path);
    let is_path = !path.is_empty()
        && path
            .split("::")
            .all(|s| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_'));
    is_path.then(|| path.to_owned())
}

/// Every link target in `text`, as a path from the crate root: inline (`[text](target)`),
/// reference (`[text][label]`, with the label's definition in `definitions`), and shortcut
/// (``[`target`]``). Links in code blocks do not count.
pub fn link_targets(
    text: &str,
    definitions: &BTreeMap<String, String>,
    table: &Table<'_>,
) -> BTreeSet<String> {
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
            targets.extend(target.as_deref().and_then(|t| normalize(t, table)));
            rest = next;
        }
    }
    targets
}

/// The reference definitions (`[label]: target`) of `docs`.
pub fn definitions(docs: &str) -> BTreeMap<String, String> {
    docs.lines()
        .filter_map(|line| {
            let line = line.trim_start().strip_prefix('[')?;
            let (label, target) = line.split_once("]:")?;
            Some((label.to_owned(), target.trim().to_owned()))
        })
        .collect()
}

/// What the check finds wrong with the table in `docs` (the section titled `table.title`):
/// the exported `items` it does not name (`missing`), and the items it names at the root
/// or in a public module that are not exported (`unknown`), each sorted. Links to methods,
/// fields and variants (whose parent is not a module) and to `table.external` are not
/// checked.
pub fn check(
    items: &BTreeSet<String>,
    docs: &str,
    table: &Table<'_>,
) -> (Vec<String>, Vec<String>) {
    let named = link_targets(section(docs, table.title), &definitions(docs), table);
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
        .filter(|n| !table.external.iter().any(|e| n.starts_with(e)))
        .cloned()
        .collect();
    (missing, unknown)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_and_comments_hide_what_they_hold() {
        let code = r####"a /* b /* c */ d */ e // f
            g "h { \" i" j r#"k " { l"# m br##"n "# o"## p '{' q '\'' r '\u{7b}' s<'t> u b'"' v"####;
        assert_eq!(
            code_only(code),
            "a   e \n            g \"\" j \"\" m \"\" p ' ' q ' ' r ' ' s<'t> u b' ' v"
        );
    }

    #[test]
    fn hidden_items_globs_and_exported_macros() {
        let dir = std::env::temp_dir().join(crate::names::unique("api_table"));
        fs::create_dir_all(dir.join("checks")).unwrap();
        fs::write(
            dir.join("checks.rs"),
            "mod more;\npub use self::more::*;\npub fn one() {}\n\
             #[macro_export]\nmacro_rules! suite { () => { '{' } }\n",
        )
        .unwrap();
        fs::write(
            dir.join("checks").join("more.rs"),
            "pub async fn two() {}\npub(crate) fn not_exported() {}\n",
        )
        .unwrap();
        let code = r#"
            #![doc = include_str!("x.md")]
            pub mod checks;
            #[doc(hidden)]
            pub mod __private { pub use crate::x::*; }
            #[doc(hidden)] pub struct Hidden;
            pub unsafe trait Marker {}
            macro_rules! local { () => {} }
            pub use inner::{a::{b, c::*}};
        "#;
        let result = std::panic::catch_unwind(|| exported_in(code, &dir));
        assert!(result.is_err(), "a glob of another crate's path panics");
        let items = exported_in(&code.replace("pub use inner::{a::{b, c::*}};", ""), &dir);
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            items.iter().map(String::as_str).collect::<Vec<_>>(),
            ["Marker", "checks", "checks::one", "checks::two", "suite"]
        );
    }

    #[test]
    fn links_name_paths_from_the_crate_root() {
        let table = Table::new("my_crate")
            .in_module("guide")
            .external(&["other"]);
        let docs = "# Guide\n\n# Public API\n\n\
            [`A`], [`m::B`]`<T>`, [b](crate::m::C), [`my_crate::D`], [e][E], [guide](self),\n\
            [`f`](macro@f), [`m::G::method`], [`other`], [`other::H`], [`X`], [`m::Y`], [web](https://x.y)\n\
            ```\n[`InCode`]\n```\n\n# Next\n\n[`Later`]\n\n[E]: m::E\n";
        let named = link_targets(section(docs, "Public API"), &definitions(docs), &table);
        assert_eq!(
            named.iter().map(String::as_str).collect::<Vec<_>>(),
            [
                "A",
                "D",
                "X",
                "f",
                "guide",
                "m::B",
                "m::C",
                "m::E",
                "m::G::method",
                "m::Y",
                "other",
                "other::H"
            ]
        );
        let items: BTreeSet<String> = ["A", "D", "f", "guide", "m", "m::B", "m::C", "m::E"]
            .into_iter()
            .chain(["m::G", "m::Z", "Later"])
            .map(str::to_owned)
            .collect();
        let (missing, unknown) = check(&items, docs, &table);
        assert_eq!(missing, ["Later", "m", "m::G", "m::Z"]);
        assert_eq!(unknown, ["X", "m::Y"]);
    }
}

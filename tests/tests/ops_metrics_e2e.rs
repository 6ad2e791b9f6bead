//! The dashboard (`ops/grafana/idempotent.json`) and the alert rules
//! (`ops/prometheus/alerts.yml`, and the series their unit tests feed them) name only metrics
//! the examples really export at `/metrics`, in the form the exporter prints them: a metric
//! renamed in the code, or misspelt in `ops/`, fails here instead of leaving a panel empty or
//! an alert silent.
//!
//! The names are scraped from the `payments` example (memory store, so no server is needed)
//! with a completer (`IDEMPOTENCY_COMPLETER_AFTER`) and an in-process cache tier
//! (`IDEMPOTENCY_CACHE`), before any request: every metric is registered, at 0, when its
//! runtime starts, and an alert's `increase()` relies on that to see the first event.
//!
//! One family is not scraped: no example that serves `/metrics` runs the consumer runtime (the
//! `ledger` example serves none). Its names are derived from `idempotent-consumer`'s source
//! (its name constants and `describe_*!` calls) by the exporter's naming rule, and the rule is
//! first checked against the scrape on every metric of the core, the completer and the cache.
//!
//! Needs the `payments` example built (`cargo build -p examples --examples --all-features`;
//! `scripts/test.sh` builds it).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use idempotent_test_kit::process::within;
use support::{Client, Protocol, Server};

/// The workspace's root directory.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the tests crate is in the workspace")
        .to_path_buf()
}

fn read(path: &str) -> String {
    let full = root().join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

/// The names of the samples of a scrape in Prometheus's text format: a histogram's
/// `_bucket`, `_sum` and `_count`, never its bare family name, which PromQL cannot select.
fn sample_names(scrape: &str) -> BTreeSet<String> {
    scrape
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            line[..end].to_owned()
        })
        .collect()
}

/// The metric names a PromQL expression selects: its identifiers, less what is in label
/// matchers (`{…}`), ranges (`[…]`), strings, label lists (`by (…)`, `without`, `on`,
/// `ignoring`, `group_left`, `group_right`), function names (an identifier before `(`),
/// operators and aggregations, numbers, durations and Grafana's `$variables`.
fn metric_names(expr: &str) -> Vec<String> {
    const LABEL_LISTS: [&str; 6] = [
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    // Operators, and the aggregations (`sum by (job) (…)` puts no `(` after `sum`).
    const KEYWORDS: [&str; 17] = [
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
    ];
    let chars: Vec<char> = expr.chars().collect();
    // The index after the `close` that ends what opens at `from`, stepping over strings (a
    // label value may hold `}` or `]`) and escapes.
    fn skip_to(chars: &[char], from: usize, close: char) -> usize {
        let mut i = from + 1;
        while i < chars.len() && chars[i] != close {
            match chars[i] {
                '\\' => i += 2,
                quote @ ('"' | '\'' | '`') if quote != close => i = skip_to(chars, i, quote),
                _ => i += 1,
            }
        }
        i + 1
    }
    let word = |from: usize| {
        let mut i = from;
        while i < chars.len() && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':'))
        {
            i += 1;
        }
        i
    };
    let mut names = Vec::new();
    let mut label_list_next = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if matches!(c, '"' | '\'' | '`') {
            i = skip_to(&chars, i, c);
        } else if c == '{' {
            i = skip_to(&chars, i, '}');
        } else if c == '[' {
            i = skip_to(&chars, i, ']');
        } else if c == '(' && label_list_next {
            i = skip_to(&chars, i, ')');
            label_list_next = false;
        } else if c == '$' || c.is_ascii_digit() || c == '.' {
            // A Grafana variable, a number, a duration (`offset 5m`).
            i = word(i + 1);
            label_list_next = false;
        } else if c.is_ascii_alphabetic() || matches!(c, '_' | ':') {
            let end = word(i);
            let ident: String = chars[i..end].iter().collect();
            let next = chars[end..].iter().find(|c| !c.is_whitespace());
            label_list_next = LABEL_LISTS.contains(&ident.as_str());
            if !label_list_next && !KEYWORDS.contains(&ident.as_str()) && next != Some(&'(') {
                names.push(ident);
            }
            i = end;
        } else {
            i += 1;
        }
    }
    names
}

/// Every `expr` of the dashboard's panels.
fn dashboard_exprs() -> Vec<String> {
    fn collect(value: &serde_json::Value, into: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(fields) => {
                for (name, field) in fields {
                    match (name.as_str(), field) {
                        ("expr", serde_json::Value::String(expr)) => into.push(expr.clone()),
                        _ => collect(field, into),
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|item| collect(item, into)),
            _ => {}
        }
    }
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("ops/grafana/idempotent.json")).expect("the dashboard is JSON");
    let mut exprs = Vec::new();
    collect(&dashboard["panels"], &mut exprs);
    exprs
}

/// The values of `key:` in a YAML file, on one line or as a block scalar (`key: |`, `>`).
fn yaml_values(yaml: &str, key: &str) -> Vec<String> {
    let lines: Vec<&str> = yaml.lines().collect();
    let mut values = Vec::new();
    for (n, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start().trim_start_matches("- ");
        let Some(rest) = trimmed.strip_prefix(key).and_then(|r| r.strip_prefix(':')) else {
            continue;
        };
        let rest = rest.trim();
        if rest.starts_with(['|', '>']) {
            let indent = line.len() - line.trim_start().len();
            let block: Vec<&str> = lines[n + 1..]
                .iter()
                .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > indent)
                .map(|l| l.trim())
                .collect();
            values.push(block.join("\n"));
        } else {
            values.push(rest.trim_matches(['\'', '"']).to_owned());
        }
    }
    values
}

/// Every alert's `expr`, one per alert.
fn alert_exprs() -> Vec<String> {
    let rules = read("ops/prometheus/alerts.yml");
    let exprs = yaml_values(&rules, "expr");
    let alerts = yaml_values(&rules, "alert");
    assert_eq!(
        exprs.len(),
        alerts.len(),
        "one expr per alert in alerts.yml: {alerts:?}"
    );
    exprs
}

/// The Prometheus sample names of the metrics a crate describes: the names its
/// `describe_counter!`, `describe_gauge!` and `describe_histogram!` calls give (a literal, or a
/// `pub const` of `constants`), turned into what `metrics-exporter-prometheus` prints with its
/// recommended naming: dots become underscores, the unit is appended (`_seconds`), a counter
/// gets `_total`, a histogram (with buckets, as the examples configure it) `_bucket`, `_sum`
/// and `_count`.
fn described_names(constants: &str, describes: &str) -> BTreeSet<String> {
    let consts: BTreeMap<&str, &str> = constants
        .lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("pub const ")?;
            let (name, value) = rest.split_once(": &str = \"")?;
            Some((name, value.strip_suffix("\";")?))
        })
        .collect();
    let mut names = BTreeSet::new();
    let calls: Vec<(&str, &str)> = ["counter", "gauge", "histogram"]
        .into_iter()
        .flat_map(|kind| {
            let call = format!("describe_{kind}!(");
            describes
                .match_indices(&call)
                .map(|(at, _)| (kind, &describes[at + call.len()..]))
                .collect::<Vec<_>>()
        })
        .collect();
    for (kind, mut rest) in calls {
        let mut argument = || {
            let (argument, after) = rest.split_once(',').expect("a describe_*! argument");
            rest = after;
            argument.trim()
        };
        let (name, unit) = (argument(), argument());
        let name = match name.strip_prefix('"') {
            Some(literal) => literal.trim_end_matches('"'),
            None => consts
                .get(name)
                .unwrap_or_else(|| panic!("no `pub const {name}` in the constants")),
        };
        let unit = match unit.rsplit("::").next() {
            Some("Seconds") => "_seconds",
            Some("Count") => "",
            other => panic!("{name}: unit {other:?}: teach this test its exporter suffix"),
        };
        let base = format!("{}{unit}", name.replace('.', "_"));
        match kind {
            "counter" => {
                names.insert(format!("{base}_total"));
            }
            "gauge" => {
                names.insert(base);
            }
            _ => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{base}{suffix}"));
                }
            }
        }
    }
    names
}

#[test]
fn metric_names_are_read_out_of_promql() {
    let expr = r#"sum by (job, store, result) (rate(a_total{result!~"ok|b_total", job=~"$job"}[5m]))
        / ignoring (result) group_left
      sum by (job) (rate(b_count[$__rate_interval] offset 1h)) > 0.01
      unless histogram_quantile(0.99, sum by (le) (rate(c_bucket{x="{y}"}[5m]))) > bool 1e3
      and on (instance) d:recorded or sum(e) without (le)"#;
    assert_eq!(
        metric_names(expr),
        ["a_total", "b_count", "c_bucket", "d:recorded", "e"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_name_is_exported() {
    let server = Server::payments(&[
        ("IDEMPOTENCY_COMPLETER_AFTER", "1m"),
        ("IDEMPOTENCY_CACHE", "memory:100"),
    ])
    .await;
    let scrape = within(
        "GET /metrics",
        Duration::from_secs(30),
        Client::new(Protocol::Http1).get(&server.url("/metrics")),
    )
    .await;
    assert!(
        scrape.status.is_success(),
        "GET /metrics: {}",
        scrape.status
    );
    let scraped = sample_names(&String::from_utf8_lossy(&scrape.body));

    // The naming rule, checked on every family the scrape has.
    let core = read("idempotent-core/src/metrics.rs");
    let cache = read("idempotent-cache/src/lib.rs");
    let checked = [
        described_names(&core, &core),
        described_names("", &read("idempotent-tower/src/completer/mod.rs")),
        described_names(&cache, &cache),
    ];
    for names in &checked {
        assert!(!names.is_empty(), "no describe_*! call found");
        let missing: Vec<_> = names.difference(&scraped).collect();
        assert!(
            missing.is_empty(),
            "the naming rule of this test is not the exporter's: {missing:?} not in the scrape \
             {scraped:?}"
        );
    }
    let consumer = described_names(
        &read("idempotent-consumer/src/lib.rs"),
        &read("idempotent-consumer/src/runner.rs"),
    );
    assert!(
        consumer.contains("idempotency_message_dead_letters_total"),
        "{consumer:?}"
    );
    let exported: BTreeSet<&String> = scraped.iter().chain(&consumer).collect();

    let named = |exprs: Vec<String>| -> BTreeSet<String> {
        assert!(!exprs.is_empty(), "no expression found");
        exprs.iter().flat_map(|expr| metric_names(expr)).collect()
    };
    let dashboard = named(dashboard_exprs());
    let alerts = named(alert_exprs());
    let series = named(yaml_values(
        &read("ops/prometheus/alerts_test.yml"),
        "series",
    ));
    assert!(
        dashboard.len() >= 10,
        "the dashboard names only {dashboard:?}"
    );
    assert!(alerts.len() >= 5, "the alerts name only {alerts:?}");
    for (what, names) in [
        ("ops/grafana/idempotent.json", &dashboard),
        ("ops/prometheus/alerts.yml", &alerts),
        ("ops/prometheus/alerts_test.yml", &series),
    ] {
        let unknown: Vec<_> = names.iter().filter(|n| !exported.contains(n)).collect();
        assert!(
            unknown.is_empty(),
            "{what} names metrics no example exports: {unknown:?}\nexported: {exported:?}"
        );
    }
    let used: BTreeSet<&String> = dashboard.iter().chain(&alerts).collect();
    println!(
        "{} metric names in ops/, all exported: {used:?}",
        used.len()
    );
}

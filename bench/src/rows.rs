//! The rows of the HTTP benchmark: which implementation, on which store, under which traffic.

/// The middleware in front of the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Implementation {
    /// No idempotency: the handler alone.
    Bare,
    /// `idempotent_tower::IdempotencyLayer`.
    Tower,
    /// The `idempotent` 2.0 crate's `middleware::IdempotencyLayer`.
    Idempotent2,
    /// The `axum-idempotent` 0.6 crate's `IdempotentLayer` (on a `ruts` session).
    AxumIdempotent,
}

impl Implementation {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Implementation::Bare => "bare",
            Implementation::Tower => "idempotent-tower",
            Implementation::Idempotent2 => "idempotent-2.0",
            Implementation::AxumIdempotent => "axum-idempotent-0.6",
        }
    }

    /// Whether this binary was built with the peer crates (`--cfg idempotent_bench_peers`).
    pub(crate) fn is_compiled_in(self) -> bool {
        match self {
            Implementation::Bare | Implementation::Tower => true,
            Implementation::Idempotent2 | Implementation::AxumIdempotent => {
                cfg!(idempotent_bench_peers)
            }
        }
    }
}

/// Which keys the load generator sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    /// No idempotency in the server (the `bare` row); keys as in `Fresh`.
    None,
    /// A new key for every request.
    Fresh,
    /// Each connection cycles over its own few keys, created before the timed phase.
    Replay,
}

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::None => "none",
            Scenario::Fresh => "fresh",
            Scenario::Replay => "replay",
        }
    }
}

/// Where the records live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StoreKind {
    None,
    Memory,
    Redis,
    Postgres,
}

impl StoreKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            StoreKind::None => "none",
            StoreKind::Memory => "memory",
            StoreKind::Redis => "redis",
            StoreKind::Postgres => "postgres",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Row {
    pub(crate) implementation: Implementation,
    pub(crate) scenario: Scenario,
    pub(crate) store: StoreKind,
    /// Records in the store before the row starts (`scale.rs`); 0 for the usual rows.
    pub(crate) prefilled: u64,
}

impl Row {
    pub(crate) fn label(&self) -> String {
        let label = format!(
            "{}/{}/{}",
            self.implementation.name(),
            self.scenario.name(),
            self.store.name()
        );
        match self.prefilled {
            0 => label,
            n => format!("{label}+{}", count_name(n)),
        }
    }

    /// Whether `filter` (comma-separated) selects this row: an item matches a row when it
    /// equals the implementation, the scenario or the store, or when it contains a `/` and
    /// starts the label `implementation/scenario/store`. An empty filter selects every row.
    pub(crate) fn selected_by(&self, filter: &[String]) -> bool {
        if self.prefilled > 0 && filter.iter().any(|item| item == "prefilled") {
            return true;
        }
        selects(
            filter,
            [
                self.implementation.name(),
                self.scenario.name(),
                self.store.name(),
            ],
        )
    }
}

/// Whether `filter` selects the row whose implementation, scenario and store are `parts`:
/// see [`Row::selected_by`].
pub(crate) fn selects(filter: &[String], parts: [&str; 3]) -> bool {
    let label = parts.join("/");
    filter.is_empty()
        || filter.iter().any(|item| {
            parts.contains(&item.as_str())
                || (item.contains('/') && label.starts_with(item.as_str()))
        })
}

/// Every row, in table order: `bare`, ours on memory, the peers, ours on the shared stores
/// (those only when their URL is known).
pub(crate) fn all_rows(redis: bool, postgres: bool) -> Vec<Row> {
    let mut rows = vec![Row {
        implementation: Implementation::Bare,
        scenario: Scenario::None,
        store: StoreKind::None,
        prefilled: 0,
    }];
    let both = |implementation, store| {
        [Scenario::Fresh, Scenario::Replay].map(|scenario| Row {
            implementation,
            scenario,
            store,
            prefilled: 0,
        })
    };
    rows.extend(both(Implementation::Tower, StoreKind::Memory));
    rows.extend(both(Implementation::Idempotent2, StoreKind::Memory));
    rows.extend(both(Implementation::AxumIdempotent, StoreKind::Memory));
    if redis {
        rows.extend(both(Implementation::Tower, StoreKind::Redis));
    }
    if postgres {
        rows.extend(both(Implementation::Tower, StoreKind::Postgres));
    }
    rows
}

/// The `idempotent-tower` rows again with `records` already in each store: memory, and Redis
/// and PostgreSQL when their URL is known.
pub(crate) fn prefilled_rows(records: u64, redis: bool, postgres: bool) -> Vec<Row> {
    let stores = [
        (StoreKind::Memory, true),
        (StoreKind::Redis, redis),
        (StoreKind::Postgres, postgres),
    ];
    stores
        .into_iter()
        .filter(|(_, known)| *known)
        .flat_map(|(store, _)| {
            [Scenario::Fresh, Scenario::Replay].map(|scenario| Row {
                implementation: Implementation::Tower,
                scenario,
                store,
                prefilled: records,
            })
        })
        .collect()
}

/// `1M`, `10M`, `250k`, or the number itself.
pub(crate) fn count_name(n: u64) -> String {
    match n {
        n if n >= 1_000_000 && n % 1_000_000 == 0 => format!("{}M", n / 1_000_000),
        n if n >= 1_000 && n % 1_000 == 0 => format!("{}k", n / 1_000),
        n => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_in_table_order() {
        let labels: Vec<String> = all_rows(true, false).iter().map(Row::label).collect();
        assert_eq!(
            labels,
            [
                "bare/none/none",
                "idempotent-tower/fresh/memory",
                "idempotent-tower/replay/memory",
                "idempotent-2.0/fresh/memory",
                "idempotent-2.0/replay/memory",
                "axum-idempotent-0.6/fresh/memory",
                "axum-idempotent-0.6/replay/memory",
                "idempotent-tower/fresh/redis",
                "idempotent-tower/replay/redis",
            ]
        );
        assert_eq!(all_rows(true, true).len(), 11);
    }

    #[test]
    fn filters() {
        let rows = all_rows(true, true);
        let pick = |filter: &[&str]| -> Vec<String> {
            let filter: Vec<String> = filter.iter().map(|s| s.to_string()).collect();
            rows.iter()
                .filter(|r| r.selected_by(&filter))
                .map(Row::label)
                .collect()
        };
        assert_eq!(pick(&[]).len(), 11);
        assert_eq!(pick(&["bare", "postgres"]).len(), 3);
        assert_eq!(
            pick(&["idempotent-tower/replay"]),
            [
                "idempotent-tower/replay/memory",
                "idempotent-tower/replay/redis",
                "idempotent-tower/replay/postgres"
            ]
        );
        assert_eq!(pick(&["idempotent"]).len(), 0, "no partial names");
    }

    #[test]
    fn prefilled_rows_and_their_labels() {
        let rows = prefilled_rows(10_000_000, false, true);
        let labels: Vec<String> = rows.iter().map(Row::label).collect();
        assert_eq!(
            labels,
            [
                "idempotent-tower/fresh/memory+10M",
                "idempotent-tower/replay/memory+10M",
                "idempotent-tower/fresh/postgres+10M",
                "idempotent-tower/replay/postgres+10M",
            ]
        );
        let only =
            |items: &[&str]| -> Vec<String> { items.iter().map(|s| s.to_string()).collect() };
        assert!(rows.iter().all(|r| r.selected_by(&only(&["prefilled"]))));
        assert!(
            !all_rows(true, true)
                .iter()
                .any(|r| r.selected_by(&only(&["prefilled"])))
        );
        assert_eq!(
            rows.iter()
                .filter(|r| r.selected_by(&only(&["postgres"])))
                .count(),
            2
        );
        assert_eq!(count_name(1_000_000), "1M");
        assert_eq!(count_name(250_000), "250k");
        assert_eq!(count_name(1_234), "1234");
    }
}

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
    /// The least a layer can do and answer each key once (`floor.rs`), on memory, Redis or
    /// PostgreSQL: the summary's `floor` column.
    Floor,
}

impl Implementation {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Implementation::Bare => "bare",
            Implementation::Tower => "idempotent-tower",
            Implementation::Idempotent2 => "idempotent-2.0",
            Implementation::AxumIdempotent => "axum-idempotent-0.6",
            Implementation::Floor => "floor",
        }
    }

    /// Whether this binary was built with the peer crates (`--cfg idempotent_bench_peers`).
    pub(crate) fn is_compiled_in(self) -> bool {
        match self {
            Implementation::Bare | Implementation::Tower | Implementation::Floor => true,
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
    /// No key: each connection is a client session of its own (`Idempotency-Session`), its
    /// requests numbered 1, 2, 3, … each acknowledging the answer before it.
    Session,
}

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::None => "none",
            Scenario::Fresh => "fresh",
            Scenario::Replay => "replay",
            Scenario::Session => "session",
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

/// The cache tier in front of the store (`idempotent-cache`), if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cache {
    None,
    /// `CacheTier::memory`: finished records in the server's process.
    Memory,
    /// `CacheTier::redis`: finished records in Redis (the Redis rows' server, a key prefix of
    /// its own), in front of a slower store.
    Redis,
}

impl Cache {
    /// What the row's store name gets after a `+`: `memcache`, `rediscache`; empty for none.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Cache::None => "",
            Cache::Memory => "memcache",
            Cache::Redis => "rediscache",
        }
    }
}

/// One row of the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Row {
    pub(crate) implementation: Implementation,
    pub(crate) scenario: Scenario,
    pub(crate) store: StoreKind,
    /// The cache tier in front of the store; `Cache::None` for the usual rows.
    pub(crate) cache: Cache,
    /// Records in the store before the row starts (`scale.rs`); 0 for the usual rows.
    pub(crate) prefilled: u64,
}

impl Row {
    /// The store as the table names it: `redis`, or with its cache tier, `redis+memcache`.
    pub(crate) fn store_name(&self) -> String {
        match self.cache {
            Cache::None => self.store.name().to_owned(),
            cache => format!("{}+{}", self.store.name(), cache.name()),
        }
    }

    pub(crate) fn label(&self) -> String {
        let label = format!(
            "{}/{}/{}",
            self.implementation.name(),
            self.scenario.name(),
            self.store_name()
        );
        match self.prefilled {
            0 => label,
            n => format!("{label}+{}", count_name(n)),
        }
    }

    /// Whether `filter` (comma-separated) selects this row: an item matches a row when it
    /// equals the implementation, the scenario or the store, or when it contains a `/` and
    /// starts the label `implementation/scenario/store`. An empty filter selects every row.
    /// A row with a cache tier is also selected by its store with the tier
    /// (`postgres+rediscache`), by the tier's name (`memcache`, `rediscache`), by `cache`, and
    /// by a prefix of its whole label (`idempotent-tower/replay/redis+memcache`). An item
    /// that begins with `=` selects the one row whose whole label follows it
    /// (`=idempotent-tower/fresh/redis`, not the same row behind a tier or prefilled).
    pub(crate) fn selected_by(&self, filter: &[String]) -> bool {
        if self.prefilled > 0 && filter.iter().any(|item| item == "prefilled") {
            return true;
        }
        if self.cache != Cache::None {
            let (store, label) = (self.store_name(), self.label());
            if filter.iter().any(|item| {
                [store.as_str(), self.cache.name(), "cache"].contains(&item.as_str())
                    || (item.contains('/') && label.starts_with(item.as_str()))
            }) {
                return true;
            }
        }
        selects(
            filter,
            [
                self.implementation.name(),
                self.scenario.name(),
                self.store.name(),
            ],
            &self.label(),
        )
    }
}

/// Whether `filter` selects the row whose implementation, scenario and store are `parts` and
/// whose whole label is `label`: see [`Row::selected_by`].
pub(crate) fn selects(filter: &[String], parts: [&str; 3], label: &str) -> bool {
    let prefixed = parts.join("/");
    filter.is_empty()
        || filter.iter().any(|item| match item.strip_prefix('=') {
            Some(exact) => exact == label,
            None => {
                parts.contains(&item.as_str())
                    || (item.contains('/') && prefixed.starts_with(item.as_str()))
            }
        })
}

/// Every row, in table order: `bare`, the floor (`floor.rs`), ours on memory, the peers, ours on the shared stores,
/// then ours on the shared stores behind a cache tier: the in-process tier in front of Redis
/// and of PostgreSQL, and Redis in front of PostgreSQL (each only when the URLs it needs are
/// known). Ours on a store without a tier also has a `session` row after its `replay` row,
/// and on Redis and PostgreSQL the floor's rows after it.
pub(crate) fn all_rows(redis: bool, postgres: bool) -> Vec<Row> {
    let mut rows = vec![Row {
        implementation: Implementation::Bare,
        scenario: Scenario::None,
        store: StoreKind::None,
        cache: Cache::None,
        prefilled: 0,
    }];
    let both = |implementation, store, cache| {
        [Scenario::Fresh, Scenario::Replay].map(|scenario| Row {
            implementation,
            scenario,
            store,
            cache,
            prefilled: 0,
        })
    };
    let session = |store| Row {
        implementation: Implementation::Tower,
        scenario: Scenario::Session,
        store,
        cache: Cache::None,
        prefilled: 0,
    };
    rows.extend(both(Implementation::Floor, StoreKind::Memory, Cache::None));
    rows.extend(both(Implementation::Tower, StoreKind::Memory, Cache::None));
    rows.push(session(StoreKind::Memory));
    rows.extend(both(
        Implementation::Idempotent2,
        StoreKind::Memory,
        Cache::None,
    ));
    rows.extend(both(
        Implementation::AxumIdempotent,
        StoreKind::Memory,
        Cache::None,
    ));
    let tower = |store, cache| both(Implementation::Tower, store, cache);
    let floor = |store| both(Implementation::Floor, store, Cache::None);
    if redis {
        rows.extend(tower(StoreKind::Redis, Cache::None));
        rows.push(session(StoreKind::Redis));
        rows.extend(floor(StoreKind::Redis));
    }
    if postgres {
        rows.extend(tower(StoreKind::Postgres, Cache::None));
        rows.push(session(StoreKind::Postgres));
        rows.extend(floor(StoreKind::Postgres));
    }
    if redis {
        rows.extend(tower(StoreKind::Redis, Cache::Memory));
    }
    if postgres {
        rows.extend(tower(StoreKind::Postgres, Cache::Memory));
    }
    if redis && postgres {
        rows.extend(tower(StoreKind::Postgres, Cache::Redis));
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
                cache: Cache::None,
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
                "floor/fresh/memory",
                "floor/replay/memory",
                "idempotent-tower/fresh/memory",
                "idempotent-tower/replay/memory",
                "idempotent-tower/session/memory",
                "idempotent-2.0/fresh/memory",
                "idempotent-2.0/replay/memory",
                "axum-idempotent-0.6/fresh/memory",
                "axum-idempotent-0.6/replay/memory",
                "idempotent-tower/fresh/redis",
                "idempotent-tower/replay/redis",
                "idempotent-tower/session/redis",
                "floor/fresh/redis",
                "floor/replay/redis",
                "idempotent-tower/fresh/redis+memcache",
                "idempotent-tower/replay/redis+memcache",
            ]
        );
        let labels: Vec<String> = all_rows(true, true).iter().map(Row::label).collect();
        assert_eq!(
            labels[10..],
            [
                "idempotent-tower/fresh/redis",
                "idempotent-tower/replay/redis",
                "idempotent-tower/session/redis",
                "floor/fresh/redis",
                "floor/replay/redis",
                "idempotent-tower/fresh/postgres",
                "idempotent-tower/replay/postgres",
                "idempotent-tower/session/postgres",
                "floor/fresh/postgres",
                "floor/replay/postgres",
                "idempotent-tower/fresh/redis+memcache",
                "idempotent-tower/replay/redis+memcache",
                "idempotent-tower/fresh/postgres+memcache",
                "idempotent-tower/replay/postgres+memcache",
                "idempotent-tower/fresh/postgres+rediscache",
                "idempotent-tower/replay/postgres+rediscache",
            ]
        );
        assert_eq!(all_rows(true, true).len(), 26);
        let postgres_only: Vec<String> =
            all_rows(false, true)[10..].iter().map(Row::label).collect();
        assert_eq!(
            postgres_only,
            [
                "idempotent-tower/fresh/postgres",
                "idempotent-tower/replay/postgres",
                "idempotent-tower/session/postgres",
                "floor/fresh/postgres",
                "floor/replay/postgres",
                "idempotent-tower/fresh/postgres+memcache",
                "idempotent-tower/replay/postgres+memcache",
            ],
            "Redis in front of PostgreSQL needs both"
        );
        assert_eq!(all_rows(false, false).len(), 10);
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
        assert_eq!(pick(&[]).len(), 26);
        assert_eq!(
            pick(&["=idempotent-tower/fresh/redis"]),
            ["idempotent-tower/fresh/redis"],
            "an exact label, not the same row behind a tier"
        );
        assert_eq!(
            pick(&[
                "=idempotent-tower/fresh/redis+memcache",
                "=floor/fresh/redis"
            ]),
            ["floor/fresh/redis", "idempotent-tower/fresh/redis+memcache"]
        );
        assert!(pick(&["=idempotent-tower/fresh"]).is_empty(), "no prefix");
        assert!(pick(&["=redis"]).is_empty(), "no part");
        assert_eq!(
            pick(&["bare", "postgres"]).len(),
            10,
            "bare and every row on PostgreSQL, with or without a cache tier"
        );
        assert_eq!(
            pick(&["idempotent-tower/replay"]),
            [
                "idempotent-tower/replay/memory",
                "idempotent-tower/replay/redis",
                "idempotent-tower/replay/postgres",
                "idempotent-tower/replay/redis+memcache",
                "idempotent-tower/replay/postgres+memcache",
                "idempotent-tower/replay/postgres+rediscache",
            ]
        );
        assert_eq!(pick(&["idempotent"]).len(), 0, "no partial names");
        assert_eq!(
            pick(&["floor"]),
            [
                "floor/fresh/memory",
                "floor/replay/memory",
                "floor/fresh/redis",
                "floor/replay/redis",
                "floor/fresh/postgres",
                "floor/replay/postgres",
            ]
        );
        assert_eq!(pick(&["idempotent-tower"]).len(), 15);
        assert_eq!(
            pick(&["session"]),
            [
                "idempotent-tower/session/memory",
                "idempotent-tower/session/redis",
                "idempotent-tower/session/postgres",
            ]
        );
        assert_eq!(
            pick(&["redis"]),
            [
                "idempotent-tower/fresh/redis",
                "idempotent-tower/replay/redis",
                "idempotent-tower/session/redis",
                "floor/fresh/redis",
                "floor/replay/redis",
                "idempotent-tower/fresh/redis+memcache",
                "idempotent-tower/replay/redis+memcache",
            ],
            "the store, not the tier"
        );
        let cached = [
            "idempotent-tower/fresh/redis+memcache",
            "idempotent-tower/replay/redis+memcache",
            "idempotent-tower/fresh/postgres+memcache",
            "idempotent-tower/replay/postgres+memcache",
            "idempotent-tower/fresh/postgres+rediscache",
            "idempotent-tower/replay/postgres+rediscache",
        ];
        assert_eq!(pick(&["cache"]), cached);
        assert_eq!(pick(&["memcache"]), cached[..4]);
        assert_eq!(pick(&["rediscache"]), cached[4..]);
        assert_eq!(pick(&["postgres+rediscache"]), cached[4..]);
        assert_eq!(
            pick(&["postgres+memcache", "replay"]).len(),
            1 + 11,
            "its fresh row, and the 11 replay rows"
        );
        assert_eq!(
            pick(&["idempotent-tower/replay/postgres+memcache"]),
            ["idempotent-tower/replay/postgres+memcache"]
        );
        assert_eq!(
            pick(&["idempotent-tower/fresh/postgres+"]),
            [
                "idempotent-tower/fresh/postgres+memcache",
                "idempotent-tower/fresh/postgres+rediscache",
            ]
        );
        assert_eq!(pick(&["redis+"]).len(), 0, "no partial names");
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
        let exact = |item: &str| -> Vec<String> {
            rows.iter()
                .filter(|r| r.selected_by(&only(&[item])))
                .map(Row::label)
                .collect()
        };
        assert_eq!(
            exact("=idempotent-tower/fresh/postgres+10M"),
            ["idempotent-tower/fresh/postgres+10M"]
        );
        assert!(exact("=idempotent-tower/fresh/postgres").is_empty());
        assert_eq!(count_name(1_000_000), "1M");
        assert_eq!(count_name(250_000), "250k");
        assert_eq!(count_name(1_234), "1234");
    }
}

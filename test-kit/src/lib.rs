//! The fixtures the workspace's test suites share, in one copy: the test environment's servers
//! and the rule for one that is missing ([`backend`]), free ports and unique names ([`names`]),
//! processes, signals and bounded waits ([`process`]), network namespaces to partition
//! servers from the host ([`netns`]), PostgreSQL pools, databases and private
//! servers ([`postgres`]), shared and private Redis servers ([`redis`]), the Redis Cluster
//! ([`cluster`]), and private NATS and RabbitMQ brokers ([`brokers`]); and the check that a
//! crate's "Public API" table names every public item it exports ([`api_table`]).
//!
//! It hands out URLs, `sqlx::PgPool`s (feature `postgres`), `redis` connections (feature
//! `redis`) and child processes, never a type of the idempotent crates: it depends on none of them, so that their tests, which use it,
//! see one copy of each of their types.

pub mod api_table;
pub mod backend;
pub mod brokers;
#[cfg(feature = "redis")]
pub mod cluster;
pub mod names;
pub mod netns;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod process;
#[cfg(feature = "redis")]
pub mod redis;

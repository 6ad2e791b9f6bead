//! Checkpoints on PostgreSQL: the saved request a completer lists ([`CheckpointStore::abandoned`]), and
//! the atomic step, whose effect and checkpoint commit in one transaction
//! ([`PostgresStore::step_in_transaction`]).
//!
//! [`CheckpointStore::abandoned`]: idempotent_core::CheckpointStore::abandoned

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;
use sqlx::Row as _;
use sqlx::postgres::{PgRow, Postgres};

use super::error::corrupt;
use super::{PostgresStore, store_error, token_param};
use idempotent_core::steps::Abandoned;
use idempotent_core::{ClaimHandle, Error, Fingerprint, StepError, StorageKey, StoreError};

impl PostgresStore {
    /// Runs `work` as the operation's step `name` in a transaction of its own that also writes
    /// the step's checkpoint, so that the step's database effect and its checkpoint commit
    /// together or not at all: an *atomic step* (a [step](ClaimHandle::try_step) with no gap
    /// between the effect and the checkpoint).
    ///
    /// `claim` is the running call's claim ([`ClaimHandle::current`] inside
    /// [`Idempotency::run`](idempotent_core::Idempotency::run)), made by a runtime over this store:
    ///
    /// 1. If the operation saved a result for `name` (an earlier attempt's step committed),
    ///    returns it without running `work`.
    /// 2. Otherwise begins a transaction on this store's [pool](Self::pool) and hands it to
    ///    `work`. Run your statements on it (`&mut *tx`) and hand it back with the step's
    ///    value: `Ok((tx, value))`.
    /// 3. Appends the checkpoint to the claim's row *in that transaction*, fenced by the
    ///    claim's token (the row must still be in flight with this token and its lease not
    ///    ended), then commits.
    ///
    /// What each outcome leaves:
    ///
    /// - `Ok(value)`: the work's writes and the checkpoint are committed; every later attempt
    ///   of the operation gets `value` back without running the work.
    /// - [`StepError::Failed`]: `work` returned `Err`; the transaction it was handed is dropped
    ///   with it, so its writes are rolled back and nothing is saved. A later attempt runs the
    ///   step again.
    /// - [`StepError::Idempotency`] with [`Error::ClaimLost`]: the claim was lost before the
    ///   step (nothing ran) or when its checkpoint was written (another owner took the
    ///   operation over, or the lease ended): the transaction is rolled back, the work's
    ///   writes with it. A stale owner cannot commit a step.
    /// - [`StepError::Idempotency`] with [`CheckpointError`](idempotent_core::steps::CheckpointError):
    ///   an invalid name (nothing ran), or a checkpoint past
    ///   [`Defaults::max_checkpoint_bytes`](idempotent_core::Defaults::max_checkpoint_bytes) (the
    ///   transaction is rolled back).
    /// - [`StepError::Idempotency`] with [`Error::Store`]: the transaction could not begin, or
    ///   the checkpoint or the commit failed (rolled back), or the database did not answer the
    ///   checkpoint and the commit within the claim's write bound (a sixth of its lease, like
    ///   a renewal). After a failed or unanswered `COMMIT` the outcome is unknown, as for any
    ///   commit: a later attempt either finds the checkpoint (and the effect) or runs the step
    ///   again.
    ///
    /// If a step of the same name was saved by this claim while `work` ran (two tasks of one
    /// call running the same step), this one is rolled back and the saved value returned.
    ///
    /// The transaction runs at the database's default isolation level. Under `REPEATABLE
    /// READ` or `SERIALIZABLE` (set as the work's first statement), a renewal of the claim
    /// that commits while the work runs makes the checkpoint fail with a serialization error
    /// ([`StoreError::Unavailable`]), rolled back: keep atomic steps at `READ COMMITTED`, or
    /// retry. While the checkpoint's transaction commits, it holds the claim's row: the
    /// claim's renewals wait for it.
    ///
    /// The claim must come from a runtime over this store: a [`PostgresStore`] on the same
    /// table and database (directly, in an `AnyStore`, or behind a cache tier: told by
    /// [`Store::location`](idempotent_core::Store::location)); any other claim is refused with
    /// [`StoreError::Backend`] before anything runs.
    /// A claim of the [transactional mode](super::Transactional)
    /// ([`PendingRecord::claim`](super::PendingRecord::claim)) is refused with
    /// [`StoreError::Backend`] and nothing runs: there the whole operation is the caller's one
    /// transaction, and a step committed in a transaction of its own would stay when the
    /// caller's rolls back, so the retry would make its effect again. Run the step's
    /// statements in the caller's transaction instead.
    ///
    /// ```no_run
    /// use idempotent_postgres::PostgresStore;
    /// use idempotent_core::{Call, ClaimHandle, Error, Idempotency};
    ///
    /// # async fn example(store: PostgresStore) -> Result<(), Error> {
    /// let idempotency = Idempotency::new(store.clone());
    /// let call = Call::new("order-7".parse()?);
    /// let order = idempotency
    ///     .run(&call, async {
    ///         let claim = ClaimHandle::current().expect("inside run");
    ///         // The reservation row and the step's checkpoint commit together: a retry after
    ///         // a crash either finds both or neither, and never reserves twice.
    ///         let reservation: i64 = store
    ///             .step_in_transaction(&claim, "reserve", |mut tx| async move {
    ///                 let id: i64 = sqlx::query_scalar(
    ///                     "INSERT INTO reservations (sku, quantity) VALUES ('sku-1', 2) RETURNING id",
    ///                 )
    ///                 .fetch_one(&mut *tx)
    ///                 .await?;
    ///                 Ok::<_, sqlx::Error>((tx, id))
    ///             })
    ///             .await
    ///             .map_err(|e| e.to_string())?;
    ///         Ok::<_, String>(reservation)
    ///     })
    ///     .await?
    ///     .into_inner();
    /// # let _ = order;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn step_in_transaction<T, E, F, Fut>(
        &self,
        claim: &ClaimHandle,
        name: &str,
        work: F,
    ) -> Result<T, StepError<E>>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(sqlx::Transaction<'static, Postgres>) -> Fut,
        Fut: Future<Output = Result<(sqlx::Transaction<'static, Postgres>, T), E>>,
    {
        if !claim.keeps_checkpoints() {
            return Err(StepError::Idempotency(Error::Store(StoreError::Backend(
                "step_in_transaction: a claim of the transactional mode has no checkpoints; \
                 run the step's statements in the caller's transaction"
                    .into(),
            ))));
        }
        self.check_claim_store(claim)
            .map_err(|e| StepError::Idempotency(Error::Store(e)))?;
        match claim.saved_step::<T>(name).await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => return Err(StepError::Idempotency(error)),
        }
        let begun = self.pool.begin().await;
        let tx = begun.map_err(|e| StepError::Idempotency(Error::Store(store_error(e))))?;
        let (tx, value) = work(tx).await.map_err(StepError::Failed)?;
        let mut written = false;
        let record = claim.record_step(name, &value, {
            let written = &mut written;
            let (sql, key, token) = (Arc::clone(&self.sql), claim.storage_key(), claim.token());
            move |entry: Bytes| {
                *written = true;
                let mut tx = tx;
                async move {
                    let token = token_param(token).ok_or(StoreError::TokenRejected)?;
                    let record = key.record_bytes();
                    let query = sqlx::query(&sql.save_step)
                        .bind(record.as_ref())
                        .bind(token)
                        .bind(entry.as_ref());
                    // Rejected: `tx` is dropped, rolling the work's writes back.
                    sql.guarded(query, &mut tx).await?;
                    tx.commit().await.map_err(store_error)
                }
            }
        });
        record.await.map_err(StepError::Idempotency)?;
        if written {
            return Ok(value);
        }
        // A step of the same name was saved first: this one's transaction was dropped
        // unwritten (rolled back), and the saved result stands.
        match claim.saved_step::<T>(name).await {
            Ok(Some(value)) => Ok(value),
            Ok(None) => Err(StepError::Idempotency(Error::Store(StoreError::Backend(
                "a step's checkpoint vanished from its claim".into(),
            )))),
            Err(error) => Err(StepError::Idempotency(error)),
        }
    }

    /// Refuses a claim whose store is not a [`PostgresStore`] on this one's table and
    /// database: its checkpoint would be written where the claim's record is not. Told by
    /// [`Store::location`](idempotent_core::Store::location), which a cache tier or an
    /// `AnyStore` in front answers with the store's own.
    fn check_claim_store(&self, claim: &ClaimHandle) -> Result<(), StoreError> {
        let ours = self.location_url();
        match claim.store_location() {
            Some(theirs) if theirs == ours => Ok(()),
            Some(theirs) => Err(StoreError::Backend(
                format!(
                    "step_in_transaction: the claim's records are at {theirs}, \
                     not at this store's {ours}"
                )
                .into(),
            )),
            None => Err(StoreError::Backend(
                "step_in_transaction: the claim was not made by a runtime over a PostgresStore"
                    .into(),
            )),
        }
    }
}

/// One row of the `abandoned` statement as an [`Abandoned`].
pub(super) fn decode_abandoned(row: &PgRow) -> Result<Abandoned, StoreError> {
    let key: Vec<u8> = row.try_get("storage_key").map_err(store_error)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(store_error)?;
    let request: Option<Vec<u8>> = row.try_get("request").map_err(store_error)?;
    let idle: Option<i64> = row.try_get("idle_us").map_err(store_error)?;
    let fingerprint = <[u8; 32]>::try_from(fingerprint.as_slice())
        .map(Fingerprint::from_digest)
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    Ok(Abandoned {
        key: storage_key(&key).ok_or_else(|| corrupt("storage key is not 32 or 48 bytes"))?,
        fingerprint,
        request: Bytes::from(request.ok_or_else(|| corrupt("missing request"))?),
        idle: Duration::from_micros(u64::try_from(idle.unwrap_or(0)).unwrap_or(0)),
    })
}

/// The storage key whose [record bytes](StorageKey::record_bytes) are `bytes`: a key of its
/// own (32 bytes), or a place in a client session (48).
pub(crate) fn storage_key(bytes: &[u8]) -> Option<StorageKey> {
    let digest = <[u8; 32]>::try_from(bytes.get(..32)?).ok()?;
    match bytes.len() {
        32 => Some(StorageKey::from_bytes(digest)),
        48 => {
            let number = |at: usize| {
                <[u8; 8]>::try_from(&bytes[at..at + 8])
                    .ok()
                    .map(u64::from_be_bytes)
            };
            match (number(32)?, number(40)?) {
                (0, 0) => Some(StorageKey::session(digest)),
                (epoch, seq) => Some(StorageKey::seq(digest, epoch, seq)),
            }
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn storage_keys_round_trip_through_their_record_bytes() {
        let digest = [7; 32];
        for key in [
            StorageKey::from_bytes(digest),
            StorageKey::session(digest),
            StorageKey::seq(digest, 3, 9),
            StorageKey::seq(digest, u64::MAX, 1),
        ] {
            assert_eq!(storage_key(key.record_bytes().as_ref()), Some(key));
        }
        for bad in [&[][..], &[1; 31], &[1; 33], &[1; 47], &[1; 49]] {
            assert_eq!(storage_key(bad), None);
        }
    }
}

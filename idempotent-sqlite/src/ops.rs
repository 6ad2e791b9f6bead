//! Every operation of the store as SQLite statements: reads on a read connection, writes in
//! one `BEGIN IMMEDIATE` transaction each.

use std::time::Duration;

use bytes::Bytes;
use idempotent_core::session::{MAX_SEQ, SessionState};
use idempotent_core::steps::Abandoned;
use idempotent_core::{
    Claim, FencingToken, Fingerprint, RequestOwner, SessionClaim, SessionGate, SessionKey,
    SessionMark, SessionRequest, StorageKey, StoreError, limits,
};
use sqlx::pool::PoolConnection;
use sqlx::sqlite::SqliteConnection;
use sqlx::{Executor as _, Row as _, Sqlite};

use crate::error::{corrupt, store_error};
use crate::row::{self, Decision, Session, Stored};
use crate::sql::{Param, after, millis, now_ms, token_param};
use crate::store::Inner;
use crate::write::Write;

impl Inner {
    pub(crate) async fn reader(&self, doing: &str) -> Result<PoolConnection<Sqlite>, StoreError> {
        self.readers
            .acquire()
            .await
            .map_err(|e| store_error(doing, e))
    }

    /// A write transaction holding the database's write lock from its start.
    pub(crate) async fn begin(&self, doing: &str) -> Result<Write, StoreError> {
        Write::begin(&self.writer, doing).await
    }

    /// The migration's statements, under the write lock: the table, the columns a table made
    /// by an earlier version lacks, then the indexes and the counter.
    pub(crate) async fn migrate_under_lock(
        &self,
        tx: &mut SqliteConnection,
    ) -> Result<(), sqlx::Error> {
        tx.execute(self.sql.create.as_str()).await?;
        let rows = tx
            .fetch_all(sqlx::query(&self.sql.table_columns).bind(self.sql.records.as_str()))
            .await?;
        let mut present = Vec::with_capacity(rows.len());
        for row in &rows {
            present.push(row.try_get::<String, _>("name")?);
        }
        let mut added_since = false;
        for (name, add) in &self.sql.columns {
            if !present.iter().any(|column| column == name) {
                tx.execute(add.as_str()).await?;
                added_since |= *name == "since";
            }
        }
        if added_since {
            // The records kept before: their time in their state counts from the upgrade.
            tx.execute(sqlx::query(&self.sql.backfill_since).bind(now_ms()))
                .await?;
        }
        for statement in &self.sql.migrate {
            tx.execute(statement.as_str()).await?;
        }
        Ok(())
    }

    /// What `key` holds, as a claim sees it at `now`.
    async fn stored(
        &self,
        connection: &mut SqliteConnection,
        record: &[u8],
        now: i64,
    ) -> Result<Option<Stored>, StoreError> {
        let query = sqlx::query(&self.sql.read_claim).bind(record);
        let row = connection
            .fetch_optional(query)
            .await
            .map_err(|e| store_error("reading a record", e))?;
        row.map(|row| Stored::decode(&row, now)).transpose()
    }

    /// A new token: above every token and epoch this database issued, and above `floor`.
    pub(crate) async fn next_token(
        &self,
        tx: &mut SqliteConnection,
        floor: u64,
    ) -> Result<FencingToken, StoreError> {
        let doing = "drawing a fencing token";
        let row = tx
            .fetch_optional(sqlx::query(&self.sql.read_counter))
            .await
            .map_err(|e| store_error(doing, e))?
            .ok_or_else(|| {
                corrupt("the token counter is missing (run migrate to make it again)")
            })?;
        let last = row::integer(&row, "value")?
            .and_then(|n| u64::try_from(n).ok())
            .ok_or_else(|| corrupt("the token counter is not a number"))?;
        let next = last
            .max(floor)
            .checked_add(1)
            .filter(|&n| n <= i64::MAX as u64);
        let next = next.ok_or_else(|| {
            StoreError::Backend("the fencing tokens of this database are exhausted".into())
        })?;
        let write = sqlx::query(&self.sql.write_counter).bind(next as i64);
        tx.execute(write).await.map_err(|e| store_error(doing, e))?;
        Ok(FencingToken::new(next))
    }

    pub(crate) async fn claim_or_resume(
        &self,
        key: &StorageKey,
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        resume: bool,
        label: Option<&[u8]>,
    ) -> Result<Option<Claim>, StoreError> {
        let record = key.record_bytes();
        let record = record.as_ref();
        // A replay or an in-flight report needs no write lock.
        let now = now_ms();
        let mut reader = self.reader("reading a record").await?;
        let found = self.stored(&mut reader, record, now).await?;
        drop(reader);
        match row::decide(found, fingerprint, now, resume) {
            Decision::Report(claim) => return Ok(Some(claim)),
            Decision::Nothing => return Ok(None),
            Decision::Begin { .. } | Decision::TakeOver { .. } => {}
        }
        let doing = if resume { "resuming" } else { "claiming" };
        let mut tx = self.begin(doing).await?;
        let claimed = self
            .claim_under_lock(&mut tx, record, fingerprint, (lease, ttl), (resume, label))
            .await;
        tx.finish(claimed, doing).await
    }

    /// The claim's decision and write, under the write lock: decided again, at the time the
    /// lock was granted. A claim that begins a lifetime keeps `label`; a takeover keeps the
    /// label the record has.
    async fn claim_under_lock(
        &self,
        tx: &mut SqliteConnection,
        record: &[u8],
        fingerprint: &Fingerprint,
        (lease, ttl): (Duration, Duration),
        (resume, label): (bool, Option<&[u8]>),
    ) -> Result<Option<Claim>, StoreError> {
        let doing = if resume { "resuming" } else { "claiming" };
        let now = now_ms();
        let found = self.stored(tx, record, now).await?;
        let lease = limits::clamp_lease(lease);
        let lease_until = after(now, lease);
        let kept_until = after(now, limits::clamp_ttl(ttl).max(lease));
        let claim = match row::decide(found, fingerprint, now, resume) {
            Decision::Report(claim) => Some(claim),
            Decision::Nothing => None,
            Decision::Begin { floor } => {
                let token = self.next_token(tx, floor).await?;
                let query = sqlx::query(&self.sql.begin)
                    .bind(record)
                    .bind(fingerprint.as_bytes().as_slice())
                    .bind(token.get() as i64)
                    .bind(lease_until)
                    .bind(kept_until)
                    .bind(label)
                    .bind(now);
                tx.execute(query).await.map_err(|e| store_error(doing, e))?;
                Some(Claim::Claimed(token))
            }
            Decision::TakeOver { lifetime, floor } => {
                let token = self.next_token(tx, floor).await?;
                let query = sqlx::query(&self.sql.take_over)
                    .bind(record)
                    .bind(token.get() as i64)
                    .bind(lease_until)
                    .bind(kept_until)
                    .bind(now);
                tx.execute(query).await.map_err(|e| store_error(doing, e))?;
                Some(Claim::TakenOver {
                    token,
                    lifetime: FencingToken::new(lifetime),
                })
            }
        };
        Ok(claim)
    }

    /// Runs a statement guarded by the owner's token (`?1` key, `?2` token, `?3` now, then
    /// `extra`) in a write transaction: one row changed means the caller held the claim. The
    /// time is read once the write lock is held, so a lease that ended while the statement
    /// waited for the lock is not taken for live.
    pub(crate) async fn guarded(
        &self,
        doing: &str,
        statement: &str,
        key: &StorageKey,
        token: FencingToken,
        extra: &[Param<'_>],
    ) -> Result<(), StoreError> {
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let record = key.record_bytes();
        let mut tx = self.begin(doing).await?;
        let now = now_ms();
        let mut query = sqlx::query(statement)
            .bind(record.as_ref())
            .bind(token)
            .bind(now);
        for param in extra {
            query = match *param {
                Param::Bytes(bytes) => query.bind(bytes),
                Param::From(duration) => query.bind(after(now, duration)),
            };
        }
        let changed = tx.execute(query).await.map_err(|e| store_error(doing, e));
        let changed = tx.finish(changed, doing).await?.rows_affected();
        if changed == 1 {
            Ok(())
        } else {
            Err(StoreError::TokenRejected)
        }
    }

    pub(crate) async fn complete(
        &self,
        key: &StorageKey,
        token: FencingToken,
        payload: Bytes,
        ttl: Duration,
    ) -> Result<(), StoreError> {
        let doing = "completing";
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let record = key.record_bytes();
        let mut tx = self.begin(doing).await?;
        let completed = async {
            let now = now_ms();
            let query = sqlx::query(&self.sql.complete)
                .bind(record.as_ref())
                .bind(token)
                .bind(now)
                .bind(payload.as_ref())
                .bind(after(now, limits::clamp_ttl(ttl)));
            let changed = tx
                .execute(query)
                .await
                .map_err(|e| store_error(doing, e))?
                .rows_affected();
            let done = changed == 1 || {
                // This owner's earlier completion landed (its answer was lost): done already.
                let query = sqlx::query(&self.sql.completed_by)
                    .bind(record.as_ref())
                    .bind(token)
                    .bind(now);
                tx.fetch_optional(query)
                    .await
                    .map_err(|e| store_error(doing, e))?
                    .is_some()
            };
            Ok::<_, StoreError>((changed, done))
        }
        .await;
        let (changed, done) = tx.finish(completed, doing).await?;
        if changed == 1 {
            self.changed.notify_waiters();
        }
        if done {
            Ok(())
        } else {
            Err(StoreError::TokenRejected)
        }
    }

    pub(crate) async fn release(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> Result<(), StoreError> {
        self.guarded("releasing", &self.sql.release, key, token, &[])
            .await?;
        self.changed.notify_waiters();
        Ok(())
    }

    pub(crate) async fn renew(
        &self,
        key: &StorageKey,
        token: FencingToken,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.guarded(
            "renewing",
            &self.sql.renew,
            key,
            token,
            &[Param::From(limits::clamp_lease(lease))],
        )
        .await
    }

    pub(crate) async fn load_steps(
        &self,
        key: &StorageKey,
        token: FencingToken,
    ) -> Result<Bytes, StoreError> {
        let doing = "loading checkpoints";
        let token = token_param(token).ok_or(StoreError::TokenRejected)?;
        let record = key.record_bytes();
        let query = sqlx::query(&self.sql.load_steps)
            .bind(record.as_ref())
            .bind(token)
            .bind(now_ms());
        let mut reader = self.reader(doing).await?;
        let row = reader
            .fetch_optional(query)
            .await
            .map_err(|e| store_error(doing, e))?
            .ok_or(StoreError::TokenRejected)?;
        Ok(row::blob(&row, "steps")?
            .map(Bytes::from)
            .unwrap_or_default())
    }

    pub(crate) async fn abandoned(
        &self,
        idle: Duration,
        limit: usize,
        owner: Option<&RequestOwner>,
    ) -> Result<Vec<Abandoned>, StoreError> {
        let doing = "listing abandoned operations";
        if limit == 0 {
            return Ok(Vec::new());
        }
        let now = now_ms();
        let statement = match owner {
            Some(_) => &self.sql.abandoned_of,
            None => &self.sql.abandoned,
        };
        let mut query = sqlx::query(statement)
            .bind(now)
            .bind(now.saturating_sub(millis(idle)))
            .bind(i64::try_from(limit).unwrap_or(i64::MAX));
        if let Some(owner) = owner {
            query = query.bind(owner.as_bytes().as_slice());
        }
        let mut reader = self.reader(doing).await?;
        let rows = reader
            .fetch_all(query)
            .await
            .map_err(|e| store_error(doing, e))?;
        // A row that cannot be read is skipped (and left as it is), not the call: the others
        // are still listed.
        Ok(rows
            .iter()
            .filter_map(|row| match decode_abandoned(row, now) {
                Ok(abandoned) => Some(abandoned),
                Err(error) => {
                    tracing::warn!(
                        error = &error as &dyn std::error::Error,
                        "a row with a saved request cannot be read; skipped"
                    );
                    None
                }
            })
            .collect())
    }

    pub(crate) async fn session_mark(
        &self,
        session: &SessionKey,
    ) -> Result<Option<SessionMark>, StoreError> {
        let doing = "reading a session";
        let record = session.record_key().record_bytes();
        let query = sqlx::query(&self.sql.read_session).bind(record.as_ref());
        let mut reader = self.reader(doing).await?;
        let row = reader
            .fetch_optional(query)
            .await
            .map_err(|e| store_error(doing, e))?;
        let now = now_ms();
        Ok(row
            .map(|row| Session::decode(&row, now))
            .transpose()?
            .flatten()
            .map(Session::mark))
    }

    /// The session gate (see [`SessionStore::open_session`]) as one write transaction.
    pub(crate) async fn open_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
    ) -> Result<SessionGate, StoreError> {
        let doing = "opening a session";
        if request.seq > MAX_SEQ || request.ack > MAX_SEQ {
            return Err(StoreError::Backend(
                format!("session request out of range: {request:?}").into(),
            ));
        }
        // A window wider than every number admits what any wider one does.
        let window = request.window.min(MAX_SEQ);
        let mut tx = self.begin(doing).await?;
        let gate = self
            .gate_under_lock(&mut tx, session, request, window)
            .await;
        let (gate, dropped) = tx.finish(gate, doing).await?;
        if dropped {
            self.changed.notify_waiters();
        }
        Ok(gate)
    }

    /// [`SessionStore::claim_in_session`](idempotent_core::SessionStore::claim_in_session)
    /// as one write transaction: the gate, then, admitted, the claim of the request's record
    /// with `label`, both under the write lock (no other request's `ack` comes between them,
    /// so no check of the mark follows).
    pub(crate) async fn claim_in_session(
        &self,
        session: &SessionKey,
        request: SessionRequest,
        fingerprint: &Fingerprint,
        lease: Duration,
        label: &[u8],
    ) -> Result<SessionClaim, StoreError> {
        let doing = "claiming in a session";
        if request.seq > MAX_SEQ || request.ack > MAX_SEQ {
            return Err(StoreError::Backend(
                format!("session request out of range: {request:?}").into(),
            ));
        }
        let window = request.window.min(MAX_SEQ);
        let mut tx = self.begin(doing).await?;
        let claimed = async {
            let (gate, dropped) = self
                .gate_under_lock(&mut tx, session, request, window)
                .await?;
            let SessionGate::Open { epoch } = gate else {
                return Ok((SessionClaim::Refused(gate), dropped));
            };
            let record = session.seq_key(epoch, request.seq).record_bytes();
            let claim = self
                .claim_under_lock(
                    &mut tx,
                    record.as_ref(),
                    fingerprint,
                    (lease, request.idle),
                    (false, Some(label)),
                )
                .await?
                .ok_or_else(|| {
                    StoreError::Backend("a claim answered that there was nothing to resume".into())
                })?;
            Ok((SessionClaim::Admitted { epoch, claim }, dropped))
        }
        .await;
        let (claimed, dropped) = tx.finish(claimed, doing).await?;
        if dropped {
            self.changed.notify_waiters();
        }
        Ok(claimed)
    }

    /// The gate's rules on the session's row, under the write lock: the gate, and whether
    /// any answer was dropped.
    async fn gate_under_lock(
        &self,
        tx: &mut SqliteConnection,
        session: &SessionKey,
        request: SessionRequest,
        window: u64,
    ) -> Result<(SessionGate, bool), StoreError> {
        let doing = "opening a session";
        let record = session.record_key().record_bytes();
        let now = now_ms();
        let until = after(now, limits::clamp_ttl(request.idle));
        let row = tx
            .fetch_optional(sqlx::query(&self.sql.read_session).bind(record.as_ref()))
            .await
            .map_err(|e| store_error(doing, e))?;
        let live = row
            .map(|row| Session::decode(&row, now))
            .transpose()?
            .flatten();
        let live = live.map(|old| SessionState {
            epoch: old.epoch,
            ack: old.ack,
            high: old.high,
        });
        // An epoch is taken from the token counter only for a session that starts.
        let new_epoch = match live {
            None if request.ack == 0 => self.next_token(tx, 0).await?.get(),
            _ => 0,
        };
        let request = SessionRequest::new(request.seq, request.ack, window, request.idle);
        // The gate's rules are core's ([`SessionState::gate`]); this writes what they decide.
        let step = SessionState::gate(live, request, new_epoch);
        let Some(state) = step.state else {
            // Nothing written: the session is not started by a request holding answers.
            return Ok((step.gate, false));
        };
        let write = sqlx::query(&self.sql.write_session)
            .bind(record.as_ref())
            .bind(state.ack as i64)
            .bind(state.high as i64)
            .bind(state.epoch as i64)
            .bind(until);
        tx.execute(write).await.map_err(|e| store_error(doing, e))?;
        // The answers the mark now covers go; the ones above it live as long as the session.
        // Both ranges are at most the window long. A range binds the number before its first
        // and its last.
        let at = |seq: u64| row::seq_bytes(session, state.epoch, seq);
        let mut dropped = false;
        if !step.dropped.is_empty() {
            let query = sqlx::query(&self.sql.drop_range)
                .bind(at(step.dropped.start() - 1))
                .bind(at(*step.dropped.end()));
            let done = tx.execute(query).await.map_err(|e| store_error(doing, e))?;
            dropped = done.rows_affected() > 0;
        }
        if !step.kept.is_empty() {
            let query = sqlx::query(&self.sql.keep_range)
                .bind(at(step.kept.start() - 1))
                .bind(at(*step.kept.end()))
                .bind(now)
                .bind(until);
            tx.execute(query).await.map_err(|e| store_error(doing, e))?;
        }
        Ok((step.gate, dropped))
    }

    pub(crate) async fn reap(&self) -> Result<u64, StoreError> {
        let doing = "reaping expired records";
        let mut total = 0;
        loop {
            let mut tx = self.begin(doing).await?;
            let query = sqlx::query(&self.sql.reap)
                .bind(now_ms())
                .bind(i64::from(self.reap_batch));
            let deleted = tx.execute(query).await.map_err(|e| store_error(doing, e));
            let deleted = tx.finish(deleted, doing).await?.rows_affected();
            total += deleted;
            if deleted < u64::from(self.reap_batch) {
                return Ok(total);
            }
        }
    }
}

/// One row of the completer's list as an [`Abandoned`].
fn decode_abandoned(row: &sqlx::sqlite::SqliteRow, now: i64) -> Result<Abandoned, StoreError> {
    let key = row::blob(row, "storage_key")?.unwrap_or_default();
    let request = row::blob(row, "request")?.ok_or_else(|| corrupt("missing request"))?;
    let lease_until = row::integer(row, "expires_at")?.ok_or_else(|| corrupt("missing lease"))?;
    Ok(Abandoned {
        key: row::storage_key(&key).ok_or_else(|| corrupt("storage key is not 32 or 48 bytes"))?,
        fingerprint: row::fingerprint(row)?,
        request: Bytes::from(request),
        idle: crate::sql::until(lease_until, now),
    })
}

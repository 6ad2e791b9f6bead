//! The inspection checks ([`InspectStore`]): what an operator reads of a record in each state,
//! listings by state and age, and repairs fenced by the token and the lease.

use std::collections::HashSet;
use std::time::Duration;

use bytes::Bytes;

use super::{Harness, assert_rejected, fp, fresh_key};
use crate::inspect::{
    InspectStore, KeyLabel, ListQuery, Listed, RecordInfo, RecordState, Refusal, Repair, Repaired,
};
use crate::steps::encode_checkpoint;
use crate::{
    CheckpointStore, Claim, FencingToken, Fingerprint, Key, Scope, SessionRequest, SessionStore,
    StorageKey, Store,
};

/// What a store must be for the inspection checks: they save steps and open sessions too.
pub trait Inspectable: InspectStore + CheckpointStore + SessionStore {}
impl<S: InspectStore + CheckpointStore + SessionStore> Inspectable for S {}

fn label(key: &str) -> KeyLabel {
    KeyLabel::new(
        &Key::new(key).expect("a valid key"),
        &Scope::new().principal("alice"),
        true,
    )
}

async fn claim_labelled<S: Store>(
    store: &S,
    key: &StorageKey,
    f: &Fingerprint,
    terms: (Duration, Duration),
    label: &KeyLabel,
) -> FencingToken {
    match store.claim_labelled(key, f, terms, label).await {
        Ok(Claim::Claimed(token) | Claim::TakenOver { token, .. }) => token,
        other => panic!("expected Claimed or TakenOver, got {other:?}"),
    }
}

async fn inspect<S: InspectStore>(store: &S, key: &StorageKey) -> RecordInfo {
    store
        .inspect(key)
        .await
        .unwrap_or_else(|e| panic!("inspect: {e:?}"))
        .unwrap_or_else(|| panic!("inspect found no record under {key}"))
}

async fn repair<S: InspectStore>(
    store: &S,
    key: &StorageKey,
    token: FencingToken,
    repair: &Repair,
    force: bool,
) -> Repaired {
    store
        .repair(key, token, repair, force)
        .await
        .unwrap_or_else(|e| panic!("repair {}: {e:?}", repair.name()))
}

/// Every listed record of `state` older than `older_than`, paged `limit` at a time, until the
/// listing ends (bounded: a store whose cursor never ends fails the check).
async fn list_all<S: InspectStore>(
    store: &S,
    state: Listed,
    older_than: Duration,
    limit: usize,
) -> Vec<RecordInfo> {
    let mut query = ListQuery::new(state);
    query.older_than = older_than;
    query.limit = limit;
    let mut all = Vec::new();
    for _ in 0..100_000 {
        let page = store
            .list(&query)
            .await
            .unwrap_or_else(|e| panic!("list {state:?}: {e:?}"));
        assert!(
            page.records.len() <= limit,
            "a page of {} records past the limit {limit}",
            page.records.len()
        );
        all.extend(page.records);
        match page.next {
            Some(next) => query.after = Some(next),
            None => return all,
        }
    }
    panic!("the listing of {state:?} did not end within 100,000 pages");
}

/// A record in each state: what `inspect` reports of it, its label and count of claims
/// carried from the claim that began it through a release, a takeover and the completion.
pub async fn inspect_reports_each_state_with_its_label<H: Harness<Store: Inspectable>>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    assert!(
        store.inspect(&key).await.expect("inspect").is_none(),
        "a key never claimed is absent"
    );
    let order = fp("order");
    let token = claim_labelled(
        store,
        &key,
        &order,
        (20 * unit, 60 * unit),
        &label("order-17"),
    )
    .await;
    let info = inspect(store, &key).await;
    assert_eq!(info.key, key);
    assert_eq!(info.state, RecordState::InFlight);
    assert_eq!(info.token, token);
    assert_eq!(info.fingerprint, order);
    assert!(!info.abandoned(), "a live lease is not abandoned");
    assert!(
        info.lease_left > 10 * unit && info.lease_left <= 20 * unit,
        "lease left {:?}",
        info.lease_left
    );
    assert!(info.expires_in >= info.lease_left && info.expires_in <= 60 * unit);
    assert_eq!(
        info.attempts, 1,
        "the claim that began it is its first attempt"
    );
    let kept = info.label.expect("the record keeps its label");
    assert_eq!(kept.key(), Some("order-17"));
    assert_eq!(kept.scope_parts(), vec!["principal"]);
    assert!(info.payload.is_none() && info.request.is_none());

    store
        .save_step(&key, token, encode_checkpoint("reserve", b"\"r-1\""))
        .await
        .expect("save_step");
    store
        .save_step(&key, token, encode_checkpoint("charge", b"\"c-1\""))
        .await
        .expect("save_step");
    store
        .save_request(&key, token, Bytes::from_static(b"kept request"))
        .await
        .expect("save_request");
    store.release(&key, token).await.expect("release");
    let info = inspect(store, &key).await;
    assert_eq!(info.state, RecordState::Released);
    assert!(info.abandoned(), "a released record is abandoned");
    assert_eq!(info.lease_left, Duration::ZERO);
    assert_eq!(info.step_names().expect("steps"), vec!["reserve", "charge"]);
    assert_eq!(info.request.as_deref(), Some(&b"kept request"[..]));

    // The retry of the same request takes it over: a second attempt, same label and steps.
    let again = claim_labelled(
        store,
        &key,
        &order,
        (20 * unit, 60 * unit),
        &label("ignored"),
    )
    .await;
    assert!(again > token);
    let info = inspect(store, &key).await;
    assert_eq!(info.state, RecordState::InFlight);
    assert_eq!(info.token, again);
    assert_eq!(
        info.attempts, 2,
        "a takeover is the operation's second attempt"
    );
    assert_eq!(
        info.label.as_ref().and_then(KeyLabel::key),
        Some("order-17"),
        "a takeover keeps the label the record began with"
    );
    assert_eq!(info.step_names().expect("steps"), vec!["reserve", "charge"]);

    store
        .complete(&key, again, Bytes::from_static(b"answer"), 60 * unit)
        .await
        .expect("complete");
    let info = inspect(store, &key).await;
    assert_eq!(info.state, RecordState::Completed);
    assert!(!info.abandoned());
    assert_eq!(info.payload.as_deref(), Some(&b"answer"[..]));
    assert_eq!(info.attempts, 2);
    assert_eq!(
        info.label.as_ref().and_then(KeyLabel::key),
        Some("order-17")
    );
    assert!(info.steps.is_empty() && info.request.is_none());
    assert!(info.expires_in > 50 * unit && info.expires_in <= 60 * unit);

    // A record written by a claim without a label (the plain `claim`) has none, or an empty one.
    let plain = fresh_key();
    match store.claim(&plain, &order, 20 * unit, 20 * unit).await {
        Ok(Claim::Claimed(_)) => {}
        other => panic!("expected Claimed, got {other:?}"),
    }
    let info = inspect(store, &plain).await;
    assert!(info.label.as_ref().and_then(KeyLabel::key).is_none());
}

/// A claim whose lease ended without an answer is in flight and abandoned, and its age counts
/// from the lease's end; an expired record is absent.
pub async fn a_lapsed_lease_is_abandoned<H: Harness<Store: Inspectable>>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    claim_labelled(
        store,
        &key,
        &fp("a"),
        (2 * unit, 8 * unit),
        &label("lapsed"),
    )
    .await;
    h.advance(4 * unit).await;
    let info = inspect(store, &key).await;
    assert_eq!(info.state, RecordState::InFlight);
    assert!(info.abandoned(), "its lease ended");
    assert_eq!(info.lease_left, Duration::ZERO);
    assert!(
        info.age >= unit && info.age < 4 * unit,
        "its age {:?} counts from the lease's end",
        info.age
    );
    assert!(info.expires_in > Duration::ZERO && info.expires_in <= 6 * unit);
    h.advance(6 * unit).await;
    assert!(
        store.inspect(&key).await.expect("inspect").is_none(),
        "a record past the TTL it was claimed with is absent"
    );
}

/// Listings by state, in pages, and by age.
pub async fn list_finds_records_by_state_and_age_in_pages<H: Harness<Store: Inspectable>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let long = (40 * unit, 200 * unit);
    let mut completed = HashSet::new();
    for n in 0..3 {
        let key = fresh_key();
        let token = claim_labelled(store, &key, &fp("c"), long, &label(&format!("done-{n}"))).await;
        store
            .complete(&key, token, Bytes::from_static(b"ok"), 200 * unit)
            .await
            .expect("complete");
        completed.insert(key);
    }
    let mut live = HashSet::new();
    for n in 0..2 {
        let key = fresh_key();
        claim_labelled(store, &key, &fp("l"), long, &label(&format!("live-{n}"))).await;
        live.insert(key);
    }
    let lapsed = fresh_key();
    claim_labelled(
        store,
        &lapsed,
        &fp("x"),
        (unit, 200 * unit),
        &label("lapsed"),
    )
    .await;
    let released = fresh_key();
    let token = claim_labelled(store, &released, &fp("r"), long, &label("released")).await;
    store.release(&released, token).await.expect("release");
    h.advance(3 * unit).await;
    let young = fresh_key();
    let young_token = claim_labelled(store, &young, &fp("y"), long, &label("young")).await;
    store
        .complete(&young, young_token, Bytes::from_static(b"ok"), 200 * unit)
        .await
        .expect("complete");

    let keys = |records: &[RecordInfo]| records.iter().map(|r| r.key).collect::<HashSet<_>>();
    let done = list_all(store, Listed::Completed, Duration::ZERO, 2).await;
    assert!(done.iter().all(|r| r.state == RecordState::Completed));
    let done = keys(&done);
    assert!(
        completed.is_subset(&done),
        "every completed record is listed, in pages of 2"
    );
    assert!(done.contains(&young));
    assert!(!done.contains(&lapsed) && !done.contains(&released));
    assert!(live.is_disjoint(&done));

    let old_done = keys(&list_all(store, Listed::Completed, 2 * unit, 50).await);
    assert!(completed.is_subset(&old_done));
    assert!(
        !old_done.contains(&young),
        "--older-than leaves a younger record out"
    );

    let running = keys(&list_all(store, Listed::InFlight, Duration::ZERO, 50).await);
    assert!(live.is_subset(&running));
    assert!(!running.contains(&lapsed), "a lapsed lease is not running");
    assert!(!running.contains(&released) && !running.contains(&young));

    let abandoned = list_all(store, Listed::Abandoned, Duration::ZERO, 50).await;
    assert!(abandoned.iter().all(RecordInfo::abandoned));
    let abandoned = keys(&abandoned);
    assert!(abandoned.contains(&lapsed) && abandoned.contains(&released));
    assert!(live.is_disjoint(&abandoned) && completed.is_disjoint(&abandoned));

    let only_released = keys(&list_all(store, Listed::Released, Duration::ZERO, 50).await);
    assert!(only_released.contains(&released));
    assert!(!only_released.contains(&lapsed));

    let idle = keys(&list_all(store, Listed::Abandoned, 100 * unit, 50).await);
    assert!(
        !idle.contains(&lapsed) && !idle.contains(&released),
        "neither has been abandoned for 100 units"
    );
}

/// Repairs name the token read and are refused while a lease is live, unless forced; a forced
/// one fences the owner out.
pub async fn repairs_are_fenced_by_the_token_and_the_lease<H: Harness<Store: Inspectable>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let terms = (40 * unit, 200 * unit);

    // Release: a wrong token, a live lease, then forced.
    let key = fresh_key();
    let token = claim_labelled(store, &key, &fp("a"), terms, &label("release-me")).await;
    let stale = FencingToken::new(token.get().wrapping_sub(1));
    assert_eq!(
        repair(store, &key, stale, &Repair::Release, true).await,
        Repaired::Refused(Refusal::TokenMoved { now: token })
    );
    match repair(store, &key, token, &Repair::Release, false).await {
        Repaired::Refused(Refusal::LeaseLive { left }) => {
            assert!(left > 30 * unit && left <= 40 * unit, "lease left {left:?}")
        }
        other => panic!("a release during a live lease is refused, got {other:?}"),
    }
    assert_eq!(inspect(store, &key).await.state, RecordState::InFlight);
    assert_eq!(
        repair(store, &key, token, &Repair::Release, true).await,
        Repaired::Done
    );
    let info = inspect(store, &key).await;
    assert_eq!(info.state, RecordState::Released);
    assert!(info.abandoned());
    assert_rejected(
        store
            .complete(&key, token, Bytes::from_static(b"late"), 200 * unit)
            .await,
        "the owner of a claim an operator released",
    );
    assert_rejected(
        store.renew(&key, token, 40 * unit).await,
        "the renewal of a claim an operator released",
    );
    assert_rejected(
        store
            .save_step(&key, token, encode_checkpoint("late", b"1"))
            .await,
        "a step of a claim an operator released",
    );
    assert_rejected(
        store
            .save_request(&key, token, Bytes::from_static(b"late"))
            .await,
        "a request kept on a claim an operator released",
    );
    // Its retry takes it over.
    match store.claim(&key, &fp("a"), 40 * unit, 200 * unit).await {
        Ok(Claim::TakenOver { .. }) => {}
        other => panic!("the retry of a released record takes it over, got {other:?}"),
    }

    // Release of an abandoned record needs no force, and its age still counts from the
    // lease's end.
    let lapsed = fresh_key();
    let token = claim_labelled(store, &lapsed, &fp("b"), (unit, 200 * unit), &label("b")).await;
    h.advance(4 * unit).await;
    assert_eq!(
        repair(store, &lapsed, token, &Repair::Release, false).await,
        Repaired::Done
    );
    let info = inspect(store, &lapsed).await;
    assert_eq!(info.state, RecordState::Released);
    assert!(
        info.age >= 2 * unit,
        "released after its lease lapsed, its age {:?} counts from the lease's end",
        info.age
    );
    assert_eq!(
        repair(store, &lapsed, token, &Repair::Release, false).await,
        Repaired::Done,
        "a release of a released record changes nothing"
    );

    // A record past its TTL is absent to a repair, even before it is swept.
    let expired = fresh_key();
    let token = claim_labelled(store, &expired, &fp("e"), (unit, 2 * unit), &label("e")).await;
    h.advance(4 * unit).await;
    for repair_of in [Repair::Release, Repair::Forget] {
        assert_eq!(
            repair(store, &expired, token, &repair_of, true).await,
            Repaired::Refused(Refusal::Absent)
        );
    }

    // Give up: refused live, done once the lease ended; retries replay it; the old owner is
    // fenced out.
    let key = fresh_key();
    let token = claim_labelled(store, &key, &fp("c"), (2 * unit, 200 * unit), &label("c")).await;
    let give_up = Repair::GiveUp {
        payload: Bytes::from_static(b"operation_failed"),
        ttl: 200 * unit,
    };
    assert!(matches!(
        repair(store, &key, token, &give_up, false).await,
        Repaired::Refused(Refusal::LeaseLive { .. })
    ));
    h.advance(3 * unit).await;
    assert_eq!(
        repair(store, &key, token, &give_up, false).await,
        Repaired::Done
    );
    let info = inspect(store, &key).await;
    assert_eq!(info.state, RecordState::Completed);
    assert!(info.token > token, "a give-up takes a new token");
    assert_eq!(info.payload.as_deref(), Some(&b"operation_failed"[..]));
    assert_eq!(info.label.as_ref().and_then(KeyLabel::key), Some("c"));
    match store.claim(&key, &fp("c"), 40 * unit, 200 * unit).await {
        Ok(Claim::Completed { payload, .. }) => assert_eq!(payload, &b"operation_failed"[..]),
        other => panic!("a given-up operation replays its answer, got {other:?}"),
    }
    assert_rejected(
        store
            .complete(&key, token, Bytes::from_static(b"late"), 200 * unit)
            .await,
        "the owner of a claim an operator gave up",
    );
    assert_eq!(
        repair(store, &key, info.token, &Repair::Release, true).await,
        Repaired::Refused(Refusal::Completed),
        "a completed record is not released"
    );
    assert_eq!(
        repair(store, &key, info.token, &give_up, true).await,
        Repaired::Refused(Refusal::Completed),
        "a completed record is not given up"
    );

    // Forget: a completed record goes, and the key begins a new lifetime.
    assert_eq!(
        repair(store, &key, token, &Repair::Forget, false).await,
        Repaired::Refused(Refusal::TokenMoved { now: info.token })
    );
    assert_eq!(
        repair(store, &key, info.token, &Repair::Forget, false).await,
        Repaired::Done
    );
    assert!(store.inspect(&key).await.expect("inspect").is_none());
    assert_eq!(
        repair(store, &key, info.token, &Repair::Forget, false).await,
        Repaired::Refused(Refusal::Absent)
    );
    match store
        .claim(&key, &fp("other request"), 40 * unit, 200 * unit)
        .await
    {
        Ok(Claim::Claimed(_)) => {}
        other => panic!("a forgotten key begins a new lifetime, got {other:?}"),
    }

    // Forget of a live claim needs force, and fences its owner out.
    let key = fresh_key();
    let token = claim_labelled(store, &key, &fp("d"), terms, &label("d")).await;
    assert!(matches!(
        repair(store, &key, token, &Repair::Forget, false).await,
        Repaired::Refused(Refusal::LeaseLive { .. })
    ));
    assert_eq!(
        repair(store, &key, token, &Repair::Forget, true).await,
        Repaired::Done
    );
    assert_rejected(
        store
            .complete(&key, token, Bytes::from_static(b"late"), 200 * unit)
            .await,
        "the owner of a claim an operator forgot",
    );
    assert!(store.inspect(&key).await.expect("inspect").is_none());
}

/// A session's state as the gate left it, and the numbers whose records it holds.
pub async fn session_state_reads_what_the_gate_left<H: Harness<Store: Inspectable>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = super::fresh_session();
    assert!(
        store
            .session_state(&session)
            .await
            .expect("state")
            .is_none()
    );
    let idle = 200 * unit;
    let mut epoch = 0;
    for seq in 1..=3 {
        match store
            .open_session(&session, SessionRequest::new(seq, 0, 64, idle))
            .await
            .expect("open_session")
        {
            crate::SessionGate::Open { epoch: e } => epoch = e,
            other => panic!("expected Open, got {other:?}"),
        }
        let key = session.seq_key(epoch, seq);
        let token = claim_labelled(store, &key, &fp("s"), (40 * unit, idle), &label("s")).await;
        if seq < 3 {
            store
                .complete(&key, token, Bytes::from_static(b"ok"), idle)
                .await
                .expect("complete");
        }
    }
    let state = store
        .session_state(&session)
        .await
        .expect("state")
        .expect("a live session");
    assert_eq!((state.epoch, state.ack, state.high), (epoch, 0, 3));
    match store
        .open_session(&session, SessionRequest::new(4, 1, 64, idle))
        .await
        .expect("open_session")
    {
        crate::SessionGate::Open { .. } => {}
        other => panic!("expected Open, got {other:?}"),
    }
    let info = crate::inspect::session(store, &session)
        .await
        .expect("session")
        .expect("a live session");
    assert_eq!((info.epoch, info.mark, info.high), (epoch, 1, 4));
    assert_eq!(
        info.held,
        vec![2, 3],
        "2 answered, 3 in flight; 1 acknowledged, 4 never claimed"
    );
}

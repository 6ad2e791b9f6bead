//! Checkpoints and saved requests ([`CheckpointStore::save_step`], [`CheckpointStore::load_steps`],
//! [`CheckpointStore::save_request`], [`CheckpointStore::abandoned`]) as conformance checks.

use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::{Harness, assert_rejected, fp, fresh_key, owned};
use crate::steps::{Checkpoints, encode_checkpoint};
use crate::{CheckpointStore, FencingToken, RequestOwner, StorageKey, Store, StoreError};

async fn save<S: CheckpointStore>(
    store: &S,
    key: &StorageKey,
    token: FencingToken,
    name: &str,
    value: &str,
) {
    store
        .save_step(key, token, encode_checkpoint(name, value.as_bytes()))
        .await
        .unwrap_or_else(|e| panic!("save_step {name}: {e:?}"));
}

async fn load<S: CheckpointStore>(store: &S, key: &StorageKey, token: FencingToken) -> Checkpoints {
    let bytes = store
        .load_steps(key, token)
        .await
        .unwrap_or_else(|e| panic!("load_steps: {e:?}"));
    Checkpoints::decode(bytes).expect("the store hands back what it was given")
}

fn value<'a>(steps: &'a Checkpoints, name: &str) -> Option<&'a [u8]> {
    steps.get(name).map(Bytes::as_ref)
}

async fn listed<S: CheckpointStore>(store: &S, idle: Duration, key: &StorageKey) -> Option<Bytes> {
    let found = store
        .abandoned(idle, 10_000, None)
        .await
        .unwrap_or_else(|e| panic!("abandoned: {e:?}"));
    found.into_iter().find(|a| a.key == *key).map(|a| a.request)
}

fn assert_load_rejected(result: Result<Bytes, StoreError>, what: &str) {
    match result {
        Err(StoreError::TokenRejected) => {}
        other => panic!("{what}: expected TokenRejected, got {other:?}"),
    }
}

/// Checkpoints come back whole, byte for byte, in the order they were saved; a record with
/// none has an empty string.
pub async fn checkpoints_round_trip_in_order<H: Harness<Store: CheckpointStore>>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let (token, _) = owned(store, &key, &fp("order"), (20 * unit, 40 * unit)).await;
    assert!(
        store
            .load_steps(&key, token)
            .await
            .expect("load")
            .is_empty(),
        "a new record has no checkpoints"
    );
    let big = "x".repeat(60 * 1024);
    save(store, &key, token, "reserve", "\"r-1\"").await;
    save(store, &key, token, "charge", &big).await;
    save(store, &key, token, "empty", "").await;
    let mut expected = BytesMut::new();
    expected.extend_from_slice(&encode_checkpoint("reserve", b"\"r-1\""));
    expected.extend_from_slice(&encode_checkpoint("charge", big.as_bytes()));
    expected.extend_from_slice(&encode_checkpoint("empty", b""));
    let raw = store.load_steps(&key, token).await.expect("load");
    assert!(raw == expected.freeze(), "the concatenation, in order");
    let other = fresh_key();
    let (other_token, _) = owned(store, &other, &fp("order"), (20 * unit, 40 * unit)).await;
    assert!(
        store
            .load_steps(&other, other_token)
            .await
            .expect("load")
            .is_empty(),
        "checkpoints belong to their record"
    );
}

/// Only the current owner of a live claim writes or reads checkpoints: a lapsed owner's
/// checkpoint, request and read are refused, and change nothing.
pub async fn checkpoints_are_fenced_by_the_token<H: Harness<Store: CheckpointStore>>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("order");
    let terms = (2 * unit, 40 * unit);
    let (first, _) = owned(store, &key, &f, terms).await;
    save(store, &key, first, "reserve", "1").await;
    h.advance(3 * unit).await;
    // Lapsed, not yet taken over: still refused.
    assert_rejected(
        store
            .save_step(&key, first, encode_checkpoint("charge", b"stale"))
            .await,
        "a lapsed owner's checkpoint",
    );
    assert_load_rejected(store.load_steps(&key, first).await, "a lapsed owner's read");
    let (second, _) = owned(store, &key, &f, terms).await;
    for (what, result) in [
        (
            "a stale owner's checkpoint",
            store
                .save_step(&key, first, encode_checkpoint("charge", b"stale"))
                .await,
        ),
        (
            "a stale owner's request",
            store
                .save_request(&key, first, Bytes::from_static(b"stale"))
                .await,
        ),
    ] {
        assert_rejected(result, what);
    }
    assert_load_rejected(store.load_steps(&key, first).await, "a stale owner's read");
    let steps = load(store, &key, second).await;
    assert_eq!(value(&steps, "reserve"), Some(&b"1"[..]));
    assert_eq!(
        value(&steps, "charge"),
        None,
        "the stale checkpoint changed nothing"
    );
    // A key nobody claimed: nothing to write to.
    let absent = fresh_key();
    assert_rejected(
        store
            .save_step(&absent, second, encode_checkpoint("reserve", b"1"))
            .await,
        "a checkpoint on an absent record",
    );
}

/// Checkpoints and the request belong to the operation: a release and a takeover keep them,
/// and another request's claim on the abandoned record changes nothing; a claim that begins
/// a new lifetime (after the record expired) starts with none.
pub async fn checkpoints_last_as_long_as_the_operation<H: Harness<Store: CheckpointStore>>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let f = fp("order");
    let terms = (20 * unit, 40 * unit);
    let (first, lifetime) = owned(store, &key, &f, terms).await;
    save(store, &key, first, "reserve", "1").await;
    store
        .save_request(&key, first, Bytes::from_static(b"request"))
        .await
        .expect("save_request");
    store.release(&key, first).await.expect("release");
    let (second, continued) = owned(store, &key, &f, terms).await;
    assert_eq!(continued, lifetime, "the retry continues the operation");
    assert_eq!(
        value(&load(store, &key, second).await, "reserve"),
        Some(&b"1"[..]),
        "a takeover after a release keeps the checkpoints"
    );
    save(store, &key, second, "charge", "2").await;
    store.release(&key, second).await.expect("release");
    h.advance(unit).await;
    assert_eq!(
        listed(store, Duration::ZERO, &key).await.as_deref(),
        Some(&b"request"[..]),
        "a takeover keeps the request"
    );
    // Another request on the abandoned record is refused and changes nothing.
    assert!(
        matches!(
            store
                .claim(&key, &fp("another order"), terms.0, terms.1)
                .await,
            Ok(crate::Claim::InFlight { .. })
        ),
        "another request on the abandoned record is reported, not claimed"
    );
    assert_eq!(
        listed(store, Duration::ZERO, &key).await.as_deref(),
        Some(&b"request"[..]),
        "the operation keeps its request"
    );
    let (third, continued) = owned(store, &key, &f, terms).await;
    assert_eq!(continued, lifetime);
    assert_eq!(
        value(&load(store, &key, third).await, "charge"),
        Some(&b"2"[..]),
        "and its checkpoints"
    );

    // The same request after its record expired: a new operation, with nothing of the old
    // one.
    let expiring = fresh_key();
    let (token, _) = owned(store, &expiring, &f, (2 * unit, 3 * unit)).await;
    save(store, &expiring, token, "reserve", "1").await;
    h.advance(5 * unit).await;
    let (token, lifetime) = owned(store, &expiring, &f, terms).await;
    assert_eq!(token, lifetime, "past its TTL the record is gone");
    assert!(
        load(store, &expiring, token).await.is_empty(),
        "an expired record's checkpoints are gone with it"
    );
}

/// A completed record carries neither checkpoints nor a request: the completer does not list
/// it, and no token reads checkpoints from it.
pub async fn completion_drops_checkpoints_and_request<H: Harness<Store: CheckpointStore>>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let (token, _) = owned(store, &key, &fp("order"), (20 * unit, 40 * unit)).await;
    save(store, &key, token, "reserve", "1").await;
    store
        .save_request(&key, token, Bytes::from_static(b"request"))
        .await
        .expect("save_request");
    store
        .complete(&key, token, Bytes::from_static(b"done"), 40 * unit)
        .await
        .expect("complete");
    assert_load_rejected(
        store.load_steps(&key, token).await,
        "reading checkpoints of a completed record",
    );
    assert_rejected(
        store
            .save_step(&key, token, encode_checkpoint("late", b"1"))
            .await,
        "a checkpoint on a completed record",
    );
    h.advance(unit).await;
    assert_eq!(
        listed(store, Duration::ZERO, &key).await,
        None,
        "a completed record is not abandoned"
    );
    super::assert_completed(store, &key, &fp("order"), b"done").await;
}

/// `abandoned` lists the in-flight records that hold a request and have been idle long enough
/// (released or lapsed), with their fingerprint, latest request and idle time; not a record
/// still leased, nor one without a request, nor one past its TTL.
pub async fn abandoned_lists_idle_records_with_a_request<H: Harness<Store: CheckpointStore>>(
    h: &H,
) {
    let (store, unit) = (h.store(), h.time_unit());
    let terms = (2 * unit, 40 * unit);
    let released = fresh_key();
    let lapsed = fresh_key();
    let leased = fresh_key();
    let bare = fresh_key();
    let (token, _) = owned(store, &released, &fp("released"), terms).await;
    store
        .save_request(&released, token, Bytes::from_static(b"first"))
        .await
        .expect("save_request");
    store
        .save_request(&released, token, Bytes::from_static(b"second"))
        .await
        .expect("save_request replaces");
    store.release(&released, token).await.expect("release");
    let (token, _) = owned(store, &lapsed, &fp("lapsed"), terms).await;
    store
        .save_request(&lapsed, token, Bytes::from_static(b"lapsed"))
        .await
        .expect("save_request");
    let (token, _) = owned(store, &bare, &fp("bare"), terms).await;
    store.release(&bare, token).await.expect("release");
    h.advance(4 * unit).await;
    let (token, _) = owned(store, &leased, &fp("leased"), (20 * unit, 40 * unit)).await;
    store
        .save_request(&leased, token, Bytes::from_static(b"leased"))
        .await
        .expect("save_request");

    let found = store
        .abandoned(unit, 10_000, None)
        .await
        .expect("abandoned");
    let mine = |key: &StorageKey| found.iter().find(|a| a.key == *key);
    let released_entry = mine(&released).expect("a released record with a request is listed");
    assert_eq!(
        released_entry.request.as_ref(),
        b"second",
        "the latest request"
    );
    assert_eq!(released_entry.fingerprint, fp("released"));
    assert!(
        released_entry.idle >= unit,
        "idle {:?} is at least what was asked",
        released_entry.idle
    );
    assert_eq!(
        mine(&lapsed).map(|a| a.request.as_ref()),
        Some(&b"lapsed"[..]),
        "a lapsed lease counts as abandoned"
    );
    assert!(
        mine(&leased).is_none(),
        "a record still leased is not listed"
    );
    assert!(
        mine(&bare).is_none(),
        "a record without a request is not listed"
    );
    // Longest idle first: the released record's lease ended before the lapsed one's.
    let order: Vec<_> = found
        .iter()
        .filter(|a| a.key == released || a.key == lapsed)
        .map(|a| a.key)
        .collect();
    assert_eq!(order, vec![released, lapsed], "longest idle first");
    assert!(
        listed(store, 40 * unit, &released).await.is_none(),
        "not idle that long yet"
    );
    // Past the TTL it was claimed with, the record is gone.
    h.advance(40 * unit).await;
    assert!(
        listed(store, unit, &released).await.is_none(),
        "an expired record is not listed"
    );
}

/// Many checkpoints saved at once by the owner all land: each save is one atomic append.
pub async fn concurrent_checkpoints_all_land<H: Harness<Store: CheckpointStore>>(h: &H) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let (token, _) = owned(store, &key, &fp("order"), (40 * unit, 80 * unit)).await;
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .save_step(
                        &key,
                        token,
                        encode_checkpoint(&format!("step-{i}"), i.to_string().as_bytes()),
                    )
                    .await
            })
        })
        .collect();
    for task in tasks {
        task.await.expect("task").expect("save_step");
    }
    let steps = load(store, &key, token).await;
    assert_eq!(steps.steps().count(), 64, "every checkpoint landed");
    for i in 0..64 {
        assert_eq!(
            value(&steps, &format!("step-{i}")),
            Some(i.to_string().as_bytes())
        );
    }
}

/// `resume` takes over an abandoned operation of its own request and nothing else: it never
/// begins a lifetime, so another request's abandoned operation keeps its checkpoints; a live
/// record is reported as a claim reports it; of concurrent resumes, one takes over.
pub async fn resume_takes_over_only_an_abandoned_operation_of_its_request<
    H: Harness<Store: CheckpointStore>,
>(
    h: &H,
) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let terms = (20 * unit, 40 * unit);
    let resume = |f: &'static str| async move {
        let f = fp(f);
        store.resume(&key, &f, terms.0, terms.1).await
    };
    assert_eq!(resume("order").await.expect("resume"), None, "no record");
    let (token, lifetime) = owned(store, &key, &fp("order"), terms).await;
    assert_eq!(token, lifetime, "the resume before created nothing");
    match resume("order").await.expect("resume") {
        Some(crate::Claim::InFlight { fingerprint, .. }) => assert_eq!(fingerprint, fp("order")),
        other => panic!("a live claim is reported, got {other:?}"),
    }
    save(store, &key, token, "reserve", "1").await;
    store.release(&key, token).await.expect("release");
    // Another request's resume finds nothing of its own and changes nothing.
    assert_eq!(resume("another order").await.expect("resume"), None);
    let taken = resume("order").await.expect("resume");
    let Some(crate::Claim::TakenOver {
        token: second,
        lifetime: continued,
    }) = taken
    else {
        panic!("expected the abandoned operation taken over, got {taken:?}");
    };
    assert!(second > token);
    assert_eq!(continued, lifetime, "the operation goes on");
    assert_eq!(
        value(&load(store, &key, second).await, "reserve"),
        Some(&b"1"[..]),
        "with its checkpoints"
    );
    assert_rejected(
        store.renew(&key, token, terms.0).await,
        "the first owner after the resume",
    );
    store
        .complete(&key, second, Bytes::from_static(b"done"), 40 * unit)
        .await
        .expect("complete");
    match resume("order").await.expect("resume") {
        Some(crate::Claim::Completed { payload, .. }) => assert_eq!(payload.as_ref(), b"done"),
        other => panic!("a completed record is reported, got {other:?}"),
    }

    // Of many concurrent resumes of one abandoned operation, exactly one takes it over.
    let contested = fresh_key();
    let (token, _) = owned(store, &contested, &fp("order"), terms).await;
    store.release(&contested, token).await.expect("release");
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .resume(&contested, &fp("order"), 20 * unit, 40 * unit)
                    .await
            })
        })
        .collect();
    let mut took = 0;
    for task in tasks {
        match task.await.expect("task").expect("resume") {
            Some(crate::Claim::TakenOver { .. }) => took += 1,
            // The winner's lease, or (a resume that lost the race) nothing to take over.
            Some(crate::Claim::InFlight { .. }) | None => {}
            other => panic!("expected a takeover or the winner's lease, got {other:?}"),
        }
    }
    assert_eq!(took, 1, "exactly one resume takes the operation over");

    // Past its TTL the operation is gone: nothing to resume, and nothing created.
    let expiring = fresh_key();
    let (token, _) = owned(store, &expiring, &fp("order"), (2 * unit, 3 * unit)).await;
    store.release(&expiring, token).await.expect("release");
    h.advance(5 * unit).await;
    assert_eq!(
        store
            .resume(&expiring, &fp("order"), terms.0, terms.1)
            .await
            .expect("resume"),
        None
    );
}

/// The race a completer meets: the operation it listed expired, and the key now holds another
/// request's abandoned operation. Its resume must leave that one whole.
pub async fn a_stale_resume_leaves_another_operations_checkpoints<
    H: Harness<Store: CheckpointStore>,
>(
    h: &H,
) {
    let (store, key, unit) = (h.store(), fresh_key(), h.time_unit());
    let (first, _) = owned(store, &key, &fp("first"), (2 * unit, 3 * unit)).await;
    store.release(&key, first).await.expect("release");
    h.advance(5 * unit).await;
    let (second, lifetime) = owned(store, &key, &fp("second"), (20 * unit, 40 * unit)).await;
    save(store, &key, second, "reserve", "kept").await;
    store
        .save_request(&key, second, Bytes::from_static(b"second"))
        .await
        .expect("save_request");
    store.release(&key, second).await.expect("release");
    assert_eq!(
        store
            .resume(&key, &fp("first"), 20 * unit, 40 * unit)
            .await
            .expect("resume"),
        None,
        "the first operation is gone"
    );
    h.advance(unit).await;
    assert_eq!(
        listed(store, Duration::ZERO, &key).await.as_deref(),
        Some(&b"second"[..]),
        "the second operation is still abandoned, with its request"
    );
    let (third, continued) = owned(store, &key, &fp("second"), (20 * unit, 40 * unit)).await;
    assert_eq!(continued, lifetime);
    assert_eq!(
        value(&load(store, &key, third).await, "reserve"),
        Some(&b"kept"[..])
    );
}

/// `abandoned` lists one owner's requests ([`RequestOwner`]), and no other's: another owner's
/// abandoned operations, however many and however long idle, take none of `limit`'s places;
/// `None` lists the requests that name no owner. Requests kept before the owner's listing
/// and requests saved again keep their owner.
pub async fn abandoned_lists_one_owners_requests<H: Harness<Store: CheckpointStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let terms = (2 * unit, 40 * unit);
    // Owners unique to this check, so a shared server's other records do not count.
    let tag = fresh_key();
    let owner = |n: u8| {
        let mut bytes = [n; RequestOwner::LEN];
        bytes[..32].copy_from_slice(tag.as_bytes());
        RequestOwner::new(bytes)
    };
    let (mine, theirs) = (owner(1), owner(2));
    let request = |owner: &RequestOwner, what: &str| {
        let mut bytes = owner.as_bytes().to_vec();
        bytes.extend_from_slice(what.as_bytes());
        Bytes::from(bytes)
    };
    let keep = |key: StorageKey, f: &'static str, request: Bytes| async move {
        let (token, _) = owned(store, &key, &fp(f), terms).await;
        store
            .save_request(&key, token, request)
            .await
            .expect("save_request");
        store.release(&key, token).await.expect("release");
    };
    // Theirs first: longer idle than mine, and more than a listing's limit.
    let foreign: Vec<StorageKey> = (0..6).map(|_| fresh_key()).collect();
    for key in &foreign {
        keep(*key, "theirs", request(&theirs, "their order")).await;
    }
    h.advance(unit).await;
    let own = fresh_key();
    keep(own, "mine", request(&mine, "my order")).await;
    let unowned = fresh_key();
    keep(unowned, "nobody's", Bytes::from_static(b"short")).await;
    h.advance(unit).await;

    let found = store
        .abandoned(Duration::ZERO, 2, Some(&mine))
        .await
        .expect("abandoned");
    assert_eq!(
        found.iter().map(|a| a.key).collect::<Vec<_>>(),
        [own],
        "only mine, though theirs are more and idle longer"
    );
    assert_eq!(&found[0].request[RequestOwner::LEN..], b"my order");
    let found = store
        .abandoned(Duration::ZERO, 3, Some(&theirs))
        .await
        .expect("abandoned");
    assert_eq!(found.len(), 3, "at most the limit");
    assert!(found.iter().all(|a| foreign.contains(&a.key)), "{found:?}");
    let found = store
        .abandoned(Duration::ZERO, 10_000, None)
        .await
        .expect("abandoned");
    assert!(found.iter().any(|a| a.key == unowned));
    assert!(
        found.iter().all(|a| RequestOwner::of(&a.request).is_none()),
        "None lists requests that name no owner"
    );
    // Taken over and released again, mine is still mine.
    let (token, _) = owned(store, &own, &fp("mine"), terms).await;
    store.release(&own, token).await.expect("release");
    h.advance(unit).await;
    let found = store
        .abandoned(Duration::ZERO, 2, Some(&mine))
        .await
        .expect("abandoned");
    assert_eq!(found.iter().map(|a| a.key).collect::<Vec<_>>(), [own]);
}

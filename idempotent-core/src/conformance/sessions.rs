//! The session gate's rules ([`SessionStore::open_session`]) as conformance checks.

use std::time::Duration;

use bytes::Bytes;

use super::{Harness, assert_completed, claimed, fp, fresh_key};
use crate::{Claim, SessionGate, SessionKey, SessionRequest, SessionStore, Store};

/// A session key no other check uses.
pub fn fresh_session() -> SessionKey {
    SessionKey::from_bytes(*fresh_key().as_bytes())
}

async fn gate<S: SessionStore>(
    store: &S,
    session: &SessionKey,
    (seq, ack): (u64, u64),
    window: u64,
    idle: Duration,
) -> SessionGate {
    store
        .open_session(session, SessionRequest::new(seq, ack, window, idle))
        .await
        .unwrap_or_else(|e| panic!("open_session({seq}, ack {ack}): {e:?}"))
}

async fn open<S: SessionStore>(
    store: &S,
    session: &SessionKey,
    place: (u64, u64),
    window: u64,
    idle: Duration,
) -> u64 {
    match gate(store, session, place, window, idle).await {
        SessionGate::Open { epoch } => epoch,
        other => panic!("request {place:?}: expected Open, got {other:?}"),
    }
}

/// Opens request `seq` (acknowledging `ack`), claims its record and completes it with `seq`
/// as its payload.
async fn answer<S: SessionStore>(
    store: &S,
    session: &SessionKey,
    (seq, ack): (u64, u64),
    idle: Duration,
    lease: Duration,
) -> u64 {
    let epoch = open(store, session, (seq, ack), 64, idle).await;
    let key = session.seq_key(epoch, seq);
    let token = claimed_for(store, &key, seq, lease, idle).await;
    store
        .complete(&key, token, Bytes::from(seq.to_string()), idle)
        .await
        .expect("complete a session request");
    epoch
}

async fn claimed_for<S: SessionStore>(
    store: &S,
    key: &crate::StorageKey,
    seq: u64,
    lease: Duration,
    idle: Duration,
) -> crate::FencingToken {
    match store
        .claim(key, &fp(&seq.to_string()), lease, idle)
        .await
        .expect("claim")
    {
        Claim::Claimed(token) | Claim::TakenOver { token, .. } => token,
        other => panic!("request {seq}: expected its record to be claimable, got {other:?}"),
    }
}

/// An unknown session starts only on a request that holds no answers (`ack = 0`); one that
/// says it holds some is refused as expired, and starts nothing.
pub async fn session_starts_only_without_an_ack<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let idle = 20 * unit;
    assert_eq!(
        gate(store, &session, (3, 2), 64, idle).await,
        SessionGate::Expired
    );
    assert_eq!(
        gate(store, &session, (3, 2), 64, idle).await,
        SessionGate::Expired,
        "a refused request must not start the session"
    );
    let epoch = open(store, &session, (1, 0), 64, idle).await;
    assert_eq!(open(store, &session, (1, 0), 64, idle).await, epoch);
    assert_eq!(open(store, &session, (2, 0), 64, idle).await, epoch);
}

/// Each request of a session is a record of its own, claimed and replayed like a key's.
pub async fn session_requests_are_records_of_their_own<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let (idle, lease) = (20 * unit, 4 * unit);
    let epoch = answer(store, &session, (1, 0), idle, lease).await;
    assert_completed(store, &session.seq_key(epoch, 1), &fp("1"), b"1").await;
    // A retry of request 1 is admitted and finds its answer.
    assert_eq!(open(store, &session, (1, 0), 64, idle).await, epoch);
    assert_completed(store, &session.seq_key(epoch, 1), &fp("1"), b"1").await;
    // Request 2 is in flight while request 1 stays answered.
    assert_eq!(open(store, &session, (2, 0), 64, idle).await, epoch);
    let key2 = session.seq_key(epoch, 2);
    claimed_for(store, &key2, 2, lease, idle).await;
    assert!(matches!(
        store.claim(&key2, &fp("2"), lease, idle).await,
        Ok(Claim::InFlight { .. })
    ));
    assert_completed(store, &session.seq_key(epoch, 1), &fp("1"), b"1").await;
}

/// A request's `ack` raises the mark (never lowers it), drops the answers it covers, keeps
/// the ones above it, and every number at or below the mark is refused.
pub async fn session_ack_drops_answers_and_refuses_below_the_mark<
    H: Harness<Store: SessionStore>,
>(
    h: &H,
) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let (idle, lease) = (20 * unit, 4 * unit);
    let epoch = answer(store, &session, (1, 0), idle, lease).await;
    for seq in 2..=3 {
        answer(store, &session, (seq, 0), idle, lease).await;
    }
    assert_eq!(open(store, &session, (4, 2), 64, idle).await, epoch);
    for seq in 1..=2 {
        // The record is gone: a claim of its key finds nothing to replay.
        match store
            .claim(&session.seq_key(epoch, seq), &fp("probe"), lease, idle)
            .await
        {
            Ok(Claim::Claimed(_)) => {}
            other => {
                panic!("request {seq} acknowledged: expected its record dropped, got {other:?}")
            }
        }
    }
    assert_completed(store, &session.seq_key(epoch, 3), &fp("3"), b"3").await;
    for (seq, ack) in [(2, 0), (1, 0), (3, 3)] {
        assert!(
            matches!(
                gate(store, &session, (seq, ack), 64, idle).await,
                SessionGate::Acknowledged { .. }
            ),
            "request {seq} with ack {ack}"
        );
    }
    // The mark is 3 now (the last refusal brought it); an older ack does not lower it.
    assert_eq!(
        gate(store, &session, (3, 1), 64, idle).await,
        SessionGate::Acknowledged { ack: 3 }
    );
}

/// A request numbered more than the window past the mark is refused; the window moves with
/// the mark, the request's own `ack` included.
pub async fn session_window_bounds_the_numbers<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let idle = 20 * unit;
    assert_eq!(
        gate(store, &session, (5, 0), 4, idle).await,
        SessionGate::WindowFull { ack: 0 }
    );
    let epoch = open(store, &session, (4, 0), 4, idle).await;
    assert_eq!(open(store, &session, (5, 1), 4, idle).await, epoch);
    assert_eq!(
        gate(store, &session, (10, 1), 4, idle).await,
        SessionGate::WindowFull { ack: 1 }
    );
}

/// A session nobody sends to for its idle time is forgotten with its answers: a request that
/// holds answers is refused as expired, and one that holds none starts it again in a new
/// epoch, sharing nothing with the old one.
pub async fn session_expires_after_its_idle_time<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let (idle, lease) = (2 * unit, unit);
    let epoch = answer(store, &session, (1, 0), idle, lease).await;
    h.advance(3 * unit).await;
    assert_eq!(
        gate(store, &session, (2, 1), 64, idle).await,
        SessionGate::Expired
    );
    let again = open(store, &session, (1, 0), 64, idle).await;
    assert_ne!(again, epoch, "a session started again gets a new epoch");
    match store
        .claim(&session.seq_key(again, 1), &fp("1"), lease, idle)
        .await
    {
        Ok(Claim::Claimed(_)) => {}
        other => panic!("the new epoch's request 1 has no record yet, got {other:?}"),
    }
}

/// Every request keeps the session and its unacknowledged answers alive for the idle time
/// from now: an answer older than the idle time is still replayed while its session is used.
pub async fn session_requests_keep_its_answers_alive<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let (idle, lease) = (4 * unit, unit);
    let epoch = answer(store, &session, (1, 0), idle, lease).await;
    for seq in 2..=4 {
        h.advance(2 * unit).await;
        answer(store, &session, (seq, 0), idle, lease).await;
    }
    // Request 1 was answered 6 units ago, with an idle time of 4.
    assert_eq!(open(store, &session, (1, 0), 64, idle).await, epoch);
    assert_completed(store, &session.seq_key(epoch, 1), &fp("1"), b"1").await;
}

/// Of many concurrent first requests of a session, all see one epoch; concurrent acks leave
/// the highest mark.
pub async fn session_gate_is_atomic<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let idle = 20 * unit;
    let mut tasks = tokio::task::JoinSet::new();
    for seq in 1..=64u64 {
        let store = store.clone();
        tasks.spawn(async move {
            store
                .open_session(&session, SessionRequest::new(seq, 0, 64, idle))
                .await
        });
    }
    let mut epochs = std::collections::HashSet::new();
    while let Some(gate) = tasks.join_next().await {
        match gate.expect("task").expect("open_session") {
            SessionGate::Open { epoch } => epochs.insert(epoch),
            other => panic!("expected Open, got {other:?}"),
        };
    }
    assert_eq!(epochs.len(), 1, "concurrent starts saw epochs {epochs:?}");
    let mut tasks = tokio::task::JoinSet::new();
    for ack in 1..=50u64 {
        let store = store.clone();
        tasks.spawn(async move {
            store
                .open_session(&session, SessionRequest::new(ack + 10, ack, 64, idle))
                .await
        });
    }
    while let Some(gate) = tasks.join_next().await {
        gate.expect("task").expect("open_session");
    }
    assert_eq!(
        gate(store, &session, (50, 0), 64, idle).await,
        SessionGate::Acknowledged { ack: 50 }
    );
}

/// Sessions never affect each other, nor the records of keys.
pub async fn sessions_are_isolated<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let (a, b) = (fresh_session(), fresh_session());
    let (idle, lease) = (20 * unit, 4 * unit);
    let key = fresh_key();
    let token = claimed(store, &key, &fp("key"), lease).await;
    let epoch = answer(store, &a, (1, 0), idle, lease).await;
    answer(store, &a, (2, 1), idle, lease).await;
    assert_eq!(
        gate(store, &b, (1, 1), 64, idle).await,
        SessionGate::Expired
    );
    let other = open(store, &b, (1, 0), 64, idle).await;
    match store
        .claim(&b.seq_key(other, 1), &fp("1"), lease, idle)
        .await
    {
        Ok(Claim::Claimed(_)) => {}
        found => panic!("session b's request 1 is its own, got {found:?}"),
    }
    assert_completed(store, &a.seq_key(epoch, 2), &fp("2"), b"2").await;
    store
        .complete(&key, token, Bytes::from_static(b"K"), idle)
        .await
        .expect("the key's record is untouched by sessions");
}

/// `session_mark` reads what the gates left, and changes nothing: nothing for an unknown
/// session, the epoch and the mark of a live one, nothing once it expired.
pub async fn session_mark_reads_what_the_gate_left<H: Harness<Store: SessionStore>>(h: &H) {
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let idle = 2 * unit;
    let read = || async { store.session_mark(&session).await.expect("session_mark") };
    assert_eq!(read().await, None);
    let epoch = open(store, &session, (3, 0), 64, idle).await;
    assert_eq!(read().await, Some(crate::SessionMark { epoch, ack: 0 }));
    open(store, &session, (5, 2), 64, idle).await;
    assert!(matches!(
        gate(store, &session, (1, 0), 64, idle).await,
        SessionGate::Acknowledged { ack: 2 }
    ));
    assert_eq!(read().await, Some(crate::SessionMark { epoch, ack: 2 }));
    h.advance(unit).await;
    read().await;
    // Reading kept nothing alive: the session expires its idle time after its last gate.
    h.advance(2 * unit).await;
    assert_eq!(read().await, None);
}

/// `claim_in_session` answers as the gate and then the claim would: a new request is admitted
/// with its record claimed under `seq_key(epoch, seq)`, an answered one replays, and each
/// refusal is the gate's, with nothing claimed.
pub async fn claim_in_session_is_the_gate_then_the_claim<H: Harness<Store: SessionStore>>(h: &H) {
    use crate::SessionClaim;
    use crate::inspect::KeyLabel;
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let (idle, lease) = (20 * unit, 4 * unit);
    let label = KeyLabel::from_bytes(Bytes::new());
    let ask = |seq: u64, ack: u64| {
        let (session, label) = (&session, &label);
        async move {
            store
                .claim_in_session(
                    session,
                    SessionRequest::new(seq, ack, 4, idle),
                    &fp(&seq.to_string()),
                    lease,
                    label,
                )
                .await
                .unwrap_or_else(|e| panic!("claim_in_session({seq}, ack {ack}): {e:?}"))
        }
    };
    // A session with an answer, unknown to the store: expired, and nothing starts.
    assert!(matches!(
        ask(1, 1).await,
        SessionClaim::Refused(SessionGate::Expired)
    ));
    assert_eq!(store.session_mark(&session).await.expect("mark"), None);
    // Admitted and claimed, in the epoch the session's mark reads.
    let (epoch, token) = match ask(1, 0).await {
        SessionClaim::Admitted {
            epoch,
            claim: Claim::Claimed(token),
        } => (epoch, token),
        other => panic!("request 1: expected its record claimed, got {other:?}"),
    };
    assert_eq!(
        store.session_mark(&session).await.expect("mark"),
        Some(crate::SessionMark { epoch, ack: 0 })
    );
    let key = session.seq_key(epoch, 1);
    store
        .complete(&key, token, Bytes::from_static(b"1"), idle)
        .await
        .expect("the claim is of seq_key(epoch, 1)");
    // Answered: the same request replays.
    match ask(1, 0).await {
        SessionClaim::Admitted {
            epoch: again,
            claim:
                Claim::Completed {
                    fingerprint,
                    payload,
                    ..
                },
        } => {
            assert_eq!(again, epoch);
            assert_eq!(fingerprint, fp("1"));
            assert_eq!(payload.as_ref(), b"1");
        }
        other => panic!("request 1 again: expected its answer, got {other:?}"),
    }
    // Request 2 acknowledges 1: admitted, then request 1 is refused below the mark.
    match ask(2, 1).await {
        SessionClaim::Admitted {
            epoch: again,
            claim: Claim::Claimed(_),
        } => assert_eq!(again, epoch),
        other => panic!("request 2: expected its record claimed, got {other:?}"),
    }
    assert!(matches!(
        ask(1, 0).await,
        SessionClaim::Refused(SessionGate::Acknowledged { ack: 1 })
    ));
    // Beyond the window (4 past the mark): refused, and its record is not claimed.
    assert!(matches!(
        ask(6, 1).await,
        SessionClaim::Refused(SessionGate::WindowFull { ack: 1 })
    ));
    match store
        .claim(&session.seq_key(epoch, 6), &fp("6"), lease, idle)
        .await
    {
        Ok(Claim::Claimed(_)) => {}
        found => panic!("a refused request claims nothing, got {found:?}"),
    }
}

/// A request claimed through `claim_in_session` is never one a later request's `ack`
/// covered: of a duplicate of an answered request racing the request that acknowledges it,
/// the duplicate replays or is refused, and never holds a claim to run it again.
pub async fn claim_in_session_never_claims_an_acknowledged_request<
    H: Harness<Store: SessionStore>,
>(
    h: &H,
) {
    use crate::SessionClaim;
    use crate::inspect::KeyLabel;
    let (store, unit) = (h.store(), h.time_unit());
    let session = fresh_session();
    let (idle, lease) = (50 * unit, 20 * unit);
    let label = KeyLabel::from_bytes(Bytes::new());
    let ask = move |seq: u64, ack: u64| {
        let (store, label) = (store.clone(), label.clone());
        async move {
            store
                .claim_in_session(
                    &session,
                    SessionRequest::new(seq, ack, 8, idle),
                    &fp(&seq.to_string()),
                    lease,
                    &label,
                )
                .await
        }
    };
    let (mut replayed, mut refused) = (0, 0);
    for seq in 1..=40u64 {
        // Request `seq` runs and is answered.
        let (epoch, token) = match ask(seq, seq - 1).await.expect("claim_in_session") {
            SessionClaim::Admitted {
                epoch,
                claim: Claim::Claimed(token) | Claim::TakenOver { token, .. },
            } => (epoch, token),
            other => panic!("request {seq}: expected its record claimed, got {other:?}"),
        };
        store
            .complete(
                &session.seq_key(epoch, seq),
                token,
                Bytes::from(seq.to_string()),
                idle,
            )
            .await
            .expect("complete");
        // Its duplicate races the next request, which acknowledges it.
        let duplicate = tokio::spawn(ask(seq, seq - 1));
        let next = tokio::spawn(ask(seq + 1, seq));
        match duplicate.await.expect("task").expect("duplicate") {
            SessionClaim::Admitted {
                claim: Claim::Completed { payload, .. },
                ..
            } => {
                assert_eq!(payload, Bytes::from(seq.to_string()));
                replayed += 1;
            }
            SessionClaim::Refused(SessionGate::Acknowledged { ack }) => {
                assert_eq!(ack, seq);
                refused += 1;
            }
            other => panic!("the duplicate of answered request {seq} got {other:?}"),
        }
        // The next request holds its claim: release it, so the loop claims it afresh.
        match next.await.expect("task").expect("next") {
            SessionClaim::Admitted {
                epoch,
                claim: Claim::Claimed(token),
            } => store
                .release(&session.seq_key(epoch, seq + 1), token)
                .await
                .expect("release"),
            other => panic!(
                "request {}: expected its record claimed, got {other:?}",
                seq + 1
            ),
        }
    }
    assert_eq!(replayed + refused, 40);
}

// The PostgreSQL transactional mode runs plain keys: a session's call goes through the
// runtime.
use idempotent_core::session::InSession;
use idempotent_core::Call;
use idempotent_postgres::Transactional;

async fn pay(transactional: Transactional, tx: &mut sqlx::PgConnection) {
    let call = Call::in_session("device-7".parse().unwrap(), InSession::new(1, 0).unwrap());
    let _ = transactional.claim::<u64>(&call, tx).await;
}

fn main() {}

use idempotent_core::idempotent;

struct Session;

type Result<T> = std::result::Result<T, idempotent_core::Error>;

#[idempotent(key = user)]
async fn open_sessions(user: &str) -> Result<Vec<Session>> {
    let _ = user;
    Ok(vec![Session])
}

fn main() {}

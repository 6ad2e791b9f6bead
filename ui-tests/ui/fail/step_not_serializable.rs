use idempotent_core::step;

struct Reservation;

#[step]
async fn reserve() -> Reservation {
    Reservation
}

fn main() {}

//! Every receiver: `&self`, `&mut self`, `self`, `mut self`, `self: Arc<Self>`,
//! `self: Box<Self>`, `self: Pin<&mut Self>`.

use std::pin::Pin;
use std::sync::Arc;

use idempotent_core::{Error, idempotent};

struct Account {
    id: u64,
    balance: u64,
}

impl Account {
    #[idempotent(key = self.id)]
    async fn by_ref(&self) -> Result<u64, Error> {
        Ok(self.balance)
    }

    #[idempotent(key = self.id)]
    async fn by_mut(&mut self, amount: u64) -> Result<u64, Error> {
        self.balance += amount;
        Ok(self.balance)
    }

    #[idempotent(key = self.id)]
    async fn by_value(self) -> Result<u64, Error> {
        Ok(self.balance)
    }

    #[idempotent(key = self.id)]
    async fn by_mut_value(mut self, amount: u64) -> Result<u64, Error> {
        self.balance -= amount;
        Ok(self.balance)
    }

    #[idempotent(key = self.id)]
    async fn by_arc(self: Arc<Self>) -> Result<u64, Error> {
        Ok(self.balance)
    }

    #[idempotent(key = self.id)]
    async fn by_box(self: Box<Self>) -> Result<u64, Error> {
        Ok(self.balance)
    }

    #[idempotent(key = self.id)]
    async fn by_pin(self: Pin<&mut Self>) -> Result<u64, Error> {
        Ok(self.balance)
    }
}

fn main() {
    let mut account = Account { id: 1, balance: 0 };
    drop(account.by_ref());
    drop(account.by_mut(1));
    drop(Pin::new(&mut account).by_pin());
    drop(Arc::new(Account { id: 2, balance: 0 }).by_arc());
    drop(Box::new(Account { id: 3, balance: 0 }).by_box());
    drop(Account { id: 4, balance: 0 }.by_mut_value(0));
    drop(account.by_value());
}

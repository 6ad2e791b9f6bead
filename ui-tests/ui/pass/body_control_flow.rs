//! Bodies with `?`, early `return`, inner attributes, a result type alias, a boxed error, and
//! unit, `Option` and `Vec` values.

use idempotent_core::idempotent;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type Result<T, E = BoxError> = std::result::Result<T, E>;

#[idempotent(key = input)]
async fn parse(input: &str) -> Result<u64> {
    #![allow(clippy::needless_return)]
    if input.is_empty() {
        return Err("empty".into());
    }
    let value: u64 = input.parse()?;
    Ok(value)
}

#[idempotent(key = id)]
async fn unit(id: u64) -> Result<()> {
    Ok(())
}

#[idempotent(key = id)]
async fn optional(id: u64) -> Result<Option<Vec<String>>> {
    Ok(None)
}

#[idempotent(key = id)]
async fn labelled(id: u64) -> std::result::Result<Vec<u8>, BoxError> {
    let out = 'done: {
        if id == 0 {
            break 'done Vec::new();
        }
        vec![1]
    };
    Ok(out)
}

fn main() {
    drop(parse("1"));
    drop(unit(1));
    drop(optional(1));
    drop(labelled(1));
}

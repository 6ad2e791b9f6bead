//! What the benchmarks' markdown tables share: whole numbers with thousands separators.

/// `n` with a comma before every group of three digits: `1234567` is `1,234,567`.
pub fn thousands(n: u64) -> String {
    separated(&n.to_string())
}

/// `value` rounded to a whole number, with separators; `–` when it is not finite (a rate
/// that has no measurement).
pub fn rounded_thousands(value: f64) -> String {
    if !value.is_finite() {
        return "–".into();
    }
    separated(&format!("{value:.0}"))
}

fn separated(digits: &str) -> String {
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_get_thousands_separators() {
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(0), "0");
        assert_eq!(rounded_thousands(1_234_567.4), "1,234,567");
        assert_eq!(rounded_thousands(999.0), "999");
        assert_eq!(rounded_thousands(f64::NAN), "–");
    }
}

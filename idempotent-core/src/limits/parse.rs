//! `parse_duration`: durations as people write them, the syntax of the attribute's literals.

use std::time::Duration;

/// Parses a duration as people write it, the syntax of the `#[idempotent]` attribute's string
/// literals: one or more spans of a number and a unit, spaces allowed between them
/// (`"500ms"`, `"90s"`, `"15m"`, `"24h"`, `"7d"`, `"1h 30m"`, `"1.5h"`, `"2 days"`).
///
/// | unit | also written |
/// |---|---|
/// | `ns` | `nanos`, `nsec` |
/// | `us` | `µs`, `usec` |
/// | `ms` | `millis`, `msec` |
/// | `s` | `sec`, `secs`, `second`, `seconds` |
/// | `m` | `min`, `mins`, `minute`, `minutes` |
/// | `h` | `hr`, `hrs`, `hour`, `hours` |
/// | `d` | `day`, `days` |
/// | `w` | `wk`, `wks`, `week`, `weeks` |
/// | `M` (30.44 days) | `month`, `months` |
/// | `y` (365.25 days) | `yr`, `yrs`, `year`, `years` |
///
/// Units are case-sensitive (`M` is a month, `m` a minute). A number may have a fraction
/// (`"1.5h"`). A bare `"0"` is zero; any other number needs a unit. A count of milliseconds
/// is read up to `u64::MAX` (`"18446744073709551615ms"`), like [`Duration::from_millis`].
/// Signs, other characters and an empty text are errors.
///
/// This checks the syntax only: a zero or a year parses. Check the result against its setting
/// with [`check_ttl`](super::check_ttl), [`check_lease`](super::check_lease) or
/// [`check_record_retry`](super::check_record_retry).
///
/// Earlier releases of the attribute and the examples read one number and one of `ms`, `s`,
/// `m`, `h` and `d`; each of those parses to the same duration here. The other units and spellings,
/// several spans, spaces, fractions and `"0"` are new.
///
/// ```
/// use std::time::Duration;
/// use idempotent_core::limits::parse_duration;
///
/// assert_eq!(parse_duration("90s"), Ok(Duration::from_secs(90)));
/// assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(90 * 60)));
/// assert_eq!(parse_duration("1.5ms"), Ok(Duration::from_micros(1500)));
/// let error = parse_duration("soon").unwrap_err();
/// assert_eq!(error.input(), "soon");
/// ```
///
/// # Errors
///
/// [`ParseDurationError`] when `text` is not a duration: its message quotes the text, says
/// what is wrong with it and shows the expected form.
pub fn parse_duration(text: &str) -> Result<Duration, ParseDurationError> {
    humantime::parse_duration(text).or_else(|error| {
        // humantime counts milliseconds in a `u64` of nanoseconds, so it overflows past 584
        // years; a count of milliseconds alone is read up to `u64::MAX` as it always was.
        match text.strip_suffix("ms") {
            Some(digits) if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) => {
                if let Ok(millis) = digits.parse() {
                    return Ok(Duration::from_millis(millis));
                }
            }
            _ => {}
        }
        Err(ParseDurationError {
            input: text.to_owned(),
            reason: error.to_string(),
        })
    })
}

/// A text that [`parse_duration`] cannot read. The message quotes the text, says why and shows
/// the expected form: `"soon" is not a duration (expected number at 0): expected a number and a
/// unit, such as 500ms, 90s, 15m, 24h or 7d`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{input:?} is not a duration ({reason}): expected a number and a unit, such as 500ms, 90s, \
     15m, 24h or 7d"
)]
pub struct ParseDurationError {
    input: String,
    reason: String,
}

impl ParseDurationError {
    /// The text that was refused.
    pub fn input(&self) -> &str {
        &self.input
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parser of the attribute and the examples before `parse_duration`: one number, then
    /// `ms`, `s`, `m`, `h` or `d`, as long as the milliseconds fit a `u64`.
    fn parsed_before(text: &str) -> Option<Duration> {
        let split = text.find(|c: char| !c.is_ascii_digit())?;
        let (number, unit) = text.split_at(split);
        let number: u64 = number.parse().ok()?;
        let per_unit = match unit {
            "ms" => 1,
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return None,
        };
        number.checked_mul(per_unit).map(Duration::from_millis)
    }

    #[test]
    fn the_forms_read_before_parse_to_the_same_duration() {
        let numbers = [
            "0",
            "1",
            "007",
            "99",
            "100",
            "500",
            "3600",
            "8760",
            "31536000000",
            "213503982334",
            "18446744073709551",
            "18446744073709551615",
        ];
        let mut checked = 0;
        for number in numbers {
            for unit in ["ms", "s", "m", "h", "d"] {
                let text = format!("{number}{unit}");
                if let Some(expected) = parsed_before(&text) {
                    assert_eq!(parse_duration(&text), Ok(expected), "{text}");
                    checked += 1;
                }
            }
        }
        assert_eq!(checked, 53, "the cases that fit a `u64` of milliseconds");
    }

    proptest::proptest! {
        #[test]
        fn every_form_read_before_parses_to_the_same_duration(
            zeros in 0..3usize,
            number in proptest::prop_oneof![
                proptest::prelude::any::<u64>(),
                0..100_000_000_000u64,
                0..1_000u64,
            ],
            unit in proptest::sample::select(&["ms", "s", "m", "h", "d"][..]),
        ) {
            let text = format!("{}{number}{unit}", "0".repeat(zeros));
            if let Some(expected) = parsed_before(&text) {
                proptest::prop_assert_eq!(parse_duration(&text), Ok(expected), "{}", text);
            }
        }
    }

    #[test]
    fn new_forms_parse() {
        for (text, expected) in [
            ("0", Duration::ZERO),
            ("1h 30m", Duration::from_secs(5400)),
            ("1h30m", Duration::from_secs(5400)),
            ("1.5h", Duration::from_secs(5400)),
            ("2 days", Duration::from_secs(2 * 86_400)),
            ("1w", Duration::from_secs(7 * 86_400)),
            ("500us", Duration::from_micros(500)),
            ("250µs", Duration::from_micros(250)),
            ("10ns", Duration::from_nanos(10)),
            (" 5s ", Duration::from_secs(5)),
        ] {
            assert_eq!(parse_duration(text), Ok(expected), "{text}");
        }
    }

    #[test]
    fn malformed_durations_say_why_and_what_is_expected() {
        for text in [
            "",
            " ",
            "s",
            "1",
            "45",
            "-1s",
            "+5ms",
            "+5s",
            "1x",
            "soon",
            "one day",
            "1..5h",
            "1h-",
            "99999999999999999999d",
            "18446744073709551616ms",
        ] {
            let error = parse_duration(text).expect_err(text);
            assert_eq!(error.input(), text);
            let message = error.to_string();
            assert!(
                message.starts_with(&format!("{text:?} is not a duration (")),
                "{message}"
            );
            assert!(
                message.ends_with("such as 500ms, 90s, 15m, 24h or 7d"),
                "{message}"
            );
        }
        assert_eq!(
            parse_duration("5 parsecs").unwrap_err().to_string(),
            "\"5 parsecs\" is not a duration (unknown time unit \"parsecs\", supported units: \
             ns, us/µs, ms, sec, min, hours, days, weeks, months, years (and few variations)): \
             expected a number and a unit, such as 500ms, 90s, 15m, 24h or 7d"
        );
    }
}

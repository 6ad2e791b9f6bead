//! Unit tests of the duration limits and their checks (`super`).

use super::*;

#[test]
fn the_compile_time_messages_name_the_bound_and_the_range() {
    for (setting, above, message) in [
        (
            Setting::Ttl,
            false,
            "ttl must be at least 1ms (`idempotent_core::limits::MIN_TTL`): write a \
             duration from 1ms to 365d",
        ),
        (
            Setting::Ttl,
            true,
            "ttl must be at most 365d (`idempotent_core::limits::MAX_TTL`): write a \
             duration from 1ms to 365d",
        ),
        (
            Setting::Lease,
            false,
            "lease must be at least 100ms (`idempotent_core::limits::MIN_LEASE`): write a \
             duration from 100ms to 365d",
        ),
        (
            Setting::Lease,
            true,
            "lease must be at most 365d (`idempotent_core::limits::MAX_LEASE`): write a \
             duration from 100ms to 365d",
        ),
    ] {
        assert_eq!(out_of_range(setting, above).as_str(), message);
    }
}

#[test]
fn the_compile_time_check_takes_both_ends_and_panics_past_them() {
    for setting in [Setting::Ttl, Setting::Lease, Setting::RecordRetry] {
        let (min, max) = setting.bounds();
        assert_eq!(require_const(setting, min), min);
        assert_eq!(require_const(setting, max), max);
        let over =
            std::panic::catch_unwind(|| require_const(setting, max + Duration::from_nanos(1)));
        assert!(over.is_err(), "{setting}");
        if let Some(under) = min.checked_sub(Duration::from_nanos(1)) {
            assert!(std::panic::catch_unwind(|| require_const(setting, under)).is_err());
        }
    }
    const CHECKED: Duration = require_const(Setting::Lease, Duration::from_secs(30));
    assert_eq!(CHECKED, Duration::from_secs(30));
}

#[test]
fn durations_read_as_written() {
    for (d, text) in [
        (Duration::ZERO, "0s"),
        (Duration::from_millis(100), "100ms"),
        (Duration::from_millis(1500), "1500ms"),
        (Duration::from_secs(90), "90s"),
        (Duration::from_secs(15 * 60), "15m"),
        (Duration::from_secs(24 * 3600), "1d"),
        (Duration::from_secs(36 * 3600), "36h"),
        (MAX_TTL, "365d"),
        (Duration::from_micros(500), "500µs"),
        (Duration::from_nanos(1_500_000), "1.5ms"),
        (Duration::MAX, "18446744073709551615.999999999s"),
    ] {
        assert_eq!(Human(d).to_string(), text, "{d:?}");
    }
}

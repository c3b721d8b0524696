//! Checks of the numbers on the command line, shared by the commands: durations,
//! percentages, and memory regions against the device's `max_mr_size` and the memory
//! this host has free.
//!
//! A command line a command cannot run with is a usage error: the command prints why,
//! naming the argument, and exits with [`USAGE`], as clap does for its own errors. These
//! checks run before anything is bound, allocated or connected.

use std::time::Duration;

use softrdma::DeviceAttr;

/// The exit status of a usage error (clap's).
pub const USAGE: i32 = 2;

/// The longest duration a command takes (`--duration`, `-D`): 30 days.
pub const MAX_DURATION: Duration = Duration::from_secs(30 * 24 * 3600);

/// Parses a duration: a number of seconds, or a number with a unit (`ms`, `s`, `m`,
/// `h`); positive, finite, and at most [`MAX_DURATION`]. For clap's `value_parser`.
pub fn duration(s: &str) -> Result<Duration, String> {
    let num = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &s[num.len()..];
    let v: f64 = num.trim().parse().map_err(|_| format!("{s:?} is not a duration"))?;
    let scale = match unit {
        "ms" => 1e-3,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => return Err(format!("unknown unit in {s:?} (use ms, s, m or h)")),
    };
    match Duration::try_from_secs_f64(v * scale) {
        Ok(d) if !d.is_zero() && d <= MAX_DURATION => Ok(d),
        _ => Err(format!("{s:?} is not a duration between 1 ns and {} days", MAX_DURATION.as_secs() / 86400)),
    }
}

/// Parses a percentage between 0 and 100 (NaN and infinities are not). For clap's
/// `value_parser`.
pub fn percent(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number"))?;
    if (0.0..=100.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{s} is not a percentage between 0 and 100"))
    }
}

/// Bytes of memory this host can still give (`MemAvailable`), if it says.
pub fn memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Refuses memory regions of `lens` bytes (`None`: the size overflowed) that the device
/// cannot register or this host cannot hold; `what` names the arguments that chose them.
pub fn check_regions(what: &str, lens: &[Option<u64>], attr: &DeviceAttr) -> Result<(), String> {
    let mut total = 0u64;
    for len in lens {
        let Some(len) = *len else {
            return Err(format!("{what}: the memory region's size overflows"));
        };
        if len > attr.max_mr_size {
            return Err(format!(
                "{what}: a memory region of {len} bytes is more than the device's max_mr_size ({})",
                attr.max_mr_size
            ));
        }
        total = total.saturating_add(len);
    }
    match memory_available() {
        Some(free) if total > free => Err(format!(
            "{what}: memory regions of {total} bytes are more than the {free} bytes of memory available"
        )),
        _ => Ok(()),
    }
}

/// `a * b` as a region size, `None` when it overflows.
pub fn mul(a: usize, b: usize) -> Option<u64> {
    a.checked_mul(b).and_then(|n| u64::try_from(n).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_positive_finite_and_bounded() {
        assert_eq!(duration("1.5").unwrap(), Duration::from_millis(1500));
        assert_eq!(duration("10m").unwrap(), Duration::from_secs(600));
        assert_eq!(duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(duration("2h").unwrap(), Duration::from_secs(7200));
        for bad in ["0", "-1", "nan", "NaN", "inf", "-inf", "1e30", "31d", "1e400", "", "s", "3x", "31 d"] {
            assert!(duration(bad).is_err(), "{bad}");
        }
        assert!(duration("720h").is_ok());
        assert!(duration("721h").is_err());
    }

    #[test]
    fn percentages_are_between_0_and_100() {
        assert_eq!(percent("0").unwrap(), 0.0);
        assert_eq!(percent("100").unwrap(), 100.0);
        for bad in ["-0.1", "100.01", "nan", "inf", "-inf", "x", ""] {
            assert!(percent(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn regions_past_the_device_or_the_memory_are_refused() {
        let attr = softrdma::find_device("127.0.0.1").unwrap().attr();
        assert!(check_regions("-s 1", &[Some(1), Some(4096)], &attr).is_ok());
        let e = check_regions("-s 2", &[Some(attr.max_mr_size + 1)], &attr).unwrap_err();
        assert!(e.starts_with("-s 2: ") && e.contains("max_mr_size"), "{e}");
        let e = check_regions("-s 3", &[None], &attr).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
        if let Some(free) = memory_available() {
            let half = free / 2 + 1;
            if half <= attr.max_mr_size {
                let e = check_regions("-s 4", &[Some(half), Some(half)], &attr).unwrap_err();
                assert!(e.contains("memory available"), "{e}");
            }
        }
        assert_eq!(mul(usize::MAX, 2), None);
    }
}

//! The kernel's cpu list format: parsing, printing, and refusing bad input.

use tilearn_affinity::{AffinityError, CpuSet};

fn ids(text: &str) -> Vec<usize> {
    CpuSet::parse(text)
        .unwrap_or_else(|e| panic!("{text:?} should parse: {e}"))
        .to_vec()
}

#[test]
fn parses_ids_and_ranges() {
    assert_eq!(ids("0-3,8-11"), vec![0, 1, 2, 3, 8, 9, 10, 11]);
    assert_eq!(ids("5"), vec![5]);
    assert_eq!(ids("0,2,4-5"), vec![0, 2, 4, 5]);
    assert_eq!(ids("7-7"), vec![7]);
    // Overlaps and disorder are a set's business, not an error (cgroup files never have them,
    // but a hand-written TILEARN list might).
    assert_eq!(ids("4-6,0,5"), vec![0, 4, 5, 6]);
}

#[test]
fn empty_and_whitespace() {
    assert!(CpuSet::parse("").expect("empty is valid").is_empty());
    assert!(CpuSet::parse("  \n").expect("blank is valid").is_empty());
    // sysfs files end with a newline; elements may carry spaces.
    assert_eq!(ids("0-1,4\n"), vec![0, 1, 4]);
    assert_eq!(ids(" 2 - 3 , 9 "), vec![2, 3, 9]);
}

#[test]
fn bad_input_is_a_typed_error() {
    for bad in [
        "0-",
        "-3",
        "3-1",
        "a",
        "1,,2",
        ",1",
        "1,",
        "1 2",
        "0x3",
        "1-2-3",
        "+1",
        "99999999",
        "99999999999999999999999999",
    ] {
        match CpuSet::parse(bad) {
            Err(AffinityError::CpuList { input, reason }) => {
                assert_eq!(input, bad);
                assert!(!reason.is_empty(), "{bad:?}: the error must say why");
            }
            other => panic!("{bad:?} must be refused, got {other:?}"),
        }
    }
}

#[test]
fn prints_maximal_ranges_and_round_trips() {
    let cases = [
        ("0-3,8-11", "0-3,8-11"),
        ("3,1,2", "1-3"),
        ("0,2,4", "0,2,4"),
        ("0-1,2-3,5", "0-3,5"),
        ("", ""),
        ("63-65", "63-65"),
    ];
    for (input, printed) in cases {
        let set = CpuSet::parse(input).expect("valid");
        assert_eq!(set.to_string(), printed);
        assert_eq!(CpuSet::parse(&set.to_string()).expect("reparse"), set);
    }
}

#[test]
fn set_operations() {
    let a = CpuSet::parse("0-7").unwrap();
    let b = CpuSet::parse("4-11").unwrap();
    assert_eq!(a.intersection(&b).to_string(), "4-7");
    assert_eq!(a.union(&b).to_string(), "0-11");
    assert_eq!(a.difference(&b).to_string(), "0-3");
    assert_eq!((a.first(), a.last(), a.len()), (Some(0), Some(7), 8));
    assert!(CpuSet::parse("1,3").unwrap().is_subset(&a));
}

#[test]
fn serializes_as_the_cpu_list_string() {
    let set = CpuSet::parse("0-3,8").unwrap();
    let json = serde_json::to_string(&set).unwrap();
    assert_eq!(json, "\"0-3,8\"");
    let back: CpuSet = serde_json::from_str(&json).unwrap();
    assert_eq!(back, set);
    assert!(serde_json::from_str::<CpuSet>("\"3-1\"").is_err());
}

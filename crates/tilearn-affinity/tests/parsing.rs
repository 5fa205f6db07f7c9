//! Small parsers: PCI bus ids, LOCAL_RANK / LOCAL_WORLD_SIZE, bind modes, the opt-out value.

use tilearn_affinity::{AffinityError, BindMode, LocalRank, normalize_bus_id, opt_out_from};

#[test]
fn bus_ids_in_every_spelling_normalise_to_sysfs_form() {
    for (input, want) in [
        ("0000:3b:00.0", "0000:3b:00.0"),
        ("0000:3B:00.0", "0000:3b:00.0"),     // cuDeviceGetPCIBusId
        ("00000000:3B:00.0", "0000:3b:00.0"), // nvidia-smi
        ("3b:00.0", "0000:3b:00.0"),
        (" 0001:c1:1f.7\n", "0001:c1:1f.7"),
    ] {
        assert_eq!(normalize_bus_id(input).as_deref(), Some(want), "{input:?}");
    }
    for bad in [
        "",
        "3b:00",
        "0000:3b:00.8",
        "0000:3b:20.0",
        "0000:3g:00.0",
        "0000:100:00.0",
        "a:b:c:d.0",
    ] {
        assert_eq!(normalize_bus_id(bad), None, "{bad:?}");
    }
}

#[test]
fn local_rank_defaults_and_validation() {
    assert_eq!(
        LocalRank::parse(None, None).unwrap(),
        LocalRank {
            rank: 0,
            world_size: 1
        }
    );
    assert_eq!(
        LocalRank::parse(Some("3"), Some("8")).unwrap(),
        LocalRank {
            rank: 3,
            world_size: 8
        }
    );
    // LOCAL_RANK alone: the world is at least big enough to hold it.
    assert_eq!(
        LocalRank::parse(Some("2"), None).unwrap(),
        LocalRank {
            rank: 2,
            world_size: 3
        }
    );
    for (rank, world, variable) in [
        (Some("-1"), None, "LOCAL_RANK"),
        (Some("x"), Some("2"), "LOCAL_RANK"),
        (Some("2"), Some("2"), "LOCAL_RANK"),
        (None, Some("0"), "LOCAL_WORLD_SIZE"),
        (None, Some("two"), "LOCAL_WORLD_SIZE"),
    ] {
        match LocalRank::parse(rank, world) {
            Err(AffinityError::Env { variable: v, .. }) => {
                assert_eq!(v, variable, "{rank:?} {world:?}")
            }
            other => panic!("{rank:?} {world:?} must be refused, got {other:?}"),
        }
    }
}

#[test]
fn bind_modes() {
    assert_eq!("none".parse::<BindMode>().unwrap(), BindMode::None);
    assert_eq!("NUMA".parse::<BindMode>().unwrap(), BindMode::Numa);
    assert_eq!(
        "exclusive".parse::<BindMode>().unwrap(),
        BindMode::Exclusive
    );
    assert!(
        matches!("socket".parse::<BindMode>(), Err(AffinityError::BindMode(m)) if m == "socket")
    );
    assert_eq!(BindMode::Exclusive.to_string(), "exclusive");
}

#[test]
fn opt_out_values() {
    for off in ["off", "OFF", "0", "false", "none", "no", " off\n"] {
        assert!(opt_out_from(off), "{off:?}");
    }
    for on in ["on", "1", "numa", ""] {
        assert!(!opt_out_from(on), "{on:?}");
    }
}

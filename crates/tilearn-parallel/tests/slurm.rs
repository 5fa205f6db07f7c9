//! Slurm's compressed lists.

use tilearn_parallel::slurm::{expand_nodelist, expand_tasks_per_node};

#[test]
fn node_lists_expand_like_scontrol_show_hostnames() {
    assert_eq!(expand_nodelist("node01").unwrap(), ["node01"]);
    assert_eq!(
        expand_nodelist("node[01-04]").unwrap(),
        ["node01", "node02", "node03", "node04"]
    );
    assert_eq!(
        expand_nodelist("gpu[1,3-4,10],cpu7").unwrap(),
        ["gpu1", "gpu3", "gpu4", "gpu10", "cpu7"]
    );
    assert_eq!(
        expand_nodelist("r[1-2]n[08-09]").unwrap(),
        ["r1n08", "r1n09", "r2n08", "r2n09"]
    );
    assert_eq!(
        expand_nodelist("a[098-100]").unwrap(),
        ["a098", "a099", "a100"]
    );
    for bad in ["", "n[1-", "n[3-1]", "n[x]", "n]1[", "a,,b", "n[1-999999]"] {
        assert!(expand_nodelist(bad).is_err(), "{bad:?} should be refused");
    }
}

#[test]
fn tasks_per_node_expand() {
    assert_eq!(expand_tasks_per_node("4").unwrap(), [4]);
    assert_eq!(expand_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
    assert!(expand_tasks_per_node("2(x3").is_err());
    assert!(expand_tasks_per_node("x").is_err());
}

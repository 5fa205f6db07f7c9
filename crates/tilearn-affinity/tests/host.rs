//! The real system calls on this machine: pin a thread, read its mask back, memory policy, and
//! topology discovery of the host (which must never fail, whatever the container hides).

use std::sync::Arc;

use tilearn_affinity::{
    BindMode, Binding, CpuSet, Plan, RankPlan, ThreadRole, Topology, current_thread_affinity,
    page_nodes, pin_current_thread, prefer_memory_node, reset_memory_policy,
};

#[test]
fn pins_this_thread_and_reads_the_mask_back() {
    // A fresh thread, so the test harness's own threads keep their mask.
    std::thread::spawn(|| {
        let original = current_thread_affinity().expect("sched_getaffinity works on Linux");
        assert!(!original.is_empty());
        // The highest allowed CPU: a different one from CPU 0 where the machine has several.
        let cpu = original.last().unwrap();
        let one: CpuSet = [cpu].into_iter().collect();
        pin_current_thread(&one).expect("pinning to an allowed CPU succeeds");
        assert_eq!(current_thread_affinity().unwrap(), one);
        // A thread spawned now inherits the mask.
        let inherited = std::thread::spawn(current_thread_affinity)
            .join()
            .unwrap()
            .unwrap();
        assert_eq!(inherited, one);
        pin_current_thread(&original).expect("restoring the original mask");
        assert_eq!(current_thread_affinity().unwrap(), original);
        eprintln!("pinned to cpu {cpu}, then restored {original}");
    })
    .join()
    .expect("the pinning thread panicked");
}

#[test]
fn refuses_empty_and_impossible_sets() {
    std::thread::spawn(|| {
        let before = current_thread_affinity().unwrap();
        assert!(pin_current_thread(&CpuSet::new()).is_err());
        let far: CpuSet = [65_000].into_iter().collect();
        let err = pin_current_thread(&far).expect_err("no machine here has cpu 65000");
        assert!(
            err.to_string().contains("sched_setaffinity(cpus 65000)"),
            "{err}"
        );
        assert_eq!(
            current_thread_affinity().unwrap(),
            before,
            "a failed pin changes nothing"
        );
    })
    .join()
    .unwrap();
}

#[test]
fn loader_hook_pins_the_thread_it_runs_on() {
    let allowed = current_thread_affinity().unwrap();
    let cpu = allowed.first().unwrap();
    let one: CpuSet = [cpu].into_iter().collect();
    let rank = RankPlan {
        local_rank: 0,
        gpu: None,
        numa_node: None, // no memory policy: only the pinning is under test
        binding: Some(Binding {
            main: allowed.clone(),
            loader: one.clone(),
            comm: one.clone(),
        }),
        unpinned_reason: None,
    };
    assert_eq!(rank.cpus_for(ThreadRole::Loader), Some(&one));
    let hook: Arc<dyn Fn() + Send + Sync> = rank.loader_hook();
    let mask = std::thread::spawn(move || {
        hook();
        current_thread_affinity().unwrap()
    })
    .join()
    .unwrap();
    assert_eq!(mask, one);
}

#[test]
fn memory_policy_prefers_an_existing_node_and_refuses_a_missing_one() {
    std::thread::spawn(|| {
        match prefer_memory_node(0) {
            Ok(()) => {
                eprintln!("set_mempolicy(MPOL_PREFERRED, node 0): ok");
                reset_memory_policy().expect("MPOL_DEFAULT is always accepted when NUMA is");
            }
            // Kernels without CONFIG_NUMA, or a seccomp profile that forbids the call.
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("set_mempolicy"), "{text}");
                eprintln!("skipped: set_mempolicy unavailable here: {text}");
                return;
            }
        }
        let err = prefer_memory_node(4000).expect_err("node 4000 does not exist");
        eprintln!("node 4000 refused as expected: {err}");
        // Memory touched under the policy lands on node 0 (the preferred node has free pages
        // on any test machine); page_nodes reads it back.
        prefer_memory_node(0).unwrap();
        let buffer = vec![1u8; 1 << 20];
        reset_memory_policy().unwrap();
        let nodes = page_nodes(&[buffer.as_ptr(), buffer[(1 << 20) - 1..].as_ptr()]).unwrap();
        assert_eq!(nodes, [Some(0), Some(0)]);
        // An address that is not mapped has no node.
        assert_eq!(page_nodes(&[std::ptr::null()]).unwrap(), [None]);
    })
    .join()
    .unwrap();
}

#[test]
fn host_topology_never_fails_and_respects_the_mask() {
    let topology = Topology::detect();
    let mask = current_thread_affinity().unwrap();
    assert!(
        topology.allowed.is_subset(&mask),
        "{} vs {mask}",
        topology.allowed
    );
    eprintln!("{topology}");
    let plan = Plan::for_local_ranks(&topology, BindMode::Numa, 2, None);
    eprintln!("{plan}");
    for rank in &plan.ranks {
        if let Some(b) = &rank.binding {
            for set in [&b.main, &b.loader, &b.comm] {
                assert!(
                    !set.is_empty() && set.is_subset(&topology.allowed),
                    "{plan}"
                );
            }
        } else {
            assert!(rank.unpinned_reason.is_some());
        }
    }
}

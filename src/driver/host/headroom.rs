//! How much memory a host commit can still take, as Linux tells it: `MemAvailable` from
//! `/proc/meminfo` and, inside a memory cgroup (a container, a systemd slice), the room left
//! under its limit.
//!
//! Why the host backend asks before each create: a memfd's `fallocate` is bounded neither by
//! overcommit (shmem accounts page by page) nor by the cgroup until it is too late, so asking
//! for more than the machine has does not fail; it takes page after page until the kernel's
//! OOM killer ends some process, maybe not ours. Refusing up front turns that into
//! `Error::OutOfMemory` with the numbers.
//!
//! The cgroup is found once per process (`/proc/self/cgroup` against the usual mount points),
//! keeping only the levels that have a limit then: without one (the usual case outside
//! containers) a check reads `/proc/meminfo` alone; with one, also that level's limit, usage
//! and statistics. A limit set on a level that had none when the process started is not seen. The room under a
//! limit counts the cgroup's inactive file cache as free, since the kernel reclaims it before
//! it kills anything (the figure container runtimes call the working set). Both v2
//! (`memory.max`, `memory.current`, walked up to the mount root, as a parent's limit binds
//! too) and v1 (`memory.stat`'s `hierarchical_memory_limit`, `memory.usage_in_bytes`) are read.
//!
//! What cannot be read counts as no limit: the check is a guard against the OOM killer, and a
//! `/proc` or cgroup layout it does not know must not make every create fail.
// Plain file reads: none of the host backend's `unsafe` allowance is needed here.
#![deny(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use super::{mem_info_from, MEMINFO};

/// v1 reports "no limit" as the largest page-aligned counter (`PAGE_COUNTER_MAX` pages),
/// about 2^63; anything from 2^62 up is no limit in practice.
const V1_UNLIMITED: u64 = 1 << 62;

/// What a new commit on the host can take, and where each figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Headroom {
    /// `MemAvailable` of `/proc/meminfo`, in bytes.
    pub mem_available: u64,
    /// Room under the tightest memory cgroup limit over this process's cgroup and its
    /// ancestors; `None` without a limit (or without a readable cgroup).
    pub cgroup_room: Option<u64>,
}

impl Headroom {
    /// The bytes a commit can take: the smaller of the two figures.
    pub fn bytes(&self) -> u64 {
        self.cgroup_room
            .map_or(self.mem_available, |room| room.min(self.mem_available))
    }
}

/// The headroom now, or `None` when `/proc/meminfo` cannot be read.
pub fn current() -> Option<Headroom> {
    let (mem_available, _) = mem_info_from(MEMINFO).ok()?;
    let cgroup_room = memory_cgroup().as_ref().and_then(Cgroup::room);
    Some(Headroom {
        mem_available,
        cgroup_room,
    })
}

/// The memory cgroup of this process, found once, if it or an ancestor has a limit.
fn memory_cgroup() -> &'static Option<Cgroup> {
    static CGROUP: OnceLock<Option<Cgroup>> = OnceLock::new();
    CGROUP.get_or_init(|| {
        let membership = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let found = find_cgroup(
            &membership,
            Path::new("/sys/fs/cgroup"),
            Path::new("/sys/fs/cgroup/memory"),
        )?;
        found.limited()
    })
}

/// Where a process's memory cgroup lives, and which interface it speaks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cgroup {
    /// cgroup v2: the process's cgroup and each ancestor up to the mount root, leaf first;
    /// only directories with a `memory.max` (the root cgroup has none).
    V2(Vec<PathBuf>),
    /// cgroup v1's memory controller: the process's cgroup directory.
    V1(PathBuf),
}

impl Cgroup {
    /// This cgroup with only the levels that have a limit now, or `None` if none has.
    pub fn limited(self) -> Option<Cgroup> {
        let read = |dir: &Path, name: &str| std::fs::read_to_string(dir.join(name)).ok();
        match self {
            Cgroup::V2(dirs) => {
                let limited: Vec<PathBuf> = dirs
                    .into_iter()
                    .filter(|dir| read(dir, "memory.max").is_some_and(|max| max.trim() != "max"))
                    .collect();
                (!limited.is_empty()).then_some(Cgroup::V2(limited))
            }
            Cgroup::V1(dir) => {
                let stat = read(&dir, "memory.stat")?;
                let limit = stat_field(&stat, "hierarchical_memory_limit")?;
                (limit < V1_UNLIMITED).then_some(Cgroup::V1(dir))
            }
        }
    }

    /// Room under the tightest limit, or `None` without one (or when unreadable).
    pub fn room(&self) -> Option<u64> {
        let read = |dir: &Path, name: &str| std::fs::read_to_string(dir.join(name)).ok();
        match self {
            Cgroup::V2(dirs) => dirs
                .iter()
                .filter_map(|dir| {
                    let max = read(dir, "memory.max")?;
                    if max.trim() == "max" {
                        return None; // the common case: two small reads saved
                    }
                    let current = read(dir, "memory.current")?;
                    let stat = read(dir, "memory.stat").unwrap_or_default();
                    v2_room(&max, &current, &stat).ok().flatten()
                })
                .min(),
            Cgroup::V1(dir) => {
                let usage = read(dir, "memory.usage_in_bytes")?;
                let stat = read(dir, "memory.stat")?;
                v1_room(&usage, &stat).ok().flatten()
            }
        }
    }
}

/// The memory cgroup named by `membership` (the text of `/proc/self/cgroup`), under the v2
/// mount `v2_root` or the v1 memory mount `v1_root`. v2 wins where its memory controller is
/// on (its directory has `memory.max`). In a cgroup namespace the path is `/` and the mount
/// root is the process's own cgroup; a path that does not exist under the mount (a mount of
/// some other namespace) falls back to the mount root.
pub fn find_cgroup(membership: &str, v2_root: &Path, v1_root: &Path) -> Option<Cgroup> {
    let mut v2_path = None;
    let mut v1_path = None;
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2_path = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            v1_path = Some(path);
        }
    }
    if let Some(path) = v2_path {
        let leaf = under(v2_root, path, "memory.max");
        let dirs: Vec<PathBuf> = leaf
            .ancestors()
            .take_while(|dir| dir.starts_with(v2_root))
            .filter(|dir| dir.join("memory.max").is_file())
            .map(Path::to_path_buf)
            .collect();
        if !dirs.is_empty() {
            return Some(Cgroup::V2(dirs));
        }
    }
    let dir = under(v1_root, v1_path?, "memory.usage_in_bytes");
    dir.join("memory.stat").is_file().then_some(Cgroup::V1(dir))
}

/// `root` joined with the cgroup `path`, if that directory holds `file`; else `root`.
fn under(root: &Path, path: &str, file: &str) -> PathBuf {
    let dir = root.join(path.trim_start_matches('/'));
    match dir.join(file).is_file() {
        true => dir,
        false => root.to_path_buf(),
    }
}

/// The value of `key` in a `memory.stat` (`key value` lines).
fn stat_field(stat: &str, key: &str) -> Option<u64> {
    stat.lines().find_map(|line| {
        let (name, value) = line.split_once(' ')?;
        (name == key).then(|| value.trim().parse().ok())?
    })
}

fn parse_bytes(text: &str, what: &str) -> Result<u64, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("{what} is not a byte count: {:?}", text.trim()))
}

/// Room under a v2 limit from the texts of `memory.max`, `memory.current` and `memory.stat`:
/// `None` for `max` (no limit), else the limit less the usage that is not inactive file cache.
pub fn v2_room(max: &str, current: &str, stat: &str) -> Result<Option<u64>, String> {
    if max.trim() == "max" {
        return Ok(None);
    }
    let limit = parse_bytes(max, "memory.max")?;
    let usage = parse_bytes(current, "memory.current")?;
    let reclaimable = stat_field(stat, "inactive_file").unwrap_or(0);
    Ok(Some(
        limit.saturating_sub(usage.saturating_sub(reclaimable)),
    ))
}

/// Room under a v1 limit from the texts of `memory.usage_in_bytes` and `memory.stat` (whose
/// `hierarchical_memory_limit` is the tightest limit of the cgroup and its ancestors).
pub fn v1_room(usage: &str, stat: &str) -> Result<Option<u64>, String> {
    let limit = stat_field(stat, "hierarchical_memory_limit")
        .ok_or("memory.stat has no hierarchical_memory_limit")?;
    if limit >= V1_UNLIMITED {
        return Ok(None);
    }
    let usage = parse_bytes(usage, "memory.usage_in_bytes")?;
    let reclaimable = stat_field(stat, "total_inactive_file").unwrap_or(0);
    Ok(Some(
        limit.saturating_sub(usage.saturating_sub(reclaimable)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v2_limit_is_max_or_bytes_less_the_non_reclaimable_usage() {
        let stat = "anon 100\nfile 700\ninactive_file 300\nactive_file 400\n";
        assert_eq!(v2_room("max\n", "123\n", stat), Ok(None));
        assert_eq!(v2_room("1000\n", "900\n", stat), Ok(Some(400)));
        assert_eq!(v2_room("1000\n", "900\n", ""), Ok(Some(100)));
        // Over the limit (it can be, briefly): no room, not an underflow.
        assert_eq!(
            v2_room("1000\n", "5000\n", "inactive_file 10\n"),
            Ok(Some(0))
        );
        // More reclaimable than used (counters are read at different times).
        assert_eq!(v2_room("1000", "100", "inactive_file 300"), Ok(Some(1000)));
        assert!(v2_room("lots", "1", "").unwrap_err().contains("memory.max"));
        assert!(v2_room("1000", "", "")
            .unwrap_err()
            .contains("memory.current"));
    }

    #[test]
    fn v1_limit_is_the_hierarchical_one_and_huge_means_none() {
        let stat = |limit: u64| {
            format!(
                "cache 5\ninactive_file 1\nhierarchical_memory_limit {limit}\n\
                 total_inactive_file 200\n"
            )
        };
        assert_eq!(v1_room("800\n", &stat(1000)), Ok(Some(400)));
        assert_eq!(v1_room("800\n", &stat(9223372036854771712)), Ok(None));
        assert_eq!(v1_room("5000", &stat(1000)), Ok(Some(0)));
        assert!(v1_room("800", "cache 5\n").is_err());
        assert!(v1_room("x", &stat(1000)).is_err());
    }

    #[test]
    fn headroom_is_the_smaller_figure() {
        let headroom = |cgroup_room| Headroom {
            mem_available: 1000,
            cgroup_room,
        };
        assert_eq!(headroom(None).bytes(), 1000);
        assert_eq!(headroom(Some(10)).bytes(), 10);
        assert_eq!(headroom(Some(5000)).bytes(), 1000);
        let now = current().expect("/proc/meminfo is readable on Linux");
        assert!(now.bytes() > 0 && now.bytes() <= now.mem_available);
    }

    /// A fake cgroup tree under a temporary directory.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Tree {
            let root =
                std::env::temp_dir().join(format!("ekv-cgroup-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(&root).unwrap();
            Tree(root)
        }

        fn file(&self, path: &str, text: &str) -> &Tree {
            let path = self.0.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
            self
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn v2_walks_up_to_the_mount_and_takes_the_tightest_limit() {
        let tree = Tree::new("v2");
        let v2 = tree.0.join("v2");
        tree.file("v2/cgroup.controllers", "cpu memory\n")
            .file("v2/box/memory.max", "1000\n")
            .file("v2/box/memory.current", "900\n")
            .file("v2/box/memory.stat", "inactive_file 100\n")
            .file("v2/box/job/memory.max", "max\n")
            .file("v2/box/job/memory.current", "900\n");
        let found = find_cgroup("0::/box/job\n", &v2, &tree.0.join("v1")).unwrap();
        assert_eq!(found, Cgroup::V2(vec![v2.join("box/job"), v2.join("box")]));
        assert_eq!(found.room(), Some(200));
        assert_eq!(
            found.clone().limited(),
            Some(Cgroup::V2(vec![v2.join("box")]))
        );
        tree.file("v2/box/job/memory.max", "150\n")
            .file("v2/box/job/memory.current", "100\n");
        assert_eq!(found.room(), Some(50));
        assert_eq!(found.clone().limited(), Some(found.clone()));
        // In a namespace the path is "/" and the mount root is the process's cgroup.
        tree.file("v2/memory.max", "max\n");
        let namespaced = find_cgroup("0::/\n", &v2, &tree.0.join("v1")).unwrap();
        assert_eq!(namespaced, Cgroup::V2(vec![v2.clone()]));
        assert_eq!(namespaced.room(), None);
        assert_eq!(namespaced.limited(), None);
    }

    #[test]
    fn v1_is_used_where_v2_has_no_memory_controller() {
        let tree = Tree::new("v1");
        let stat = "hierarchical_memory_limit 4000\ntotal_inactive_file 500\n";
        tree.file("unified/cgroup.procs", "")
            .file("memory/job/memory.usage_in_bytes", "3000\n")
            .file("memory/job/memory.stat", stat);
        let membership = "9:pids:/\n4:memory:/job\n0::/\n";
        let found = find_cgroup(membership, &tree.0.join("unified"), &tree.0.join("memory"));
        let found = found.unwrap();
        assert_eq!(found, Cgroup::V1(tree.0.join("memory/job")));
        assert_eq!(found.room(), Some(1500));
        assert_eq!(found.clone().limited(), Some(found.clone()));
        let unlimited = "hierarchical_memory_limit 9223372036854771712\n";
        tree.file("memory/job/memory.stat", unlimited);
        assert_eq!(found.room(), None);
        assert_eq!(found.limited(), None);
        // No cgroup files at all: no limit known.
        let none = find_cgroup(membership, &tree.0.join("x"), &tree.0.join("y"));
        assert_eq!(none, None);
    }
}

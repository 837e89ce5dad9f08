//! How much of a mapped file a process holds in memory, from
//! `/proc/<pid>/smaps`: the evidence that the weights exist once, however
//! many workers map them (each worker's PSS is its share of the pages).

use std::path::Path;

/// Bytes of a process's mappings of one file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Residency {
    /// Resident pages, counted in full in every process that maps them.
    pub rss: u64,
    /// Resident pages divided by the number of processes that map them.
    pub pss: u64,
}

/// Sum `Rss` and `Pss` over every mapping of `path` in process `pid`. A
/// replaced or removed file shows as "path (deleted)" and is not counted.
pub fn mapping_residency(pid: u32, path: &Path) -> std::io::Result<Residency> {
    // The kernel shows the resolved path; resolve ours the same way.
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    Ok(parse_smaps(&smaps, &path.to_string_lossy()))
}

fn parse_smaps(smaps: &str, path: &str) -> Residency {
    let mut total = Residency::default();
    let mut in_mapping = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if !first.ends_with(':') {
            // A mapping header: "start-end perms offset dev inode   pathname".
            // The pathname may contain spaces, so take everything after the
            // fifth field.
            in_mapping = line.splitn(6, ' ').nth(5).map(str::trim_start) == Some(path);
            continue;
        }
        if !in_mapping {
            continue;
        }
        let kb = fields.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 1024;
        match first {
            "Rss:" => total.rss += kb,
            "Pss:" => total.pss += kb,
            _ => {}
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_only_the_mappings_of_the_path() {
        let smaps = "\
7f0000000000-7f0000100000 r--s 00000000 00:1a 42                         /dev/shm/w
Size:               1024 kB
Rss:                 512 kB
Pss:                 256 kB
Pss_Dirty:            99 kB
VmFlags: rd sh mr mw me ms sd
7f0000200000-7f0000300000 r--s 00000000 00:1a 42                         /dev/shm/w
Rss:                   4 kB
Pss:                   4 kB
7f0000400000-7f0000500000 r--s 00000000 00:1a 43                         /dev/shm/w (deleted)
Rss:                 100 kB
Pss:                 100 kB
7f0000600000-7f0000700000 r--s 00000000 00:1a 44                         /dev/shm/w2
Rss:                 100 kB
7f0000800000-7f0000900000 rw-p 00000000 00:00 0 
Rss:                 100 kB
";
        assert_eq!(parse_smaps(smaps, "/dev/shm/w"), Residency { rss: 516 * 1024, pss: 260 * 1024 });
        assert_eq!(parse_smaps(smaps, "/dev/shm/w (deleted)").rss, 100 * 1024);
        assert_eq!(parse_smaps("", "/dev/shm/w"), Residency::default());
    }
}

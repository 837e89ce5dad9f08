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
    let (smaps, path) = read_smaps(pid, path)?;
    Ok(parse_smaps(&smaps, &path))
}

/// Process `pid`'s smaps, and `path` as the kernel shows it there (resolved).
fn read_smaps(pid: u32, path: &Path) -> std::io::Result<(String, String)> {
    let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    Ok((std::fs::read_to_string(format!("/proc/{pid}/smaps"))?, path.to_string_lossy().into_owned()))
}

/// How a process maps one file: bytes mapped, and of those, bytes mapped
/// with huge pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HugePageMapping {
    /// Bytes mapped into the page tables: `Rss` plus hugetlb pages, which
    /// smaps counts apart from `Rss` (`Shared_Hugetlb`, `Private_Hugetlb`).
    pub mapped: u64,
    /// Bytes mapped with huge pages: a hugetlbfs mapping's pages, or a
    /// tmpfs's transparent huge pages mapped whole by one page-middle-
    /// directory entry (`ShmemPmdMapped`; `FilePmdMapped` for a file
    /// system's page cache).
    pub huge: u64,
    /// The largest `KernelPageSize` of the mappings (2 MiB on hugetlbfs;
    /// 4 KiB on a tmpfs even when its pages are huge).
    pub kernel_page: u64,
}

/// [`HugePageMapping`] of every mapping of `path` in process `pid`, from
/// `/proc/<pid>/smaps`. Only what has been touched is mapped: a mapping
/// counts its pages once they have been faulted in.
pub fn huge_page_mapping(pid: u32, path: &Path) -> std::io::Result<HugePageMapping> {
    let (smaps, path) = read_smaps(pid, path)?;
    Ok(parse_huge(&smaps, &path))
}

/// Call `f(field, bytes)` for every `Field: N kB` line of the mappings of `path`.
fn for_each_field(smaps: &str, path: &str, mut f: impl FnMut(&str, u64)) {
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
        if in_mapping {
            f(first, fields.next().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 1024);
        }
    }
}

fn parse_huge(smaps: &str, path: &str) -> HugePageMapping {
    let mut m = HugePageMapping::default();
    for_each_field(smaps, path, |field, bytes| match field {
        "Rss:" => m.mapped += bytes,
        "Shared_Hugetlb:" | "Private_Hugetlb:" => {
            m.mapped += bytes;
            m.huge += bytes;
        }
        "ShmemPmdMapped:" | "FilePmdMapped:" => m.huge += bytes,
        "KernelPageSize:" => m.kernel_page = m.kernel_page.max(bytes),
        _ => {}
    });
    m
}

fn parse_smaps(smaps: &str, path: &str) -> Residency {
    let mut total = Residency::default();
    for_each_field(smaps, path, |field, bytes| match field {
        "Rss:" => total.rss += bytes,
        "Pss:" => total.pss += bytes,
        _ => {}
    });
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

    #[test]
    fn counts_huge_pages_of_hugetlbfs_and_tmpfs_mappings() {
        // A hugetlbfs mapping: Rss is 0, the pages are in Shared_Hugetlb.
        let hugetlb = "\
7f0000000000-7f0000600000 r--s 00000000 00:2f 7                          /mnt/huge/w
Size:               6144 kB
KernelPageSize:     2048 kB
Rss:                   0 kB
Shared_Hugetlb:     4096 kB
Private_Hugetlb:       0 kB
";
        assert_eq!(parse_huge(hugetlb, "/mnt/huge/w"), HugePageMapping { mapped: 4096 * 1024, huge: 4096 * 1024, kernel_page: 2048 * 1024 });
        // A tmpfs with transparent huge pages: half of what is mapped is PMD-mapped.
        let thp = "\
7f0000000000-7f0000800000 r--s 00000000 00:1a 42                         /dev/shm/w
KernelPageSize:        4 kB
Rss:                8192 kB
ShmemPmdMapped:     4096 kB
FilePmdMapped:         0 kB
Shared_Hugetlb:        0 kB
7f0000a00000-7f0000b00000 r--s 00000000 00:1a 43                         /dev/shm/other
Rss:                1024 kB
ShmemPmdMapped:     1024 kB
";
        assert_eq!(parse_huge(thp, "/dev/shm/w"), HugePageMapping { mapped: 8192 * 1024, huge: 4096 * 1024, kernel_page: 4096 });
        assert_eq!(parse_huge(thp, "/dev/shm/nothing"), HugePageMapping::default());
    }
}

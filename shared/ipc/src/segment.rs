//! What both segment kinds share: names and paths, the per-name lock, the
//! space check, creating a fully reserved temp file, and bounds-checked
//! little-endian header fields.

use crate::IpcError;
use nix::errno::Errno;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

/// Data regions start at a multiple of this, so that every load the kernels
/// make from a segment is as aligned as from a fresh allocation. 4 KiB is the
/// x86-64 page; the layout must not depend on the machine it was built on.
pub const PAGE: usize = 4096;

pub fn align_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

pub fn io_err(path: &Path) -> impl FnOnce(io::Error) -> IpcError + '_ {
    move |source| IpcError::Io { path: path.to_path_buf(), source }
}

/// A segment name is one plain file name. A leading dot is refused because
/// temp files being built start with one.
pub fn check_name(name: &str) -> Result<(), IpcError> {
    let bad = |reason: &str| Err(IpcError::BadName { name: name.to_string(), reason: reason.to_string() });
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.contains(['/', '\0']) {
        return bad("it must be a plain file name, without '/'");
    }
    if name.starts_with('.') {
        return bad("it must not start with '.'");
    }
    Ok(())
}

pub fn segment_path(shm_dir: &Path, name: &str) -> Result<PathBuf, IpcError> {
    check_name(name)?;
    Ok(shm_dir.join(name))
}

fn temp_prefix(name: &str) -> String {
    format!(".{name}.tmp")
}

/// Take the exclusive lock `<shm_dir>/<name>.lock`, blocking until it is
/// free. Held while a segment is checked and (re)built, so concurrent
/// starters build it once. Released when the returned file is dropped.
pub fn lock(shm_dir: &Path, name: &str) -> Result<File, IpcError> {
    let (file, path) = open_lock_file(shm_dir, name)?;
    file.lock().map_err(io_err(&path))?;
    Ok(file)
}

/// `<shm_dir>/<name>.lock`, created if missing, not locked yet.
fn open_lock_file(shm_dir: &Path, name: &str) -> Result<(File, PathBuf), IpcError> {
    check_name(name)?;
    std::fs::create_dir_all(shm_dir).map_err(io_err(shm_dir))?;
    let path = shm_dir.join(format!("{name}.lock"));
    let file = File::options().create(true).truncate(false).write(true).open(&path).map_err(io_err(&path))?;
    Ok((file, path))
}

/// Take the lock `<shm_dir>/<name>.lock` for as long as the returned file is
/// kept, waiting at most `wait` for another holder to let go. The KV
/// segment's creator keeps it for the segment's whole life, so "the lock is
/// free" means "its owner is dead": flock locks die with their process, even
/// under `kill -9`, which is what makes it safe to reclaim a segment then.
/// `None` when a live process still holds it after `wait`.
pub fn try_lock_for(shm_dir: &Path, name: &str, wait: std::time::Duration) -> Result<Option<File>, IpcError> {
    let (file, path) = open_lock_file(shm_dir, name)?;
    let deadline = std::time::Instant::now() + wait;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
            Err(std::fs::TryLockError::Error(e)) => return Err(IpcError::Io { path, source: e }),
        }
    }
}

/// Whether a live process holds `<shm_dir>/<name>.lock` (see [`try_lock_for`]).
pub fn is_locked(shm_dir: &Path, name: &str) -> bool {
    let path = shm_dir.join(format!("{name}.lock"));
    match File::options().write(true).open(&path) {
        Ok(file) => matches!(file.try_lock(), Err(std::fs::TryLockError::WouldBlock)),
        Err(_) => false,
    }
}

/// Remove temp files that a builder killed mid-way left behind; they would
/// otherwise hold tmpfs memory until reboot. Call only under [`lock`].
pub fn remove_stale_temps(shm_dir: &Path, name: &str) {
    let prefix = temp_prefix(name);
    if let Ok(entries) = std::fs::read_dir(shm_dir) {
        for entry in entries.flatten() {
            if entry.file_name().to_str().is_some_and(|n| n.starts_with(&prefix)) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Remove segment `name` and its lock file; a missing file is not an error.
pub fn remove(shm_dir: &Path, name: &str) -> io::Result<()> {
    check_name(name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    for path in [shm_dir.join(name), shm_dir.join(format!("{name}.lock"))] {
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

/// Fail unless `needed` bytes fit in `available`.
pub fn check_fits(needed: u64, available: u64, dir: &Path) -> Result<(), IpcError> {
    if needed > available {
        return Err(IpcError::NoSpace { dir: dir.to_path_buf(), needed, available });
    }
    Ok(())
}

/// Bytes an unprivileged process may still allocate in `dir`'s filesystem.
fn free_space(dir: &Path) -> Result<u64, IpcError> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(|e| IpcError::Io { path: dir.to_path_buf(), source: e.into() })?;
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// What kind of memory a segment directory's files are made of, which
/// decides the page size their mappings can have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backing {
    /// A hugetlbfs mount: every page is a huge page of `page` bytes (2 MiB,
    /// or 1 GiB with `-o pagesize=1G`), taken from the pool that
    /// `vm.nr_hugepages` reserves. Files are sized in whole pages and cannot
    /// be written with write(2), only through a shared mapping.
    HugeTlb { page: usize },
    /// Anything else: a tmpfs (`/dev/shm`), whose pages are 2 MiB transparent
    /// huge pages only where the mount or `shmem_enabled` asks for them (see
    /// [`thp_hint`]), or a plain directory. Files are sized in base pages.
    Pages,
}

impl Backing {
    /// The backing of the filesystem holding `dir`, which must exist.
    pub fn of(dir: &Path) -> Result<Backing, IpcError> {
        let st = nix::sys::statfs::statfs(dir).map_err(|e| IpcError::Io { path: dir.to_path_buf(), source: e.into() })?;
        if st.filesystem_type() == nix::sys::statfs::HUGETLBFS_MAGIC {
            // A hugetlbfs reports its page size as the block size.
            return Ok(Backing::HugeTlb { page: st.block_size() as usize });
        }
        Ok(Backing::Pages)
    }

    /// The page size of the files' memory (the base page for [`Backing::Pages`]).
    pub fn page(&self) -> usize {
        match self {
            Backing::HugeTlb { page } => *page,
            Backing::Pages => PAGE,
        }
    }

    /// The length of a file that holds `len` bytes: `len` itself, except on
    /// a hugetlbfs, which rounds it up to whole huge pages.
    pub fn segment_len(&self, len: usize) -> usize {
        match self {
            Backing::HugeTlb { page } => align_up(len, *page),
            Backing::Pages => len,
        }
    }
}

/// The sysfs directory of the huge-page pool of `page`-byte pages.
fn hugepage_pool_dir(page: usize) -> PathBuf {
    PathBuf::from(format!("/sys/kernel/mm/hugepages/hugepages-{}kB", page / 1024))
}

/// The pool of `page`-byte huge pages: (pages reserved in all, pages free
/// for a new file). Pages that another hugetlbfs file or mapping reserved
/// but has not touched yet count as free in `free_hugepages`, so they are
/// taken off.
pub fn hugepage_pool(page: usize) -> Result<(u64, u64), IpcError> {
    let dir = hugepage_pool_dir(page);
    let read = |name: &str| -> Result<u64, IpcError> {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
        text.trim().parse().map_err(|_| IpcError::Io { path, source: io::Error::new(io::ErrorKind::InvalidData, format!("not a number: {text:?}")) })
    };
    let (total, free, reserved) = (read("nr_hugepages")?, read("free_hugepages")?, read("resv_hugepages")?);
    Ok((total, free.saturating_sub(reserved)))
}

/// The message for a hugetlbfs segment that does not fit in the free huge
/// pages: how many it needs, how many are free, and the `sysctl` that
/// reserves enough (the pool's total grown by what is missing).
pub fn hugepage_shortage(dir: &Path, name: &str, page: usize, needed: u64, free: u64, total: u64) -> String {
    let size = human(page as u64).replace(".0 ", " ");
    let target = total + needed.saturating_sub(free);
    let sysctl = if page == 2 << 20 { format!("sysctl vm.nr_hugepages={target}") } else { format!("echo {target} > {}/nr_hugepages", hugepage_pool_dir(page).display()) };
    format!(
        "the segment {name} on the hugetlbfs {} needs {} free {size} pages, {} are free (of {} reserved): as root, `{sysctl}`, or put the segments on a tmpfs (--shm-dir /dev/shm)",
        dir.display(),
        thousands(needed),
        thousands(free),
        thousands(total),
    )
}

/// `2612` as `2,612`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Fail unless the huge-page pool has `len` bytes of free `page`-byte pages.
fn check_hugepages(dir: &Path, name: &str, page: usize, len: u64) -> Result<(), IpcError> {
    let needed = len.div_ceil(page as u64);
    let (total, free) = hugepage_pool(page)?;
    if needed > free {
        return Err(IpcError::NoHugePages { message: hugepage_shortage(dir, name, page, needed, free, total) });
    }
    Ok(())
}

/// A new temp file in `shm_dir` holding `len` reserved (zeroed) bytes, to be
/// filled and then renamed over `<shm_dir>/<name>` with `persist`. Dropped
/// unpersisted, it is deleted. On a hugetlbfs `len` must be whole huge pages
/// ([`Backing::segment_len`]).
pub fn create_reserved(shm_dir: &Path, name: &str, len: u64) -> Result<tempfile::NamedTempFile, IpcError> {
    create_reserved_placed(shm_dir, name, len, |_| {})
}

/// [`create_reserved`], calling `place` on the sized but not yet reserved
/// file: a tmpfs allocates pages on the reservation, so a memory policy set
/// on the file must be set before it (see `numa`).
///
/// The reservation is also where a tmpfs decides the pages' size: they are
/// 2 MiB transparent huge pages when the mount has `huge=always` or
/// `huge=within_size`, or `/sys/kernel/mm/transparent_hugepage/shmem_enabled`
/// is `always`, `within_size` or `force`, and 4 KiB otherwise. `advise`
/// (mount or sysfs) does not give huge pages here: it asks for a mapping
/// with `MADV_HUGEPAGE`, and fallocate allocates without one.
pub fn create_reserved_placed(shm_dir: &Path, name: &str, len: u64, place: impl FnOnce(&File)) -> Result<tempfile::NamedTempFile, IpcError> {
    std::fs::create_dir_all(shm_dir).map_err(io_err(shm_dir))?;
    let backing = Backing::of(shm_dir)?;
    if let Backing::HugeTlb { page } = backing {
        if !len.is_multiple_of(page as u64) {
            return Err(IpcError::Io {
                path: shm_dir.to_path_buf(),
                source: io::Error::new(io::ErrorKind::InvalidInput, format!("a hugetlbfs file must be whole {} pages, not {len} bytes", human(page as u64))),
            });
        }
        // Free huge pages are the limit; a mount without `size=` reports no
        // blocks at all, one with it reports its own limit as well.
        check_hugepages(shm_dir, name, page, len)?;
        if nix::sys::statvfs::statvfs(shm_dir).is_ok_and(|st| st.blocks() > 0) {
            check_fits(len, free_space(shm_dir)?, shm_dir)?;
        }
    } else {
        check_fits(len, free_space(shm_dir)?, shm_dir)?;
    }
    let temp = tempfile::Builder::new().prefix(&temp_prefix(name)).tempfile_in(shm_dir).map_err(io_err(shm_dir))?;
    // Sizing a tmpfs file allocates nothing; it lets `place` map the ranges.
    temp.as_file().set_len(len).map_err(io_err(temp.path()))?;
    place(temp.as_file());
    // Reserve every block now: on a tmpfs that is too small, or a hugetlbfs
    // short of huge pages, writing through a mapping would otherwise die of
    // SIGBUS at some later page. A hugetlbfs fallocate takes its pages from
    // the pool, so a pool emptied by someone else since the check above is
    // an ENOSPC here, not a SIGBUS later.
    let off_len = i64::try_from(len).map_err(|_| IpcError::NoSpace { dir: shm_dir.to_path_buf(), needed: len, available: 0 })?;
    match nix::fcntl::posix_fallocate(temp.as_file(), 0, off_len) {
        Ok(()) => {}
        Err(Errno::ENOSPC) => {
            if let Backing::HugeTlb { page } = backing {
                let (total, free) = hugepage_pool(page)?;
                return Err(IpcError::NoHugePages { message: hugepage_shortage(shm_dir, name, page, len.div_ceil(page as u64), free, total) });
            }
            return Err(IpcError::NoSpace { dir: shm_dir.to_path_buf(), needed: len, available: free_space(shm_dir).unwrap_or(0) });
        }
        // A filesystem without fallocate (not a tmpfs, which has it): fall
        // back to a sparse file, whose space was checked above.
        Err(Errno::EOPNOTSUPP | Errno::EINVAL) => temp.as_file().set_len(len).map_err(io_err(temp.path()))?,
        Err(e) => return Err(IpcError::Io { path: temp.path().to_path_buf(), source: e.into() }),
    }
    Ok(temp)
}

/// A writable shared mapping of all of `file` (of `len` bytes).
pub fn map_for_filling(file: &File, path: &Path, len: usize) -> Result<memmap2::MmapMut, IpcError> {
    // SAFETY: the file is a temp file only this process has opened; its
    // pages are reserved, so no store into the mapping can fault for space.
    unsafe { memmap2::MmapOptions::new().len(len).map_mut(file) }.map_err(io_err(path))
}

/// How a new segment's bytes get into its reserved file.
pub enum Filler<'a> {
    /// write(2) at offsets. On a tmpfs of 4 KiB pages it is about three
    /// times as fast as storing through a mapping, where every page written
    /// takes a fault (5.0 against 1.6 GB/s on this machine, README "Huge
    /// pages for the weight segment").
    Write { file: &'a File, path: &'a Path },
    /// Stores through a shared mapping: the only way into a hugetlbfs file
    /// (write(2) is EINVAL there), with one fault per huge page.
    Mapping { map: memmap2::MmapMut, path: &'a Path },
}

impl<'a> Filler<'a> {
    /// The filler for a file of `len` bytes laid out for `backing`.
    pub fn new(file: &'a File, path: &'a Path, len: usize, backing: Backing) -> Result<Filler<'a>, IpcError> {
        Ok(match backing {
            Backing::HugeTlb { .. } => Filler::Mapping { map: map_for_filling(file, path, len)?, path },
            Backing::Pages => Filler::Write { file, path },
        })
    }

    /// Write `bytes` at offset `at`, which the file's length covers.
    pub fn write(&mut self, bytes: &[u8], at: usize) -> Result<(), IpcError> {
        match self {
            Filler::Write { file, path } => std::os::unix::fs::FileExt::write_all_at(*file, bytes, at as u64).map_err(io_err(path)),
            Filler::Mapping { map, path } => {
                let dst = map.get_mut(at..at + bytes.len()).ok_or_else(|| IpcError::Io {
                    path: path.to_path_buf(),
                    source: io::Error::new(io::ErrorKind::InvalidInput, format!("{} bytes at {at} do not fit the segment", bytes.len())),
                })?;
                dst.copy_from_slice(bytes);
                Ok(())
            }
        }
    }
}

/// Ask for a tmpfs mapping's transparent huge pages to be mapped whole, one
/// page-middle-directory entry each rather than 512 page-table entries.
/// Advice only, ignored where it fails: where the pages are 4 KiB it
/// changes nothing, and a hugetlbfs mapping (which refuses the advice) is
/// always mapped in huge pages.
pub fn advise_huge(map: &memmap2::Mmap, dir: &Path) {
    if !matches!(Backing::of(dir), Ok(Backing::HugeTlb { .. })) {
        let _ = map.advise(memmap2::Advice::HugePage);
    }
}

/// A scratch file of a segment's kind: `len` bytes (rounded up to whole
/// pages) in `dir`, reserved, sized and filled the way the weight segment
/// is, so huge pages where `dir` gives them; deleted when dropped. For
/// benchmarks that stream weights from the memory a segment would be in.
pub struct ScratchSegment {
    map: memmap2::Mmap,
    temp: tempfile::NamedTempFile,
}

impl ScratchSegment {
    /// Create it in `dir` and fill it with `fill` (called on the whole
    /// writable mapping), then map it read-only as a worker would.
    pub fn create(dir: &Path, len: usize, fill: impl FnOnce(&mut [u8])) -> Result<ScratchSegment, IpcError> {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
        let len = Backing::of(dir)?.segment_len(len.max(1));
        let temp = create_reserved(dir, "scratch", len as u64)?;
        let mut writable = map_for_filling(temp.as_file(), temp.path(), len)?;
        fill(&mut writable);
        drop(writable);
        // SAFETY: the temp file is this process's alone and is not written again.
        let map = unsafe { memmap2::Mmap::map(temp.as_file()) }.map_err(io_err(temp.path()))?;
        advise_huge(&map, dir);
        Ok(ScratchSegment { map, temp })
    }

    pub fn path(&self) -> &Path {
        self.temp.path()
    }
}

impl std::ops::Deref for ScratchSegment {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map
    }
}

/// Why the segments in `dir` do or do not get transparent huge pages: the
/// tmpfs mount's `huge=` option and the system's `shmem_enabled`, for a
/// log line next to the measured fraction ([`crate::huge_page_mapping`]).
pub fn thp_hint(dir: &Path) -> String {
    if let Ok(Backing::HugeTlb { page }) = Backing::of(dir) {
        return format!("{} is a hugetlbfs of {} pages", dir.display(), human(page as u64));
    }
    let sysfs = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
    let enabled = std::fs::read_to_string(sysfs).ok().and_then(|t| selected_option(&t)).unwrap_or_else(|| "unknown".into());
    let mount = mount_huge_option(dir).unwrap_or_else(|| "not a tmpfs, or no huge= option".into());
    format!("{} mount huge={mount}, shmem_enabled={enabled}", dir.display())
}

/// The `[selected]` word of a sysfs choice list: `always [never] deny` → `never`.
fn selected_option(text: &str) -> Option<String> {
    text.split_whitespace().find_map(|w| w.strip_prefix('[')?.strip_suffix(']').map(str::to_string))
}

/// The `huge=` option of the tmpfs mount holding `dir`, from
/// `/proc/self/mountinfo` (the mount with the longest matching mount
/// point); `never` for a tmpfs without one, `None` for another filesystem.
fn mount_huge_option(dir: &Path) -> Option<String> {
    let dir = std::fs::canonicalize(dir).ok()?;
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let mut best: Option<(usize, String, String)> = None;
    for line in info.lines() {
        // "id parent major:minor root mount-point options ... - fstype source super-options"
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else { continue };
        let (Some(point), Some(fstype), Some(options)) = (fields.get(4), fields.get(dash + 1), fields.get(dash + 3)) else { continue };
        let point = point.replace("\\040", " ");
        if dir.starts_with(&point) && best.as_ref().is_none_or(|(len, ..)| point.len() >= *len) {
            best = Some((point.len(), fstype.to_string(), options.to_string()));
        }
    }
    let (_, fstype, options) = best?;
    (fstype == "tmpfs").then(|| options.split(',').find_map(|o| o.strip_prefix("huge=")).unwrap_or("never").to_string())
}

/// Little-endian header fields; `None` when the buffer is too short.
pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at.checked_add(4)?)?.try_into().ok()?))
}

pub fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at.checked_add(8)?)?.try_into().ok()?))
}

/// Human-readable size for error messages.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_fits_explains_the_fix() {
        check_fits(1 << 20, 2 << 20, Path::new("/dev/shm")).unwrap();
        let err = check_fits(3 << 30, 64 << 20, Path::new("/dev/shm")).unwrap_err();
        assert!(matches!(err, IpcError::NoSpace { needed, available, .. } if needed == 3 << 30 && available == 64 << 20));
        let msg = err.to_string();
        assert!(msg.contains("--shm-size") && msg.contains("/dev/shm") && msg.contains("3.0 GiB") && msg.contains("64.0 MiB"), "{msg}");
    }

    #[test]
    fn names_are_plain_files() {
        for bad in ["", "a/b", ".hidden", "..", "x\0y"] {
            assert!(matches!(check_name(bad), Err(IpcError::BadName { .. })), "{bad:?}");
        }
        check_name("duplex-weights").unwrap();
    }

    #[test]
    fn hugepage_shortage_says_how_many_and_the_fix() {
        let msg = hugepage_shortage(Path::new("/mnt/huge"), "duplex-weights", 2 << 20, 2612, 1024, 1100);
        assert!(msg.starts_with("the segment duplex-weights on the hugetlbfs /mnt/huge needs"), "{msg}");
        assert!(msg.contains("needs 2,612 free 2 MiB pages, 1,024 are free (of 1,100 reserved)"), "{msg}");
        assert!(msg.contains("`sysctl vm.nr_hugepages=2688`") && msg.contains("/mnt/huge"), "{msg}");
        // 1 GiB pages have no sysctl of their own.
        let msg = hugepage_shortage(Path::new("/mnt/huge1g"), "duplex-kv", 1 << 30, 6, 0, 0);
        assert!(msg.contains("needs 6 free 1 GiB pages, 0 are free"), "{msg}");
        assert!(msg.contains("echo 6 > /sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages"), "{msg}");
        assert_eq!(thousands(0), "0");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1234567), "1,234,567");
    }

    #[test]
    fn plain_directories_and_tmpfs_are_base_pages() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Backing::of(dir.path()).unwrap(), Backing::Pages);
        assert_eq!(Backing::of(Path::new("/dev/shm")).unwrap(), Backing::Pages);
        assert_eq!(Backing::Pages.segment_len(4097), 4097, "a tmpfs file has any length");
        assert_eq!(Backing::HugeTlb { page: 2 << 20 }.segment_len((2 << 20) + 1), 4 << 20);
        assert_eq!(Backing::HugeTlb { page: 2 << 20 }.segment_len(4 << 20), 4 << 20);
        assert!(matches!(Backing::of(&dir.path().join("missing")), Err(IpcError::Io { .. })));
    }

    #[test]
    fn sysfs_choices_and_mount_options_are_read() {
        assert_eq!(selected_option("always within_size advise [never] deny force\n").as_deref(), Some("never"));
        assert_eq!(selected_option("always [madvise] never").as_deref(), Some("madvise"));
        assert_eq!(selected_option("nothing selected"), None);
        // /dev/shm is a tmpfs on Linux; whatever its huge= is, it is named.
        let hint = thp_hint(Path::new("/dev/shm"));
        assert!(hint.starts_with("/dev/shm mount huge=") && hint.contains("shmem_enabled="), "{hint}");
        assert!(!hint.contains("not a tmpfs"), "{hint}");
    }

    #[test]
    fn header_fields_never_read_out_of_bounds() {
        assert_eq!(u32_at(&[1, 0, 0, 0], 0), Some(1));
        assert_eq!(u32_at(&[1, 0, 0], 0), None);
        assert_eq!(u64_at(&[0; 8], 1), None);
        assert_eq!(u64_at(&[], usize::MAX - 2), None);
    }
}

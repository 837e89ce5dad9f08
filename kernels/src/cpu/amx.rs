//! AMX tiles: detection, the tile state's permission from Linux, and the
//! tile instructions behind one small trait with two implementations.
//!
//! An AMX CPU (Intel Sapphire Rapids and later) has eight tile registers of
//! up to 16 rows × 64 bytes and a unit that multiplies them (`tdpbssd`:
//! signed bytes, i32 sums). Linux hands the 8 KiB of tile state to a
//! process only when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM,
//! XFEATURE_XTILEDATA)`; the permission is process-wide), and a tile
//! instruction without it is a SIGILL, so [`HardwareTiles::new`] gives a
//! handle only after both the CPU and the kernel have said yes.
//!
//! [`ModelTiles`] carries out the same instructions in plain Rust, as the
//! Intel SDM's pseudocode defines them, on any CPU. A kernel written over
//! [`Tiles`] runs unchanged on either, so its tiling, packing and folding
//! are tested everywhere against the scalar references, and on an AMX
//! machine the hardware is checked against the model (see
//! `quant::tiles_amx`'s self-check, which turns the tiles off when they
//! disagree). The INT8 product sums integers, exactly, so a tile kernel
//! keeps the AVX-512 kernels' bits. The BF16 product (`tdpbf16ps`) rounds
//! its f32 sums in an order of the hardware's own: the model follows the
//! SDM's pseudocode, and the hardware is held to it within f32 rounding
//! of the sums, not bit for bit (see `cpu::pairs_amx`).

use std::sync::OnceLock;

/// Rows of a tile register at most.
pub const MAX_ROWS: usize = 16;
/// Bytes of a tile row at most.
pub const MAX_COLSB: usize = 64;
/// Tile registers.
pub const TILES: usize = 8;

/// A tile configuration (`ldtilecfg`'s 64-byte operand, palette 1): each
/// register's rows and bytes per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C, align(64))]
pub struct TileConfig {
    bytes: [u8; 64],
}

impl Default for TileConfig {
    fn default() -> Self {
        Self::new()
    }
}

impl TileConfig {
    /// Palette 1 with every register unused (zero rows).
    pub const fn new() -> TileConfig {
        let mut bytes = [0u8; 64];
        bytes[0] = 1;
        TileConfig { bytes }
    }

    /// Register `t` as `rows` rows of `colsb` bytes.
    pub fn with(mut self, t: u8, rows: usize, colsb: usize) -> TileConfig {
        assert!((t as usize) < TILES, "tile register {t} of {TILES}");
        assert!((1..=MAX_ROWS).contains(&rows) && (4..=MAX_COLSB).contains(&colsb) && colsb.is_multiple_of(4), "tile of {rows} rows × {colsb} bytes");
        let t = t as usize;
        self.bytes[16 + 2 * t..18 + 2 * t].copy_from_slice(&(colsb as u16).to_le_bytes());
        self.bytes[48 + t] = rows as u8;
        self
    }

    /// Rows of register `t` (zero when unused).
    pub fn rows(&self, t: u8) -> usize {
        self.bytes[48 + t as usize] as usize
    }

    /// Bytes per row of register `t`.
    pub fn colsb(&self, t: u8) -> usize {
        u16::from_le_bytes([self.bytes[16 + 2 * t as usize], self.bytes[17 + 2 * t as usize]]) as usize
    }

    /// The bytes a load or store of register `t` touches from its first
    /// row at `stride` bytes between rows.
    #[inline(always)]
    fn span(&self, t: u8, stride: usize) -> usize {
        let rows = self.rows(t);
        assert!(rows > 0, "tile register {t} is not configured");
        assert!(stride >= self.colsb(t), "stride {stride} under the tile's {} bytes a row", self.colsb(t));
        (rows - 1) * stride + self.colsb(t)
    }

    /// Panic unless `C += A · B` fits the shapes (where the hardware
    /// would raise #UD): A is M × K bytes, B is K/4 × 4N, C is M × 4N
    /// (for `tdpbssd` and `tdpbf16ps` alike).
    #[inline(always)]
    fn check_product(&self, c: u8, a: u8, b: u8) {
        assert!(c != a && c != b && a != b, "a tile product needs three different tiles");
        let (m, k, n4) = (self.rows(c), self.colsb(a), self.colsb(c));
        assert!(m > 0 && self.rows(a) == m && self.rows(b) == k / 4 && self.colsb(b) == n4, "tile product shapes: C {m}×{n4}, A {}×{k}, B {}×{}", self.rows(a), self.rows(b), self.colsb(b));
    }
}

/// The tile instructions a kernel uses. Loads and stores take slices and
/// check them against the configuration (so a kernel's mistake is a panic,
/// not a stray access); tile numbers are constants, as the instructions
/// encode them.
pub trait Tiles {
    /// `ldtilecfg`: shape every register (and zero them all).
    fn configure(&mut self, config: &TileConfig);
    /// `tilezero`.
    fn zero<const T: u8>(&mut self);
    /// `tileloadd`: row r from `src[r · stride..]`.
    fn load<const T: u8>(&mut self, src: &[u8], stride: usize);
    /// `tdpbssd`: `C[m][n] += Σ_k A[m][4k..4k+4] · B[k][4n..4n+4]`, signed
    /// bytes, i32 sums (wrapping, as the hardware's).
    fn dot_i8<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `tdpbf16ps`: `C[m][n] += Σ_k A[m][k] ⊙ B[k][n]` for pairs of BF16
    /// values (four bytes, the first in the low half) and f32 `C`, where
    /// ⊙ adds a pair's two products.
    fn dot_bf16<const C: u8, const A: u8, const B: u8>(&mut self);
    /// `tilestored`: row r to `dst[r · stride..]`.
    fn store<const T: u8>(&mut self, dst: &mut [u8], stride: usize);
    /// `tilerelease`: give the tile state back (the kernel then saves
    /// 8 KiB less at every context switch).
    fn release(&mut self);
}

/// The tile instructions in plain Rust, after the Intel SDM's pseudocode.
pub struct ModelTiles {
    config: TileConfig,
    regs: [[[u8; MAX_COLSB]; MAX_ROWS]; TILES],
}

impl Default for ModelTiles {
    fn default() -> Self {
        ModelTiles { config: TileConfig::new(), regs: [[[0; MAX_COLSB]; MAX_ROWS]; TILES] }
    }
}

impl ModelTiles {
    /// Row `r` of register `t` as it stands (for tests).
    pub fn row(&self, t: u8, r: usize) -> &[u8; MAX_COLSB] {
        &self.regs[t as usize][r]
    }
}

impl Tiles for ModelTiles {
    fn configure(&mut self, config: &TileConfig) {
        self.config = *config;
        self.regs = [[[0; MAX_COLSB]; MAX_ROWS]; TILES];
    }

    fn zero<const T: u8>(&mut self) {
        self.regs[T as usize] = [[0; MAX_COLSB]; MAX_ROWS];
    }

    fn load<const T: u8>(&mut self, src: &[u8], stride: usize) {
        let span = self.config.span(T, stride);
        assert!(span <= src.len(), "tile load of {span} bytes from {}", src.len());
        let (rows, colsb) = (self.config.rows(T), self.config.colsb(T));
        let reg = &mut self.regs[T as usize];
        *reg = [[0; MAX_COLSB]; MAX_ROWS];
        for (r, row) in reg.iter_mut().enumerate().take(rows) {
            row[..colsb].copy_from_slice(&src[r * stride..r * stride + colsb]);
        }
    }

    fn dot_i8<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.config.check_product(C, A, B);
        let (m_rows, k4, n4) = (self.config.rows(C), self.config.colsb(A) / 4, self.config.colsb(C) / 4);
        let (a, b) = (self.regs[A as usize], self.regs[B as usize]);
        let c = &mut self.regs[C as usize];
        for m in 0..m_rows {
            for n in 0..n4 {
                let mut sum = i32::from_le_bytes(c[m][4 * n..4 * n + 4].try_into().unwrap());
                for k in 0..k4 {
                    let dp: i32 = (0..4).map(|j| (a[m][4 * k + j] as i8) as i32 * (b[k][4 * n + j] as i8) as i32).sum();
                    sum = sum.wrapping_add(dp);
                }
                c[m][4 * n..4 * n + 4].copy_from_slice(&sum.to_le_bytes());
            }
            c[m][4 * n4..].fill(0);
        }
        for row in &mut c[m_rows..] {
            row.fill(0);
        }
    }

    /// As the SDM defines it: each product of the pair's even elements,
    /// then of its odd ones, added to the f32 sum in turn (round to nearest
    /// even), with BF16 inputs and f32 results that are subnormal taken as
    /// zero.
    fn dot_bf16<const C: u8, const A: u8, const B: u8>(&mut self) {
        self.config.check_product(C, A, B);
        let (m_rows, k4, n4) = (self.config.rows(C), self.config.colsb(A) / 4, self.config.colsb(C) / 4);
        let (a, b) = (self.regs[A as usize], self.regs[B as usize]);
        let c = &mut self.regs[C as usize];
        let bf16 = |row: &[u8; MAX_COLSB], i: usize| {
            let x = f32::from_bits((u16::from_le_bytes([row[2 * i], row[2 * i + 1]]) as u32) << 16);
            if x.is_subnormal() { 0.0 } else { x }
        };
        let flush = |x: f32| if x.is_subnormal() { 0.0f32.copysign(x) } else { x };
        for m in 0..m_rows {
            for n in 0..n4 {
                let mut sum = f32::from_le_bytes(c[m][4 * n..4 * n + 4].try_into().unwrap());
                for (k, b_row) in b.iter().enumerate().take(k4) {
                    sum = flush(sum + bf16(&a[m], 2 * k) * bf16(b_row, 2 * n));
                    sum = flush(sum + bf16(&a[m], 2 * k + 1) * bf16(b_row, 2 * n + 1));
                }
                c[m][4 * n..4 * n + 4].copy_from_slice(&sum.to_le_bytes());
            }
            c[m][4 * n4..].fill(0);
        }
        for row in &mut c[m_rows..] {
            row.fill(0);
        }
    }

    fn store<const T: u8>(&mut self, dst: &mut [u8], stride: usize) {
        let span = self.config.span(T, stride);
        assert!(span <= dst.len(), "tile store of {span} bytes into {}", dst.len());
        let (rows, colsb) = (self.config.rows(T), self.config.colsb(T));
        for (r, row) in self.regs[T as usize].iter().enumerate().take(rows) {
            dst[r * stride..r * stride + colsb].copy_from_slice(&row[..colsb]);
        }
    }

    fn release(&mut self) {
        *self = ModelTiles::default();
    }
}

/// Whether a tile kernel may run on the CPU's tiles: `DUPLEX_AMX` does not
/// turn them off, `unit` gives a tile unit (only then is Linux asked for
/// the tile state), and `check` passes on it. A failed check is said on
/// stderr (`turned_off_message` names the kernel and what runs instead). Each
/// kernel asks once per process and keeps the answer.
#[cfg(target_arch = "x86_64")]
pub fn checked_tiles(unit: impl FnOnce() -> Option<HardwareTiles>, check: impl FnOnce(&mut HardwareTiles) -> Result<(), String>, turned_off_message: &str) -> bool {
    if turned_off(std::env::var("DUPLEX_AMX").ok().as_deref()) {
        return false;
    }
    let Some(mut hw) = unit() else { return false };
    match check(&mut hw) {
        Ok(()) => true,
        Err(why) => {
            eprintln!("duplex: {turned_off_message}: {why}");
            false
        }
    }
}

/// Whether a `DUPLEX_AMX` value turns the tiles off: `off`, `0`, `false`
/// or `no`, in any case; anything else (or nothing) leaves them on.
fn turned_off(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "off" | "0" | "false" | "no"))
}

/// CPUID.(7, 0).EDX's bit for AMX-INT8 (`tdpbssd`).
const AMX_INT8: u32 = 1 << 25;
/// CPUID.(7, 0).EDX's bit for AMX-BF16 (`tdpbf16ps`).
const AMX_BF16: u32 = 1 << 22;

/// Whether this CPU has INT8 tiles and Linux lets this process use them:
/// CPUID's AMX-TILE and AMX-INT8, the OS's XSAVE of the tile state (XCR0
/// bits 17 and 18), and the permission granted. Asked once per process.
pub fn int8_tiles_permitted() -> bool {
    static PERMITTED: OnceLock<bool> = OnceLock::new();
    *PERMITTED.get_or_init(|| probe(AMX_INT8))
}

/// [`int8_tiles_permitted`] for the BF16 tile product (AMX-BF16).
pub fn bf16_tiles_permitted() -> bool {
    static PERMITTED: OnceLock<bool> = OnceLock::new();
    *PERMITTED.get_or_init(|| probe(AMX_BF16))
}

/// Whether the CPU has the tiles and the `product` feature bit, the OS
/// saves the tile state, and Linux grants the permission (asking is
/// idempotent: the permission is the process's).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn probe(product: u32) -> bool {
    use std::arch::x86_64::__cpuid_count;
    // Leaf 7 is read only when the maximum leaf includes it.
    let max_leaf = __cpuid_count(0, 0).eax;
    let osxsave = __cpuid_count(1, 0).ecx & (1 << 27) != 0;
    let edx7 = if max_leaf >= 7 { __cpuid_count(7, 0).edx } else { 0 };
    const AMX_TILE: u32 = 1 << 24;
    if max_leaf < 7 || !osxsave || edx7 & (AMX_TILE | product) != AMX_TILE | product {
        return false;
    }
    // SAFETY: OSXSAVE (checked) means XGETBV is enabled.
    let xcr0 = unsafe { xcr0() };
    const XTILECFG_XTILEDATA: u64 = (1 << 17) | (1 << 18);
    if xcr0 & XTILECFG_XTILEDATA != XTILECFG_XTILEDATA {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's
    // permitted XSAVE features; it fails (non-zero) where it cannot, among
    // others where a thread's signal stack is too small for the larger
    // signal frames, and the tiles then stay off.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    std::arch::x86_64::_xgetbv(0)
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn probe(_: u32) -> bool {
    false
}

/// The CPU's tile unit. Only [`HardwareTiles::new`] and
/// [`HardwareTiles::for_bf16`] make one, and only where the tiles and
/// their product are permitted, so its instructions cannot fault for want
/// of the feature (the other product is asserted before use); every load,
/// store and product is checked against the configuration first, as
/// [`ModelTiles`] checks them.
#[cfg(target_arch = "x86_64")]
pub struct HardwareTiles {
    config: TileConfig,
    int8: bool,
    bf16: bool,
}

#[cfg(target_arch = "x86_64")]
impl HardwareTiles {
    /// The tile unit with its INT8 product, if this process may use it.
    pub fn new() -> Option<HardwareTiles> {
        int8_tiles_permitted().then(|| HardwareTiles { config: TileConfig::new(), int8: true, bf16: bf16_tiles_permitted() })
    }

    /// The tile unit with its BF16 product, if this process may use it.
    pub fn for_bf16() -> Option<HardwareTiles> {
        bf16_tiles_permitted().then(|| HardwareTiles { config: TileConfig::new(), int8: int8_tiles_permitted(), bf16: true })
    }
}

#[cfg(target_arch = "x86_64")]
impl Tiles for HardwareTiles {
    #[inline(always)]
    fn configure(&mut self, config: &TileConfig) {
        self.config = *config;
        // SAFETY: the tile state is permitted (constructor); the 64 bytes
        // are a valid palette-1 configuration (`TileConfig::with` checks
        // each register's shape).
        unsafe { std::arch::asm!("ldtilecfg [{}]", in(reg) self.config.bytes.as_ptr(), options(nostack, readonly)) }
    }

    #[inline(always)]
    fn zero<const T: u8>(&mut self) {
        assert!(self.config.rows(T) > 0, "tile register {T} is not configured");
        // SAFETY: a configured register of a permitted tile unit.
        unsafe { std::arch::asm!("tilezero tmm{t}", t = const T, options(nomem, nostack)) }
    }

    #[inline(always)]
    fn load<const T: u8>(&mut self, src: &[u8], stride: usize) {
        let span = self.config.span(T, stride);
        assert!(span <= src.len(), "tile load of {span} bytes from {}", src.len());
        // SAFETY: the rows read lie inside `src` (checked above).
        unsafe {
            std::arch::asm!("tileloadd tmm{t}, [{p} + {s}*1]", t = const T, p = in(reg) src.as_ptr(), s = in(reg) stride, options(nostack, readonly))
        }
    }

    #[inline(always)]
    fn dot_i8<const C: u8, const A: u8, const B: u8>(&mut self) {
        assert!(self.int8, "this CPU has no INT8 tile product");
        self.config.check_product(C, A, B);
        // SAFETY: the product exists and the shapes agree (both checked
        // above), so it cannot raise #UD.
        unsafe { std::arch::asm!("tdpbssd tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B, options(nomem, nostack)) }
    }

    #[inline(always)]
    fn dot_bf16<const C: u8, const A: u8, const B: u8>(&mut self) {
        assert!(self.bf16, "this CPU has no BF16 tile product");
        self.config.check_product(C, A, B);
        // SAFETY: as `dot_i8`'s.
        unsafe { std::arch::asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B, options(nomem, nostack)) }
    }

    #[inline(always)]
    fn store<const T: u8>(&mut self, dst: &mut [u8], stride: usize) {
        let span = self.config.span(T, stride);
        assert!(span <= dst.len(), "tile store of {span} bytes into {}", dst.len());
        // SAFETY: the rows written lie inside `dst` (checked above).
        unsafe {
            std::arch::asm!("tilestored [{p} + {s}*1], tmm{t}", t = const T, p = in(reg) dst.as_mut_ptr(), s = in(reg) stride, options(nostack))
        }
    }

    #[inline(always)]
    fn release(&mut self) {
        self.config = TileConfig::new();
        // SAFETY: a permitted tile unit; releasing unconfigured tiles is allowed.
        unsafe { std::arch::asm!("tilerelease", options(nomem, nostack)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic byte stream (xorshift), every value of a byte.
    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 24) as u8
            })
            .collect()
    }

    /// The product a tile kernel relies on, against a plain matrix product:
    /// B is stored as the hardware wants it, four consecutive K elements of
    /// column n at bytes 4n..4n+4 of row k/4.
    fn product_matches_a_matrix_product<T: Tiles>(tiles: &mut T, m: usize, k: usize, n: usize) {
        let config = TileConfig::new().with(0, m, 4 * n).with(1, m, k).with(2, k / 4, 4 * n);
        tiles.configure(&config);
        let (a, b, c0) = (bytes(1, m * k), bytes(2, k * n), bytes(3, m * 4 * n));
        // Rows of A and C sit at a wider stride than their width.
        let stride = 64 + 8;
        let mut a_mem = vec![0u8; m * stride];
        let mut c_mem = vec![0u8; m * stride];
        for r in 0..m {
            a_mem[r * stride..r * stride + k].copy_from_slice(&a[r * k..(r + 1) * k]);
            c_mem[r * stride..r * stride + 4 * n].copy_from_slice(&c0[r * 4 * n..(r + 1) * 4 * n]);
        }
        tiles.load::<0>(&c_mem, stride);
        tiles.load::<1>(&a_mem, stride);
        tiles.load::<2>(&b, 4 * n);
        tiles.dot_i8::<0, 1, 2>();
        let mut out = vec![0xAAu8; m * stride];
        tiles.store::<0>(&mut out, stride);
        tiles.release();
        for r in 0..m {
            for col in 0..n {
                let start = i32::from_le_bytes(c0[r * 4 * n + 4 * col..][..4].try_into().unwrap());
                let want = (0..k).fold(start, |s, e| s.wrapping_add((a[r * k + e] as i8) as i32 * (b[(e / 4) * 4 * n + 4 * col + e % 4] as i8) as i32));
                let got = i32::from_le_bytes(out[r * stride + 4 * col..][..4].try_into().unwrap());
                assert_eq!(got, want, "C[{r}][{col}] of {m}×{k}·{k}×{n}");
            }
            // The store writes the tile's bytes of a row and nothing past them.
            assert!(out[r * stride + 4 * n..(r + 1) * stride].iter().all(|&x| x == 0xAA));
        }
    }

    #[test]
    fn model_product_is_a_matrix_product() {
        for (m, k, n) in [(16, 64, 16), (16, 32, 16), (7, 12, 5), (1, 4, 1), (16, 64, 3)] {
            product_matches_a_matrix_product(&mut ModelTiles::default(), m, k, n);
        }
    }

    #[test]
    fn duplex_amx_off_turns_the_tiles_off() {
        for v in ["off", " OFF ", "0", "false", "No"] {
            assert!(turned_off(Some(v)), "{v:?}");
        }
        for v in [None, Some(""), Some("on"), Some("1")] {
            assert!(!turned_off(v), "{v:?}");
        }
    }

    #[test]
    fn model_load_zeroes_past_the_configured_shape() {
        let mut t = ModelTiles::default();
        t.configure(&TileConfig::new().with(3, 2, 8));
        t.load::<3>(&[0xFF; 100], 50);
        assert_eq!(t.row(3, 0)[..8], [0xFF; 8]);
        assert!(t.row(3, 0)[8..].iter().all(|&x| x == 0));
        assert!(t.row(3, 2).iter().all(|&x| x == 0));
    }

    #[test]
    #[should_panic(expected = "tile load of")]
    fn a_load_past_the_slice_panics() {
        let mut t = ModelTiles::default();
        t.configure(&TileConfig::new().with(0, 16, 64));
        t.load::<0>(&[0; 64 * 16 - 1], 64);
    }

    #[test]
    #[should_panic(expected = "tile product shapes")]
    fn mismatched_product_shapes_panic() {
        let mut t = ModelTiles::default();
        t.configure(&TileConfig::new().with(0, 16, 64).with(1, 16, 64).with(2, 8, 64));
        t.dot_i8::<0, 1, 2>();
    }

    /// BF16 values of both signs and many magnitudes, a few subnormal.
    fn bf16_words(seed: u64, n: usize) -> Vec<u16> {
        // The exponent's top bit clear (magnitudes under 2), three more of
        // its bits set for half of them; an exponent of zero is subnormal.
        bytes(seed, 2 * n).chunks(2).map(|b| u16::from_le_bytes([b[0], b[1] & 0xbf]) | (0x3800 * u16::from(b[0] & 1))).collect()
    }

    /// The BF16 product against exact sums of the same products, within
    /// f32 rounding of each sum (the order of the additions is the unit's
    /// own), subnormal BF16 inputs counted as zero; B as the hardware wants
    /// it, a pair of K elements of column n at bytes 4n..4n+4 of row k/2.
    fn bf16_product_sums_pairs<T: Tiles>(tiles: &mut T, m: usize, pairs: usize, n: usize) {
        tiles.configure(&TileConfig::new().with(0, m, 4 * n).with(1, m, 4 * pairs).with(2, pairs, 4 * n));
        let (a, b) = (bf16_words(4, m * 2 * pairs), bf16_words(5, pairs * 2 * n));
        let c0: Vec<f32> = (0..m * n).map(|i| i as f32 / 7.0 - 1.0).collect();
        let words = |w: &[u16]| w.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
        let floats = |f: &[f32]| f.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
        tiles.load::<0>(&floats(&c0), 4 * n);
        tiles.load::<1>(&words(&a), 4 * pairs);
        tiles.load::<2>(&words(&b), 4 * n);
        tiles.dot_bf16::<0, 1, 2>();
        let mut out = vec![0u8; m * 4 * n];
        tiles.store::<0>(&mut out, 4 * n);
        tiles.release();
        let value = |w: u16| {
            let x = f32::from_bits((w as u32) << 16) as f64;
            if w & 0x7f80 == 0 { 0.0 } else { x }
        };
        for r in 0..m {
            for col in 0..n {
                let terms = (0..2 * pairs).map(|e| value(a[r * 2 * pairs + e]) * value(b[(e / 2) * 2 * n + 2 * col + e % 2]));
                let (exact, mag) = terms.chain([c0[r * n + col] as f64]).fold((0.0, 0.0), |(s, m), x| (s + x, m + x.abs()));
                let got = f32::from_le_bytes(out[(r * n + col) * 4..][..4].try_into().unwrap()) as f64;
                assert!((got - exact).abs() <= mag * f32::EPSILON as f64 * (2 * pairs + 1) as f64, "C[{r}][{col}] of {m}×{pairs}·{pairs}×{n}: {got} vs {exact}");
            }
        }
    }

    #[test]
    fn model_bf16_product_sums_pairs() {
        for (m, pairs, n) in [(16, 16, 16), (7, 5, 3), (1, 1, 1), (16, 3, 16)] {
            bf16_product_sums_pairs(&mut ModelTiles::default(), m, pairs, n);
        }
        // Each product is added in turn, the even elements' first: 1 + 2⁻²⁴
        // rounds to 1, then −1 leaves 0 (odd first would leave 2⁻²⁴).
        let mut t = ModelTiles::default();
        t.configure(&TileConfig::new().with(0, 1, 4).with(1, 1, 4).with(2, 1, 4));
        let pair = |lo: f32, hi: f32| ((half::bf16::from_f32(hi).to_bits() as u32) << 16 | half::bf16::from_f32(lo).to_bits() as u32).to_le_bytes();
        let tiny = 2f32.powi(-12);
        t.load::<0>(&1f32.to_le_bytes(), 4);
        t.load::<1>(&pair(tiny, -1.0), 4);
        t.load::<2>(&pair(tiny, 1.0), 4);
        t.dot_bf16::<0, 1, 2>();
        assert_eq!(f32::from_le_bytes(t.row(0, 0)[..4].try_into().unwrap()), 0.0);
    }

    /// On an AMX machine the tile unit must agree with the model; elsewhere
    /// this says why it could not run (as the CUDA tests do without a GPU).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hardware_bf16_product_sums_pairs() {
        let Some(mut hw) = HardwareTiles::for_bf16() else {
            eprintln!("skipped: this CPU or kernel gives no AMX BF16 tiles (CPUID, XCR0 or arch_prctl)");
            return;
        };
        for (m, pairs, n) in [(16, 16, 16), (7, 5, 3), (1, 1, 1)] {
            bf16_product_sums_pairs(&mut hw, m, pairs, n);
        }
    }

    /// On an AMX machine the tile unit must agree with the model; elsewhere
    /// this says why it could not run (as the CUDA tests do without a GPU).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hardware_product_is_a_matrix_product() {
        let Some(mut hw) = HardwareTiles::new() else {
            eprintln!("skipped: this CPU or kernel gives no AMX INT8 tiles (CPUID, XCR0 or arch_prctl)");
            return;
        };
        for (m, k, n) in [(16, 64, 16), (16, 32, 16), (7, 12, 5), (1, 4, 1)] {
            product_matches_a_matrix_product(&mut hw, m, k, n);
        }
    }
}

//! GGUF files (llama.cpp's model format), memory-mapped.
//!
//! A GGUF file is a header (magic `GGUF`, version, tensor count, metadata
//! key/values, tensor infos), padding to `general.alignment`, then the data
//! section that every tensor's offset is relative to. Versions 2 and 3 are
//! read (they share one little-endian layout; version 1 used 32-bit counts
//! and big-endian files are refused). A model may be split over
//! `NAME-00001-of-0000N.gguf` parts: [`Gguf::open`] opens every part and
//! presents one tensor table.
//!
//! Everything in the header is untrusted: counts are checked against the
//! bytes left before anything is allocated for them, arithmetic is checked,
//! and every tensor's byte range is proven to lie inside its file and apart
//! from every other before a caller can see it. Each error names the file
//! and, where there is one, the tensor or key.
//!
//! [`vocab`] exposes the tokenizer stored in the metadata. What the tensors
//! mean for a model (llama.cpp's architecture names and layouts) is
//! `duplex-model`'s business, not this crate's.

pub mod types;
pub mod vocab;
pub mod writer;

pub use types::{GgmlType, DUPLEX_SUPPORTED};

use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const MAGIC: &[u8; 4] = b"GGUF";
/// `general.alignment` when the key is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions (`GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;
/// The longest string read from a header: far past any writer's (the
/// longest, chat templates, run to tens of KB), so that a corrupt length
/// is an error before anything is copied, whatever the system's overcommit
/// policy would let an allocation promise.
const MAX_STRING: u64 = 1 << 30;
/// Arrays nest at most this deep; deeper is refused rather than recursed
/// into, so a hostile header cannot exhaust the stack.
const MAX_NESTING: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a valid GGUF file: at byte {offset}: {message}")]
    Header { path: PathBuf, offset: u64, message: String },
    #[error("{path}: tensor {tensor}: {message}")]
    Tensor { path: PathBuf, tensor: String, message: String },
    #[error("{path}: metadata key {key}: {message}")]
    Metadata { path: PathBuf, key: String, message: String },
    #[error("{path}: split GGUF: {message}")]
    Split { path: PathBuf, message: String },
    #[error("tensor {tensor} is missing from {path}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor {tensor} has type {ty}, which Duplex does not support (supported: {})", supported_list())]
    Unsupported { path: PathBuf, tensor: String, ty: GgmlType },
    #[error("{path}: {message}")]
    Model { path: PathBuf, message: String },
}

fn supported_list() -> String {
    DUPLEX_SUPPORTED.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
}

/// The type of a metadata value (`gguf_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        use ValueType::*;
        match self {
            U8 => 0,
            I8 => 1,
            U16 => 2,
            I16 => 3,
            U32 => 4,
            I32 => 5,
            F32 => 6,
            Bool => 7,
            String => 8,
            Array => 9,
            U64 => 10,
            I64 => 11,
            F64 => 12,
        }
    }

    /// The fewest bytes a value of this type takes in the file: what bounds
    /// how many elements an array can claim.
    fn min_bytes(self) -> u64 {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// The element type and the elements (which may be arrays themselves).
    Array(ValueType, Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(..) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// An integer of any width and signedness, as `i128` (which holds them all).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// A float, or an integer read as one (converters write whole-number
    /// hyper-parameters either way).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_int().map(|i| i as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }
}

/// A metadata value set from outside the file, as llama.cpp's
/// `--override-kv KEY=TYPE:VALUE` does (TYPE: `int`, `float`, `bool` or
/// `str`): it replaces the file's value of KEY, or adds one. For what a
/// converter wrote wrong or left out (DeepSeek's YaRN betas, say).
#[derive(Clone, Debug, PartialEq)]
pub struct MetadataOverride {
    pub key: String,
    pub value: Value,
}

impl std::str::FromStr for MetadataOverride {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let bad = |why: &str| format!("{text:?} is not KEY=TYPE:VALUE (TYPE int, float, bool or str): {why}");
        let (key, typed) = text.split_once('=').ok_or_else(|| bad("no '='"))?;
        let (ty, value) = typed.split_once(':').ok_or_else(|| bad("no ':' after the type"))?;
        let key = key.trim();
        if key.is_empty() {
            return Err(bad("the key is empty"));
        }
        let value = match ty {
            "int" => Value::I64(value.parse().map_err(|_| bad(&format!("{value:?} is not an integer")))?),
            "float" => match value.parse::<f64>() {
                Ok(v) if v.is_finite() => Value::F64(v),
                _ => return Err(bad(&format!("{value:?} is not a finite number"))),
            },
            "bool" => Value::Bool(value.parse().map_err(|_| bad(&format!("{value:?} is not true or false")))?),
            "str" => Value::String(value.to_string()),
            other => return Err(bad(&format!("unknown type {other:?}"))),
        };
        Ok(MetadataOverride { key: key.to_string(), value })
    }
}

impl std::fmt::Display for MetadataOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.value {
            Value::Bool(b) => write!(f, "{}=bool:{b}", self.key),
            Value::String(s) => write!(f, "{}=str:{s}", self.key),
            v => match (v.as_int(), v.as_f64()) {
                (Some(i), _) => write!(f, "{}=int:{i}", self.key),
                (None, Some(x)) => write!(f, "{}=float:{x:?}", self.key),
                _ => write!(f, "{}={v:?}", self.key),
            },
        }
    }
}

/// One part's metadata, with typed getters whose errors name the file and key.
#[derive(Clone, Debug)]
pub struct Metadata {
    path: PathBuf,
    entries: BTreeMap<String, Value>,
}

impl Metadata {
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.get(key)
    }

    /// Set each override's key to its value, in order (a later one wins).
    pub fn apply(&mut self, overrides: &[MetadataOverride]) {
        for o in overrides {
            self.entries.insert(o.key.clone(), o.value.clone());
        }
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|k| k.as_str())
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// An error about `key`, naming this file.
    pub fn error(&self, key: &str, message: String) -> GgufError {
        GgufError::Metadata { path: self.path.clone(), key: key.into(), message }
    }

    fn typed<'a, T>(&'a self, key: &str, what: &str, f: impl FnOnce(&'a Value) -> Option<T>) -> Result<Option<T>, GgufError> {
        match self.entries.get(key) {
            None => Ok(None),
            Some(v) => f(v).map(Some).ok_or_else(|| self.error(key, format!("expected {what}, found {:?}", v.value_type()))),
        }
    }

    /// A non-negative integer that fits `usize`, if the key is present.
    pub fn usize(&self, key: &str) -> Result<Option<usize>, GgufError> {
        match self.typed(key, "an integer", |v| v.as_int())? {
            None => Ok(None),
            Some(i) => usize::try_from(i).map(Some).map_err(|_| self.error(key, format!("{i} is not a valid count"))),
        }
    }

    pub fn f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.typed(key, "a number", |v| v.as_f64())
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.typed(key, "a bool", |v| match v {
            Value::Bool(b) => Some(*b),
            _ => None,
        })
    }

    pub fn str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.typed(key, "a string", |v| v.as_str())
    }

    /// An array's elements, if the key is present.
    pub fn array(&self, key: &str) -> Result<Option<&[Value]>, GgufError> {
        self.typed(key, "an array", |v| match v {
            Value::Array(_, items) => Some(items.as_slice()),
            _ => None,
        })
    }

    /// A required key: its absence is an error naming it.
    pub fn require<T>(&self, key: &str, v: Option<T>) -> Result<T, GgufError> {
        v.ok_or_else(|| self.error(key, "missing".into()))
    }
}

/// Where one tensor lives and what it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` (ne0) is the innermost, contiguous dimension,
    /// the columns of a matrix. A Hugging Face shape is this reversed.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of its part's data section, as stored.
    pub offset: u64,
    /// Which part of a split model holds it (0 for a single file).
    pub part: usize,
    /// Absolute byte range within that part's file.
    pub start: u64,
    pub n_bytes: u64,
    pub n_elements: u64,
}

impl TensorInfo {
    /// The shape in Hugging Face (row-major, outermost first) order.
    pub fn hf_shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// One parsed GGUF file.
pub struct GgufPart {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Metadata,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    pub tensors: Vec<TensorInfo>,
    bytes: Backing,
}

/// Where a part's bytes live.
enum Backing {
    /// Shared, so that weights can stay views into it after the header is gone.
    Map(Arc<Mmap>),
    /// Bytes in memory: files built or received whole, and tests.
    Owned(Vec<u8>),
}

impl Backing {
    fn as_slice(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

impl GgufPart {
    /// Map and parse one file (no split handling).
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let io = |source| GgufError::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; like every memory-mapped model
        // loader we rely on the file not being truncated while mapped.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Backing::Map(Arc::new(map)))
    }

    /// The part's bytes as a read-only mapping that outlives this part, for
    /// views into its tensors: the file's own mapping, or for a part held in
    /// memory an anonymous mapping that copies it.
    pub fn mapping(&self) -> std::io::Result<Arc<Mmap>> {
        match &self.bytes {
            Backing::Map(m) => Ok(m.clone()),
            Backing::Owned(v) => {
                let mut anon = memmap2::MmapMut::map_anon(v.len().max(1))?;
                anon[..v.len()].copy_from_slice(v);
                Ok(Arc::new(anon.make_read_only()?))
            }
        }
    }

    /// The header's bytes (everything before the data section): what a
    /// model's identity is fingerprinted from without reading its tensors.
    pub fn header_bytes(&self) -> &[u8] {
        let all = self.bytes.as_slice();
        &all[..(self.data_start as usize).min(all.len())]
    }

    /// Parse a file already in memory; `path` names it in errors.
    pub fn from_bytes(path: &Path, bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(path, Backing::Owned(bytes))
    }

    fn parse(path: &Path, bytes: Backing) -> Result<Self, GgufError> {
        let header = parse_header(path, bytes.as_slice())?;
        Ok(GgufPart {
            path: path.to_path_buf(),
            version: header.version,
            metadata: header.metadata,
            alignment: header.alignment,
            data_start: header.data_start,
            tensors: header.tensors,
            bytes,
        })
    }

    /// The file's length in bytes.
    pub fn len(&self) -> u64 {
        self.bytes.as_slice().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.as_slice().is_empty()
    }
}

struct Header {
    version: u32,
    metadata: Metadata,
    alignment: u64,
    data_start: u64,
    tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian cursor over the header.
struct Cursor<'a> {
    path: &'a Path,
    data: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn err(&self, message: impl Into<String>) -> GgufError {
        GgufError::Header { path: self.path.to_path_buf(), offset: self.pos as u64, message: message.into() }
    }

    fn remaining(&self) -> u64 {
        (self.data.len() - self.pos) as u64
    }

    /// Room for `n` items in `v`, or an error: bounded by the bytes left, a
    /// corrupt count can still name most of a 400 GB file, and an
    /// allocation that fails must not abort the process. (Where the system
    /// promises memory it lacks, a count the allocation grants reads on
    /// until the values run into an invalid one, or the bytes end.)
    fn reserve<T>(&self, v: &mut Vec<T>, n: usize, what: &str) -> Result<(), GgufError> {
        v.try_reserve_exact(n).map_err(|_| self.err(format!("{what}: a length of {n} ({} bytes in memory) cannot be allocated; it is corrupt", n.saturating_mul(size_of::<T>()))))
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.err(format!("file ends inside {what} (needs {n} bytes, {} left)", self.remaining())));
        }
        let s = &self.data[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let start = self.pos;
        let bytes = self.take(len, what)?;
        if len > MAX_STRING {
            return Err(self.err(format!("{what} is {len} bytes long, more than the {MAX_STRING} a GGUF string may be: the length is corrupt")));
        }
        String::from_utf8(bytes.to_vec()).map_err(|e| GgufError::Header {
            path: self.path.to_path_buf(),
            offset: start as u64 + e.utf8_error().valid_up_to() as u64,
            message: format!("{what} is not valid UTF-8"),
        })
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(key)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(key)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            ValueType::U32 => Value::U32(self.u32(key)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            ValueType::U64 => Value::U64(self.u64(key)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            ValueType::Bool => match self.array::<1>(key)?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => {
                    self.pos -= 1;
                    return Err(self.err(format!("{key}: bool byte {b} is neither 0 nor 1")));
                }
            },
            ValueType::String => Value::String(self.string(&format!("the string value of {key}"))?),
            ValueType::Array => {
                if depth >= MAX_NESTING {
                    return Err(self.err(format!("{key}: arrays nested deeper than {MAX_NESTING} levels")));
                }
                let elem_id = self.u32(key)?;
                let elem = ValueType::from_id(elem_id).ok_or_else(|| self.err(format!("{key}: unknown array element type {elem_id}")))?;
                let n = self.u64(key)?;
                // Bound the count by the bytes left before allocating for it.
                if n.checked_mul(elem.min_bytes()).is_none_or(|need| need > self.remaining()) {
                    return Err(self.err(format!("{key}: an array of {n} {elem:?} values cannot fit in the {} bytes left", self.remaining())));
                }
                let mut items = vec![];
                self.reserve(&mut items, n as usize, key)?;
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

fn parse_header(path: &Path, data: &[u8]) -> Result<Header, GgufError> {
    let mut c = Cursor { path, data, pos: 0 };
    let magic = c.array::<4>("the magic")?;
    if &magic != MAGIC {
        c.pos = 0;
        return Err(c.err(format!("bad magic {magic:02x?}; a GGUF file starts with \"GGUF\"")));
    }
    let version = c.u32("the version")?;
    match version {
        2 | 3 => {}
        1 => return Err(c.err("GGUF version 1 is not supported (re-convert the model with a current llama.cpp)")),
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => return Err(c.err("big-endian GGUF files are not supported")),
        v => return Err(c.err(format!("unsupported GGUF version {v} (expected 2 or 3)"))),
    }
    let n_tensors = c.u64("the tensor count")?;
    let n_kv = c.u64("the metadata count")?;

    let mut entries = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty_id = c.u32(&key)?;
        let ty = ValueType::from_id(ty_id).ok_or_else(|| c.err(format!("metadata key {key}: unknown value type {ty_id}")))?;
        let v = c.value(ty, &key, 0)?;
        if entries.insert(key.clone(), v).is_some() {
            return Err(c.err(format!("metadata key {key} appears twice")));
        }
    }
    let metadata = Metadata { path: path.to_path_buf(), entries };
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(v) => return Err(metadata.error("general.alignment", format!("must be a u32 power of two, found {v:?}"))),
    };

    // Each tensor info takes at least 8 (name) + 4 + 4 + 8 bytes.
    if n_tensors.checked_mul(24).is_none_or(|need| need > c.remaining()) {
        return Err(c.err(format!("{n_tensors} tensor infos cannot fit in the {} bytes left", c.remaining())));
    }
    let mut raw = vec![];
    c.reserve(&mut raw, n_tensors as usize, "the tensor count")?;
    let mut seen = HashMap::new();
    for i in 0..n_tensors {
        let name = c.string(&format!("the name of tensor {i}"))?;
        let tensor_err = |message: String| GgufError::Tensor { path: path.to_path_buf(), tensor: name.clone(), message };
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(tensor_err(format!("has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        let ty_id = c.u32(&name)?;
        let offset = c.u64(&name)?;
        let ty = GgmlType::from_id(ty_id).ok_or_else(|| tensor_err(format!("unknown ggml type id {ty_id}")))?;
        if seen.insert(name.clone(), i).is_some() {
            return Err(tensor_err("appears twice".into()));
        }
        raw.push((name, dims, ty, offset));
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = data.len() as u64;

    let mut tensors = Vec::with_capacity(raw.len());
    for (name, dims, ty, offset) in raw {
        let tensor_err = |message: String| GgufError::Tensor { path: path.to_path_buf(), tensor: name.clone(), message };
        let n_elements = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).ok_or_else(|| tensor_err(format!("dimensions {dims:?} overflow")))?;
        let row = ty
            .row_bytes(dims[0])
            .ok_or_else(|| tensor_err(format!("rows of {} elements are not whole {ty} blocks of {}", dims[0], ty.block_size())))?;
        let n_bytes = dims[1..]
            .iter()
            .try_fold(row, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| tensor_err(format!("dimensions {dims:?} overflow")))?;
        if !offset.is_multiple_of(alignment) {
            return Err(tensor_err(format!("offset {offset} is not a multiple of the alignment {alignment}")));
        }
        let start = data_start.checked_add(offset).ok_or_else(|| tensor_err(format!("offset {offset} overflows")))?;
        let end = start.checked_add(n_bytes).filter(|&e| e <= file_len).ok_or_else(|| {
            tensor_err(format!("its {n_bytes} bytes at offset {offset} (file byte {start}) run past the end of the file ({file_len} bytes); the file is truncated or corrupt"))
        })?;
        debug_assert!(end <= file_len);
        tensors.push(TensorInfo { name, dims, ty, offset, part: 0, start, n_bytes, n_elements });
    }
    check_overlaps(path, &tensors)?;
    Ok(Header { version, metadata, alignment, data_start, tensors })
}

/// No two tensors may share a byte.
fn check_overlaps(path: &Path, tensors: &[TensorInfo]) -> Result<(), GgufError> {
    let mut by_start: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    by_start.sort_by_key(|t| t.start);
    for w in by_start.windows(2) {
        if w[0].start + w[0].n_bytes > w[1].start {
            return Err(GgufError::Tensor {
                path: path.to_path_buf(),
                tensor: w[1].name.clone(),
                message: format!("its bytes (from file byte {}) overlap those of {} (file bytes {}..{})", w[1].start, w[0].name, w[0].start, w[0].start + w[0].n_bytes),
            });
        }
    }
    Ok(())
}

/// `NAME-00001-of-00003.gguf` → (`NAME`, 1, 3).
pub fn split_file_name(path: &Path) -> Option<(String, usize, usize)> {
    let stem = path.file_name()?.to_str()?.strip_suffix(".gguf")?;
    let (rest, count) = stem.rsplit_once("-of-")?;
    let (prefix, no) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(count) || !digits(no) {
        return None;
    }
    Some((prefix.to_string(), no.parse().ok()?, count.parse().ok()?))
}

/// Where a `--model` path names a GGUF model, the file to open; `Ok(None)`
/// when it names something else (a Hugging Face directory).
///
/// The convention every Duplex process follows: a model path is either a
/// Hugging Face directory (`config.json` beside safetensors), or a GGUF file
/// (one file, or any part of a split set), or a directory holding one GGUF
/// model and no `config.json` (whose first part is returned). A directory
/// with several GGUF models is an error that lists them, not a guess.
pub fn locate(path: &Path) -> Result<Option<PathBuf>, GgufError> {
    let io = |source| GgufError::Io { path: path.to_path_buf(), source };
    if path.is_file() {
        return Ok(path.extension().is_some_and(|e| e == "gguf").then(|| path.to_path_buf()));
    }
    if !path.is_dir() || path.join("config.json").exists() {
        return Ok(None);
    }
    let mut models: Vec<PathBuf> = vec![];
    for entry in std::fs::read_dir(path).map_err(io)? {
        let file = entry.map_err(io)?.path();
        if file.extension().is_none_or(|e| e != "gguf") || !file.is_file() {
            continue;
        }
        // Parts of one split set count once, as their first part.
        let model = match split_file_name(&file) {
            Some((prefix, _, count)) => split_path(&file, &prefix, 1, count),
            None => file,
        };
        if !models.contains(&model) {
            models.push(model);
        }
    }
    models.sort();
    match models.len() {
        0 => Ok(None),
        1 => Ok(models.pop()),
        _ => Err(GgufError::Model {
            path: path.to_path_buf(),
            message: format!(
                "holds {} GGUF models ({}); name the file to serve",
                models.len(),
                models.iter().filter_map(|m| m.file_name()).map(|n| n.to_string_lossy()).collect::<Vec<_>>().join(", ")
            ),
        }),
    }
}

/// The path of part `no` (1-based) of `count` beside `like`.
pub fn split_path(like: &Path, prefix: &str, no: usize, count: usize) -> PathBuf {
    like.with_file_name(format!("{prefix}-{no:05}-of-{count:05}.gguf"))
}

/// A GGUF model: one file or every part of a split one, as one tensor table.
pub struct Gguf {
    parts: Vec<GgufPart>,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

impl Gguf {
    /// Open `path`. If it is one part of a split model (`split.count` > 1),
    /// every part is opened, whichever part was named.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let first = GgufPart::open(path)?;
        let count = first.metadata.usize("split.count")?.unwrap_or(1);
        if count <= 1 {
            return Self::from_parts(vec![first]);
        }
        let split_err = |message: String| GgufError::Split { path: path.to_path_buf(), message };
        let (prefix, _, named_count) = split_file_name(path)
            .ok_or_else(|| split_err(format!("split.count is {count} but the name does not follow NAME-00001-of-{count:05}.gguf, so the other parts cannot be found")))?;
        if named_count != count {
            return Err(split_err(format!("the name says {named_count} parts, split.count says {count}")));
        }
        let mut parts = Vec::with_capacity(count);
        let mut given = Some(first);
        for no in 1..=count {
            let p = split_path(path, &prefix, no, count);
            match given.take_if(|g| g.path == p) {
                Some(g) => parts.push(g),
                None => parts.push(GgufPart::open(&p)?),
            }
        }
        Self::from_parts(parts)
    }

    /// Parts already parsed, in order: checks the split keys and builds one
    /// tensor table.
    pub fn from_parts(mut parts: Vec<GgufPart>) -> Result<Self, GgufError> {
        let n = parts.len();
        let Some(head) = parts.first() else {
            return Err(GgufError::Split { path: PathBuf::new(), message: "no parts".into() });
        };
        let declared_count = head.metadata.usize("split.count")?.unwrap_or(1).max(1);
        if declared_count != n {
            return Err(GgufError::Split { path: head.path.clone(), message: format!("split.count is {declared_count} but {n} part(s) were given") });
        }
        if n > 1 {
            let declared_tensors = head.metadata.usize("split.tensors.count")?;
            let total: usize = parts.iter().map(|p| p.tensors.len()).sum();
            for (i, p) in parts.iter().enumerate() {
                let err = |message: String| GgufError::Split { path: p.path.clone(), message };
                let no = p.metadata.usize("split.no")?.ok_or_else(|| err("split.no is missing".into()))?;
                let count = p.metadata.usize("split.count")?.ok_or_else(|| err("split.count is missing".into()))?;
                if no != i || count != n {
                    return Err(err(format!("split.no {no} of split.count {count}, expected part {i} of {n} (split.no counts from 0)")));
                }
            }
            if let Some(declared) = declared_tensors {
                if declared != total {
                    return Err(GgufError::Split {
                        path: head.path.clone(),
                        message: format!("split.tensors.count is {declared} but the {n} parts hold {total} tensors"),
                    });
                }
            }
        }
        let mut tensors = vec![];
        let mut index = HashMap::new();
        for (i, p) in parts.iter_mut().enumerate() {
            for mut t in std::mem::take(&mut p.tensors) {
                t.part = i;
                if index.insert(t.name.clone(), tensors.len()).is_some() {
                    return Err(GgufError::Tensor { path: p.path.clone(), tensor: t.name, message: "also appears in an earlier part".into() });
                }
                tensors.push(t);
            }
        }
        // Keep each part's own table too, so that `parts()` stays complete.
        for t in &tensors {
            parts[t.part].tensors.push(t.clone());
        }
        Ok(Gguf { parts, tensors, index })
    }

    /// The model's metadata: that of the first part, which holds all of it.
    pub fn metadata(&self) -> &Metadata {
        &self.parts[0].metadata
    }

    /// Apply `overrides` to the model's metadata (the file is not changed).
    pub fn override_metadata(&mut self, overrides: &[MetadataOverride]) {
        self.parts[0].metadata.apply(overrides);
    }

    /// The first part's path, which errors about the model name.
    pub fn path(&self) -> &Path {
        &self.parts[0].path
    }

    pub fn parts(&self) -> &[GgufPart] {
        &self.parts
    }

    /// Every tensor of every part, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| GgufError::MissingTensor { path: self.path().to_path_buf(), tensor: name.into() })
    }

    /// A tensor's stored bytes, whatever its type.
    pub fn raw_bytes(&self, t: &TensorInfo) -> &[u8] {
        let part = &self.parts[t.part];
        // The range was checked against the file's length when it was parsed.
        &part.bytes.as_slice()[t.start as usize..(t.start + t.n_bytes) as usize]
    }

    /// Matrix `index` of a 3-D tensor (`dims[2]` matrices of `dims[1]` rows
    /// of `dims[0]` elements): one expert of a stacked `ffn_*_exps`, one
    /// head of `attn_k_b`/`attn_v_b`. The outermost dimension varies
    /// slowest, so each matrix is one contiguous run of whole rows.
    pub fn matrix_of(&self, t: &TensorInfo, index: usize) -> Result<&[u8], GgufError> {
        let err = |message: String| GgufError::Tensor { path: self.parts[t.part].path.clone(), tensor: t.name.clone(), message };
        let [_, _, count] = t.dims[..] else {
            return Err(err(format!("has dimensions {:?}, not three", t.dims)));
        };
        if index as u64 >= count {
            return Err(err(format!("matrix {index} asked for, it has {count}")));
        }
        // n_bytes is a whole number of rows, hence of matrices.
        let each = (t.n_bytes / count) as usize;
        Ok(&self.raw_bytes(t)[index * each..(index + 1) * each])
    }

    /// A tensor Duplex can compute with: its info and bytes, or an error
    /// naming it and its type if the type is not one Duplex supports.
    pub fn supported(&self, name: &str) -> Result<(&TensorInfo, &[u8]), GgufError> {
        let t = self.tensor(name)?;
        if !t.ty.is_supported() {
            return Err(GgufError::Unsupported { path: self.parts[t.part].path.clone(), tensor: t.name.clone(), ty: t.ty });
        }
        Ok((t, self.raw_bytes(t)))
    }
}

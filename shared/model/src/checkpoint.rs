//! Memory-mapped Hugging Face safetensors checkpoints.
//!
//! A checkpoint is either one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`. Every shard is mapped, never read into the
//! heap; weights stay views into the mapping (`WeightBytes`). Only the small
//! tensors the engine needs in F32 (norms, biases, FP8 block scales) are
//! copied out. Every problem is reported with the file and tensor it concerns.

use duplex_kernels::device::HostBytes;
use duplex_kernels::quant::QuantKind;
use duplex_kernels::{WeightFormat, WeightView};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot open {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")]
    NoWeights { dir: PathBuf },
    #[error("{index} is not a valid safetensors index: {message}")]
    BadIndex { index: PathBuf, message: String },
    #[error("shard {shard} named by {index} is missing")]
    MissingShard { index: PathBuf, shard: String },
    #[error("{file} is not a valid safetensors file (truncated or corrupt): {message}")]
    BadShard { file: PathBuf, message: String },
    #[error("tensor {tensor} is missing from the checkpoint{}", .file.as_ref().map(|f| format!(" (expected in {})", f.display())).unwrap_or_default())]
    MissingTensor { tensor: String, file: Option<PathBuf> },
    #[error("tensor {tensor} in {file} has shape {got:?}, expected {expected:?}")]
    Shape { tensor: String, file: PathBuf, expected: Vec<usize>, got: Vec<usize> },
    #[error("tensor {tensor} in {file} has dtype {dtype}, which is not supported here (expected {expected})")]
    Dtype { tensor: String, file: PathBuf, dtype: String, expected: &'static str },
    #[error("tensor {tensor} in {file} is FP8 but config.json declares no fp8 quantization_config")]
    Unquantized { tensor: String, file: PathBuf },
    #[error("vocab_size {config} in config.json disagrees with {tensor} in {file}, which has {rows} rows")]
    VocabMismatch { config: usize, tensor: String, file: PathBuf, rows: usize },
}

/// Bytes of one tensor inside a mapped shard. Cheap to clone; keeps the mapping alive.
#[derive(Clone)]
pub struct WeightBytes {
    map: Arc<Mmap>,
    range: Range<usize>,
}

impl WeightBytes {
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }
}

impl std::fmt::Debug for WeightBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBytes({} bytes)", self.range.len())
    }
}

/// A weight matrix `[rows, cols]` in its stored format.
#[derive(Clone, Debug)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    bytes: WeightBytes,
    scales: Vec<f32>,
}

impl Linear {
    pub fn view(&self) -> WeightView<'_> {
        WeightView { rows: self.rows, cols: self.cols, format: self.format, data: self.bytes.as_slice(), scales: &self.scales }
    }

    /// Bytes read from memory by one full pass over the weight.
    pub fn stored_bytes(&self) -> usize {
        self.bytes.range.len() + self.scales.len() * 4
    }

    /// Rows `rows` as a host tensor a device can copy from: the stored bytes
    /// in place (keeping their mapping alive) and the scales of those rows'
    /// blocks. FP8 slices must start on a scale-block boundary.
    pub fn host_rows(&self, rows: Range<usize>) -> HostTensor {
        let row_bytes = self.format.row_bytes(self.cols);
        let start = self.bytes.range.start;
        let data = HostBytes::new(self.bytes.map.clone(), start + rows.start * row_bytes..start + rows.end * row_bytes).expect("rows lie within the tensor");
        let scales = match self.format {
            WeightFormat::Fp8E4m3 { block } => {
                assert_eq!(rows.start % block[0], 0, "FP8 row slices start on a scale block");
                let per_row = self.cols.div_ceil(block[1]);
                let blocks = rows.start / block[0] * per_row..rows.end.div_ceil(block[0]) * per_row;
                Some(HostBytes::from_f32(&self.scales[blocks]))
            }
            _ => None,
        };
        HostTensor { rows: rows.len(), cols: self.cols, format: self.format, data, scales }
    }

    pub fn host_tensor(&self) -> HostTensor {
        self.host_rows(0..self.rows)
    }
}

/// A weight in host memory, ready to be copied to a device as it is stored.
#[derive(Clone)]
pub struct HostTensor {
    pub rows: usize,
    pub cols: usize,
    pub format: WeightFormat,
    pub data: HostBytes,
    /// FP8 block scales (F32).
    pub scales: Option<HostBytes>,
}

impl HostTensor {
    /// An F32 vector (a norm weight, a bias) as a one-row tensor.
    pub fn vector(xs: &[f32]) -> Self {
        HostTensor { rows: 1, cols: xs.len(), format: WeightFormat::F32, data: HostBytes::from_f32(xs), scales: None }
    }
}

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
}

/// How a stored tensor encodes its values: a safetensors dtype, or one of
/// ggml's block formats (a GGUF k-quant or Q4_0/Q5_0/Q8_0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredType {
    Float(Dtype),
    Block(QuantKind),
}

impl StoredType {
    /// Bytes of a tensor of `shape` (`None` on overflow, or for a block
    /// format whose rows are not whole blocks).
    pub fn bytes(self, shape: &[usize]) -> Option<usize> {
        match self {
            StoredType::Float(d) => shape.iter().try_fold(d.size(), |acc, &n| acc.checked_mul(n)),
            StoredType::Block(kind) => {
                let (&cols, outer) = shape.split_last()?;
                let row = kind.row_bytes(cols).ok()?;
                outer.iter().try_fold(row, |acc, &n| acc.checked_mul(n))
            }
        }
    }

    /// The name a weight segment's directory stores: safetensors' for its
    /// dtypes (`BF16`, `F8_E4M3`, …), ggml's for the block formats (`Q4_K`).
    pub fn name(self) -> String {
        match self {
            StoredType::Float(d) => serde_json::to_value(d).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_else(|| format!("{d:?}")),
            StoredType::Block(kind) => kind.name().to_string(),
        }
    }

    /// The type [`Self::name`] names.
    pub fn from_name(name: &str) -> Option<StoredType> {
        if let Some(kind) = QuantKind::ALL.into_iter().find(|k| k.name() == name && k.block_elems() > 1) {
            return Some(StoredType::Block(kind));
        }
        serde_json::from_value(serde_json::Value::String(name.to_string())).ok().map(StoredType::Float)
    }
}

impl std::fmt::Display for StoredType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// A tensor as a mapping holds it, for [`Checkpoint::from_mapping`] and
/// [`Checkpoint::from_shards`]: its name, type, shape and byte range.
#[derive(Clone, Debug)]
pub struct StoredTensor {
    pub name: String,
    pub ty: StoredType,
    pub shape: Vec<usize>,
    pub range: Range<usize>,
}

struct TensorEntry {
    shard: usize,
    dtype: StoredType,
    shape: Vec<usize>,
    range: Range<usize>,
}

pub struct Checkpoint {
    shards: Vec<Shard>,
    tensors: HashMap<String, TensorEntry>,
    fp8_block: Option<[usize; 2]>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

impl Checkpoint {
    /// Open every shard in `dir`. `fp8_block` is the `weight_block_size` of the
    /// config's quantisation, if any.
    pub fn open(dir: &Path, fp8_block: Option<[usize; 2]>) -> Result<Self, CheckpointError> {
        let index = dir.join(INDEX_FILE);
        let single = dir.join(SINGLE_FILE);
        let (shard_names, expected): (Vec<String>, Vec<(String, String)>) = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
            let bad = |message: String| CheckpointError::BadIndex { index: index.clone(), message };
            let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            let map = json.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| bad("no \"weight_map\" object".into()))?;
            let mut expected = Vec::with_capacity(map.len());
            for (tensor, file) in map {
                let file = file.as_str().ok_or_else(|| bad(format!("weight_map entry for {tensor} is not a file name")))?;
                if file.contains('/') || file.contains('\\') || file == ".." {
                    return Err(bad(format!("weight_map entry for {tensor} points outside the checkpoint: {file}")));
                }
                expected.push((tensor.clone(), file.to_string()));
            }
            let names: BTreeSet<String> = expected.iter().map(|(_, f)| f.clone()).collect();
            for name in &names {
                if !dir.join(name).is_file() {
                    return Err(CheckpointError::MissingShard { index: index.clone(), shard: name.clone() });
                }
            }
            (names.into_iter().collect(), expected)
        } else if single.exists() {
            (vec![SINGLE_FILE.to_string()], vec![])
        } else {
            return Err(CheckpointError::NoWeights { dir: dir.to_path_buf() });
        };

        let mut shards: Vec<Shard> = Vec::with_capacity(shard_names.len());
        let mut tensors = HashMap::new();
        for (i, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).map_err(io_err(&path))?;
            // SAFETY: the checkpoint files are treated as read-only for the
            // life of the process; nothing in Duplex writes to them.
            let map = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
            // Decode streams every weight once per token, and with 4 KiB
            // pages the hardware prefetchers stop at every page boundary and
            // the TLB misses on each: ask for 2 MiB pages where the kernel
            // can back the file with them (a hint; ignored where it cannot).
            let _ = map.advise(memmap2::Advice::HugePage);
            let (header_len, metadata) = SafeTensors::read_metadata(&map)
                .map_err(|e| CheckpointError::BadShard { file: path.clone(), message: format!("{e:?}") })?;
            let data_start = 8 + header_len;
            for (tensor, info) in metadata.tensors() {
                let (s, e) = info.data_offsets;
                let entry = TensorEntry { shard: i, dtype: StoredType::Float(info.dtype), shape: info.shape.clone(), range: data_start + s..data_start + e };
                if let Some(other) = tensors.insert(tensor.clone(), entry) {
                    return Err(CheckpointError::BadShard {
                        file: path,
                        // Earlier shards are already in `shards`; a JSON header cannot repeat a name.
                        message: format!("tensor {tensor} also appears in {}", shards[other.shard].path.display()),
                    });
                }
            }
            shards.push(Shard { path, map: Arc::new(map) });
        }
        // The index must not promise tensors that its shards lack.
        for (tensor, file) in expected {
            match tensors.get(&tensor) {
                Some(t) if shard_names[t.shard] == file => {}
                _ => return Err(CheckpointError::MissingTensor { tensor, file: Some(dir.join(file)) }),
            }
        }
        Ok(Checkpoint { shards, tensors, fp8_block })
    }

    /// A checkpoint whose tensors lie in one mapping that something else laid
    /// out (a shared weight segment), at `data_start + range`. `source`
    /// names the mapping in errors. Every range is checked against the
    /// mapping and against its type and shape.
    pub fn from_mapping(source: PathBuf, map: Arc<Mmap>, data_start: usize, tensors: impl IntoIterator<Item = StoredTensor>, fp8_block: Option<[usize; 2]>) -> Result<Self, CheckpointError> {
        let shifted = tensors.into_iter().map(|t| StoredTensor { range: data_start.saturating_add(t.range.start)..data_start.saturating_add(t.range.end), ..t });
        Self::from_shards(vec![(source, map)], shifted.map(|t| (0, t)), fp8_block)
    }

    /// A checkpoint over mappings that something else read (a GGUF's
    /// parts, tensors it derived): each tensor is `(shard index, tensor)`,
    /// its range absolute within that shard. Every range is checked against
    /// its mapping and against its type and shape, and names are unique.
    pub fn from_shards(shards: Vec<(PathBuf, Arc<Mmap>)>, tensors: impl IntoIterator<Item = (usize, StoredTensor)>, fp8_block: Option<[usize; 2]>) -> Result<Self, CheckpointError> {
        let mut entries = HashMap::new();
        for (shard, t) in tensors {
            let Some((path, map)) = shards.get(shard) else {
                return Err(CheckpointError::MissingTensor { tensor: t.name, file: None });
            };
            let (s, e) = (t.range.start, t.range.end);
            if s > e || e > map.len() || t.ty.bytes(&t.shape) != Some(e - s) {
                return Err(CheckpointError::BadShard {
                    file: path.clone(),
                    message: format!("tensor {} has data range {s}..{e}, which does not fit the mapping or its {} {:?}", t.name, t.ty, t.shape),
                });
            }
            if entries.insert(t.name.clone(), TensorEntry { shard, dtype: t.ty, shape: t.shape, range: t.range }).is_some() {
                return Err(CheckpointError::BadShard { file: path.clone(), message: format!("tensor {} appears twice", t.name) });
            }
        }
        Ok(Checkpoint { shards: shards.into_iter().map(|(path, map)| Shard { path, map }).collect(), tensors: entries, fp8_block })
    }

    /// Every tensor as stored, for copying the checkpoint elsewhere.
    pub fn raw_tensors(&self) -> impl Iterator<Item = (&str, StoredType, &[usize], &[u8])> {
        self.tensors.iter().map(|(name, t)| (name.as_str(), t.dtype, t.shape.as_slice(), &self.shards[t.shard].map[t.range.clone()]))
    }

    /// The files this checkpoint was read from.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of every tensor in the checkpoint.
    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, CheckpointError> {
        self.tensors.get(name).ok_or_else(|| CheckpointError::MissingTensor { tensor: name.to_string(), file: None })
    }

    fn file_of(&self, t: &TensorEntry) -> PathBuf {
        self.shards[t.shard].path.clone()
    }

    fn check_shape(&self, name: &str, t: &TensorEntry, expected: &[usize]) -> Result<(), CheckpointError> {
        if t.shape != expected {
            return Err(CheckpointError::Shape {
                tensor: name.to_string(),
                file: self.file_of(t),
                expected: expected.to_vec(),
                got: t.shape.clone(),
            });
        }
        Ok(())
    }

    fn bytes(&self, t: &TensorEntry) -> WeightBytes {
        WeightBytes { map: self.shards[t.shard].map.clone(), range: t.range.clone() }
    }

    /// Number of rows of a 2-D tensor, for vocabulary checks.
    pub fn rows_of(&self, name: &str) -> Result<(usize, PathBuf), CheckpointError> {
        let t = self.entry(name)?;
        Ok((t.shape.first().copied().unwrap_or(0), self.file_of(t)))
    }

    /// Load `{prefix}.weight` as a `[rows, cols]` matrix, with its
    /// `{prefix}.weight_scale_inv` when it is FP8.
    pub fn linear(&self, prefix: &str, rows: usize, cols: usize) -> Result<Linear, CheckpointError> {
        let name = format!("{prefix}.weight");
        let t = self.entry(&name)?;
        self.check_shape(&name, t, &[rows, cols])?;
        let (format, scales) = match t.dtype {
            // Rows of whole blocks: `from_shards` checked the bytes against the shape.
            StoredType::Block(kind) => (WeightFormat::Quant(kind), vec![]),
            StoredType::Float(Dtype::F32) => (WeightFormat::F32, vec![]),
            StoredType::Float(Dtype::BF16) => (WeightFormat::Bf16, vec![]),
            StoredType::Float(Dtype::F16) => (WeightFormat::F16, vec![]),
            StoredType::Float(Dtype::F8_E4M3) => {
                let block = self.fp8_block.ok_or_else(|| CheckpointError::Unquantized { tensor: name.clone(), file: self.file_of(t) })?;
                let scale_name = format!("{prefix}.weight_scale_inv");
                let scales = self.vector(&scale_name, &[rows.div_ceil(block[0]), cols.div_ceil(block[1])])?;
                (WeightFormat::Fp8E4m3 { block }, scales)
            }
            other => {
                return Err(CheckpointError::Dtype {
                    tensor: name,
                    file: self.file_of(t),
                    dtype: other.name(),
                    expected: "F8_E4M3, BF16, F16, F32 or a GGUF block format",
                })
            }
        };
        Ok(Linear { rows, cols, format, bytes: self.bytes(t), scales })
    }

    /// Load a small float tensor of the given shape into an F32 vector.
    pub fn vector(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, CheckpointError> {
        let t = self.entry(name)?;
        self.check_shape(name, t, shape)?;
        let bytes = &self.shards[t.shard].map[t.range.clone()];
        let out = match t.dtype {
            StoredType::Float(Dtype::F32) => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            StoredType::Float(Dtype::BF16) => bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            StoredType::Float(Dtype::F16) => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            other => {
                return Err(CheckpointError::Dtype {
                    tensor: name.to_string(),
                    file: self.file_of(t),
                    dtype: other.name(),
                    expected: "F32, BF16 or F16",
                })
            }
        };
        Ok(out)
    }
}

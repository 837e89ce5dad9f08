//! Writing GGUF files: metadata in the order given, tensors packed at the
//! alignment in the order given. What tests use to make files of any shape
//! (each tensor takes an explicit ggml type id, so unknown ids can be
//! written too), and what a tool that edits a GGUF's metadata would use.

use crate::Value;

/// A GGUF file to write.
#[derive(Clone, Debug)]
pub struct Writer {
    pub version: u32,
    pub alignment: u64,
    pub kvs: Vec<(String, Value)>,
    /// `(name, ggml dims, ggml type id, bytes)`.
    pub tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
}

impl Default for Writer {
    fn default() -> Self {
        Writer { version: 3, alignment: crate::DEFAULT_ALIGNMENT, kvs: vec![], tensors: vec![] }
    }
}

impl Writer {
    pub fn kv(mut self, k: &str, v: Value) -> Self {
        self.kvs.push((k.into(), v));
        self
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], ty: u32, bytes: Vec<u8>) -> Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, bytes));
        self
    }

    /// The file's bytes, and each tensor's offset field as written.
    pub fn bytes(&self) -> (Vec<u8>, Vec<u64>) {
        let mut out = b"GGUF".to_vec();
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.kvs.len() as u64).to_le_bytes());
        for (k, v) in &self.kvs {
            put_str(&mut out, k);
            out.extend(v.value_type().id().to_le_bytes());
            put_value(&mut out, v);
        }
        let mut offsets = vec![];
        let mut at = 0u64;
        for (name, dims, ty, bytes) in &self.tensors {
            put_str(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(at.to_le_bytes());
            offsets.push(at);
            at = (at + bytes.len() as u64).div_ceil(self.alignment) * self.alignment;
        }
        let pad = |out: &mut Vec<u8>, a: u64| out.resize((out.len() as u64).div_ceil(a) as usize * a as usize, 0);
        pad(&mut out, self.alignment);
        for (_, _, _, bytes) in &self.tensors {
            out.extend(bytes);
            pad(&mut out, self.alignment);
        }
        (out, offsets)
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::Array(t, items) => {
            out.extend(t.id().to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for i in items {
                put_value(out, i);
            }
        }
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
    }
}

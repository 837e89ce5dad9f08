//! ggml tensor types as GGUF stores them: the numeric id in a tensor's
//! info, and the block layout that fixes how many bytes a row takes.
//!
//! The sizes are those of ggml's block structs (`ggml-common.h`): a block of
//! `block_size` consecutive elements of a row is stored in `block_bytes`
//! bytes. Ids 4, 5 and 31..=33, 36..=38 belonged to formats ggml has since
//! removed (Q4_2, Q4_3, the repacked Q4_0_4_4 family); a file using them is
//! treated like any other unknown id.

use std::fmt;

/// A ggml tensor type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
    Nvfp4,
    Q1_0,
}

/// Elements per k-quant super-block.
const QK_K: u64 = 256;

/// The types Duplex can compute with (or convert at load time): those
/// `llama-quantize` writes into Q4_K_M, Q5_K_M, Q6_K and Q8_0 files of the
/// MoE families. Beyond the k-quants, Q8_0 and Q4_0 that includes Q5_0 and
/// Q5_1, its fallbacks for Q4_K and Q5_K tensors whose rows are not whole
/// 256-element blocks: DeepSeek's `attn_k_b` has rows of `qk_nope_head_dim`
/// (64 in the fixture, 128 in V3), so it is Q5_0 in every Q4_K_M file (the
/// fixture's included) and Q5_1 in Q5_K_M ones. (Q6_K falls back to Q8_0.)
pub const DUPLEX_SUPPORTED: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

impl GgmlType {
    /// Every type this reader knows, in id order.
    pub const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::Iq2Xxs,
        GgmlType::Iq2Xs,
        GgmlType::Iq3Xxs,
        GgmlType::Iq1S,
        GgmlType::Iq4Nl,
        GgmlType::Iq3S,
        GgmlType::Iq2S,
        GgmlType::Iq4Xs,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::Iq1M,
        GgmlType::Bf16,
        GgmlType::Tq1_0,
        GgmlType::Tq2_0,
        GgmlType::Mxfp4,
        GgmlType::Nvfp4,
        GgmlType::Q1_0,
    ];

    /// The type with ggml id `id`, if this reader knows it.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.id() == id)
    }

    /// ggml's numeric id (`enum ggml_type`).
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            Iq2Xxs => 16,
            Iq2Xs => 17,
            Iq3Xxs => 18,
            Iq1S => 19,
            Iq4Nl => 20,
            Iq3S => 21,
            Iq2S => 22,
            Iq4Xs => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            Iq1M => 29,
            Bf16 => 30,
            Tq1_0 => 34,
            Tq2_0 => 35,
            Mxfp4 => 39,
            Nvfp4 => 40,
            Q1_0 => 41,
        }
    }

    /// ggml's name for the type (`ggml_type_name`).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            Iq2Xxs => "IQ2_XXS",
            Iq2Xs => "IQ2_XS",
            Iq3Xxs => "IQ3_XXS",
            Iq1S => "IQ1_S",
            Iq4Nl => "IQ4_NL",
            Iq3S => "IQ3_S",
            Iq2S => "IQ2_S",
            Iq4Xs => "IQ4_XS",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            Iq1M => "IQ1_M",
            Bf16 => "BF16",
            Tq1_0 => "TQ1_0",
            Tq2_0 => "TQ2_0",
            Mxfp4 => "MXFP4",
            Nvfp4 => "NVFP4",
            Q1_0 => "Q1_0",
        }
    }

    /// Elements per block: a row's length must be a multiple of it.
    pub fn block_size(self) -> u64 {
        use GgmlType::*;
        match self {
            F32 | F16 | Bf16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | Iq4Nl | Mxfp4 => 32,
            Nvfp4 => 64,
            Q1_0 => 128,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K | Iq2Xxs | Iq2Xs | Iq3Xxs | Iq1S | Iq3S | Iq2S | Iq4Xs | Iq1M | Tq1_0 | Tq2_0 => QK_K,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> u64 {
        use GgmlType::*;
        // Each sum spells out the block struct's fields (scales, then quants).
        match self {
            F32 | I32 => 4,
            F16 | Bf16 | I16 => 2,
            F64 | I64 => 8,
            I8 => 1,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q8_1 => 2 + 2 + 32,
            Iq4Nl => 2 + 16,
            Mxfp4 => 1 + 16,
            Nvfp4 => 4 + 32,
            Q1_0 => 2 + 16,
            Q2K => 2 + 2 + QK_K / 16 + QK_K / 4,
            Q3K => 2 + QK_K / 4 + QK_K / 8 + 12,
            Q4K => 2 + 2 + 12 + QK_K / 2,
            Q5K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            Q6K => 2 + QK_K / 2 + QK_K / 4 + QK_K / 16,
            Q8K => 4 + QK_K + 2 * (QK_K / 16),
            Iq2Xxs => 2 + QK_K / 4,
            Iq2Xs => 2 + QK_K / 4 + QK_K / 32,
            Iq3Xxs => 2 + QK_K / 4 + QK_K / 8,
            Iq1S => 2 + QK_K / 8 + QK_K / 16,
            Iq3S => 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4,
            Iq2S => 2 + QK_K / 4 + QK_K / 16,
            Iq4Xs => 2 + 2 + QK_K / 64 + QK_K / 2,
            Iq1M => QK_K / 8 + QK_K / 16 + QK_K / 32,
            Tq1_0 => 2 + (QK_K - 4 * QK_K / 64) / 5 + QK_K / 64,
            Tq2_0 => 2 + QK_K / 4,
        }
    }

    /// Whether Duplex computes with this type ([`DUPLEX_SUPPORTED`]).
    pub fn is_supported(self) -> bool {
        DUPLEX_SUPPORTED.contains(&self)
    }

    /// Bytes of a row of `len` elements, if `len` is whole blocks.
    pub fn row_bytes(self, len: u64) -> Option<u64> {
        if !len.is_multiple_of(self.block_size()) {
            return None;
        }
        (len / self.block_size()).checked_mul(self.block_bytes())
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t.id()), Some(t), "{t}");
        }
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len());
        for removed in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(removed), None, "id {removed}");
        }
    }

    #[test]
    fn block_layouts_match_ggml() {
        // ggml-common.h's static_asserts, restated as numbers.
        let expect = [
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q5_0, 32, 22),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q8_1, 32, 36),
            (GgmlType::Q2K, 256, 84),
            (GgmlType::Q3K, 256, 110),
            (GgmlType::Q4K, 256, 144),
            (GgmlType::Q5K, 256, 176),
            (GgmlType::Q6K, 256, 210),
            (GgmlType::Q8K, 256, 292),
            (GgmlType::Iq2Xxs, 256, 66),
            (GgmlType::Iq2Xs, 256, 74),
            (GgmlType::Iq3Xxs, 256, 98),
            (GgmlType::Iq1S, 256, 50),
            (GgmlType::Iq3S, 256, 110),
            (GgmlType::Iq2S, 256, 82),
            (GgmlType::Iq4Xs, 256, 136),
            (GgmlType::Iq1M, 256, 56),
            (GgmlType::Tq1_0, 256, 54),
            (GgmlType::Tq2_0, 256, 66),
            (GgmlType::Mxfp4, 32, 17),
            (GgmlType::Bf16, 1, 2),
        ];
        for (t, block, bytes) in expect {
            assert_eq!((t.block_size(), t.block_bytes()), (block, bytes), "{t}");
        }
        assert_eq!(GgmlType::Q4K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4K.row_bytes(64), None, "a row must be whole blocks");
    }

    #[test]
    fn supported_set() {
        for t in [GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::F16, GgmlType::Bf16, GgmlType::F32] {
            assert!(t.is_supported(), "{t}");
        }
        for t in [GgmlType::Q2K, GgmlType::Q3K, GgmlType::Iq4Xs, GgmlType::Q4_1, GgmlType::Q8K, GgmlType::I32] {
            assert!(!t.is_supported(), "{t}");
        }
    }
}

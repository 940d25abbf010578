//! Element types: the runtime tag [`DType`] and the typed view [`Element`].
//!
//! `DType` travels in shared-memory descriptors as one byte, so its codes
//! are part of the wire format: never renumber them, only append.

use std::fmt;
use std::str::FromStr;

use half::{bf16, f16};

use crate::{Error, Result};

/// Element type of a bucket, a shard, a landing slot or an accumulator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum DType {
    /// IEEE 754 binary32.
    F32 = 0,
    /// bfloat16: the top half of a binary32.
    BF16 = 1,
    /// IEEE 754 binary16.
    F16 = 2,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

    /// Bytes per element; also the alignment byte buffers of this dtype need.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// Short lowercase name: `"f32"`, `"bf16"` or `"f16"`.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        }
    }

    /// The stable one-byte code used in descriptors.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The dtype with code `code`, or `None` for an unassigned code.
    pub const fn from_u8(code: u8) -> Option<DType> {
        match code {
            0 => Some(DType::F32),
            1 => Some(DType::BF16),
            2 => Some(DType::F16),
            _ => None,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = Error;

    /// Accepts the short names, torch's names and torch's `str(dtype)`
    /// (`"torch.bfloat16"`), ignoring ASCII case.
    fn from_str(s: &str) -> Result<DType> {
        let lower = s.trim().to_ascii_lowercase();
        let name = lower.strip_prefix("torch.").unwrap_or(&lower);
        match name {
            "f32" | "float32" | "fp32" | "float" => Ok(DType::F32),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "float16" | "fp16" | "half" => Ok(DType::F16),
            _ => Err(Error::UnknownDTypeName(s.to_owned())),
        }
    }
}

impl TryFrom<u8> for DType {
    type Error = Error;

    fn try_from(code: u8) -> Result<DType> {
        DType::from_u8(code).ok_or(Error::UnknownDTypeCode(code))
    }
}

impl From<DType> for u8 {
    fn from(dtype: DType) -> u8 {
        dtype.as_u8()
    }
}

mod sealed {
    /// Keeps [`super::Element`] closed: the kernels exist for exactly these
    /// three types. On x86_64 it also carries their SIMD loads and stores.
    #[cfg(target_arch = "x86_64")]
    pub trait Sealed: crate::cpu::x86::Lanes {}
    #[cfg(not(target_arch = "x86_64"))]
    pub trait Sealed {}

    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A Rust type the kernels work on: `f32`, [`half::bf16`] or [`half::f16`].
///
/// Sealed; `DTYPE` links it to its runtime tag.
pub trait Element:
    sealed::Sealed + bytemuck::Pod + Default + PartialEq + fmt::Debug + Send + Sync + 'static
{
    /// The runtime tag of this type.
    const DTYPE: DType;

    /// Widens to f32; exact for every finite value and infinity.
    fn to_f32(self) -> f32;

    /// Narrows from f32, rounding to nearest, ties to even; NaN stays NaN.
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    const DTYPE: DType = DType::F32;

    #[inline]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline]
    fn from_f32(value: f32) -> f32 {
        value
    }
}

impl Element for bf16 {
    const DTYPE: DType = DType::BF16;

    /// A pure bit shift: a signaling NaN stays signaling, as in torch.
    #[inline]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }

    #[inline]
    fn from_f32(value: f32) -> bf16 {
        bf16::from_f32(value)
    }
}

impl Element for f16 {
    const DTYPE: DType = DType::F16;

    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[inline]
    fn from_f32(value: f32) -> f16 {
        f16::from_f32(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_stable() {
        assert_eq!(DType::F32.as_u8(), 0);
        assert_eq!(DType::BF16.as_u8(), 1);
        assert_eq!(DType::F16.as_u8(), 2);
        for d in DType::ALL {
            assert_eq!(DType::from_u8(d.as_u8()), Some(d));
            assert_eq!(DType::try_from(u8::from(d)).ok(), Some(d));
        }
        assert_eq!(DType::from_u8(3), None);
        assert!(matches!(
            DType::try_from(200),
            Err(Error::UnknownDTypeCode(200))
        ));
    }

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().ok(), Some(d));
            assert_eq!(d.to_string(), d.name());
        }
        let spellings = [
            ("float32", DType::F32),
            ("torch.float32", DType::F32),
            ("bfloat16", DType::BF16),
            ("torch.bfloat16", DType::BF16),
            ("BF16", DType::BF16),
            ("float16", DType::F16),
            ("torch.float16", DType::F16),
        ];
        for (s, d) in spellings {
            assert_eq!(s.parse::<DType>().ok(), Some(d), "{s}");
        }
        assert!(matches!("int8".parse::<DType>(), Err(Error::UnknownDTypeName(s)) if s == "int8"));
    }

    #[test]
    fn sizes_match_types() {
        assert_eq!(DType::F32.size_bytes(), std::mem::size_of::<f32>());
        assert_eq!(DType::BF16.size_bytes(), std::mem::size_of::<bf16>());
        assert_eq!(DType::F16.size_bytes(), std::mem::size_of::<f16>());
        assert_eq!(<f32 as Element>::DTYPE, DType::F32);
        assert_eq!(<bf16 as Element>::DTYPE, DType::BF16);
        assert_eq!(<f16 as Element>::DTYPE, DType::F16);
    }
}

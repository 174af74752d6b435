"""QuantScheme: the numeric format of a quantized weight (and, optionally, of the activations that
meet it in the matmul), and named presets.

A scheme says only *what* the stored numbers are (bit width, grid, granularity) and how the layer's
input is quantized at run time. How the weight numbers are chosen (RTN, AWQ, GPTQ) is an algorithm
knob and lives in the stage config.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

BITS = {"int8": 8, "int7": 7, "int6": 6, "int5": 5, "int4": 4, "int3": 3, "int2": 2, "fp8_e4m3": 8, "fp8_e5m2": 8, "fp4_e2m1": 4}
FP8_MAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}  # largest finite value of float8_e4m3fn / float8_e5m2
FLOAT_MAX = {**FP8_MAX, "fp4_e2m1": 6.0}  # every float element grid (fp4 e2m1: microscale.py)
# Block-scale encodings of the microscaling formats: float8_e4m3 (NVFP4: one e4m3 scale per 16 values and one
# fp32 scale per tensor) and e8m0 (OCP MX: a power of two per 32 values). microscale.py holds the arithmetic.
MICRO_SCALE_DTYPES = ("float8_e4m3", "e8m0")
SCALE_DTYPES = ("float16", "bfloat16", "float32") + MICRO_SCALE_DTYPES
ACT_DTYPES = ("int8", "int4", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1")


def _micro_problem(dtype: str, granularity: str, scale_dtype: str | None) -> str | None:
    """Why an element dtype / granularity / scale dtype combination is not a valid format (None: it is)."""
    if dtype == "fp4_e2m1" and scale_dtype not in MICRO_SCALE_DTYPES:
        return ("fp4_e2m1 values need block scales: scale_dtype float8_e4m3 (NVFP4, group_size 16) or e8m0 "
                "(MXFP4, group_size 32)")
    if scale_dtype in MICRO_SCALE_DTYPES:
        if granularity != "group":
            return f"scale_dtype {scale_dtype} is a block (group) scale; set granularity: group"
        if dtype not in ("fp4_e2m1", "fp8_e4m3"):
            return f"scale_dtype {scale_dtype} goes with fp4_e2m1 or fp8_e4m3 values (NVFP4, MXFP4, MXFP8)"
        if scale_dtype == "float8_e4m3" and dtype != "fp4_e2m1":
            return "e4m3 block scales are NVFP4's (fp4_e2m1 values); MXFP8 uses scale_dtype e8m0"
    return None


@dataclass(frozen=True)
class ActScheme:
    """How a layer's input is quantized at run time.

    granularity token: one scale per token (row of x), computed on the fly (dynamic);
    granularity tensor: one scale for the whole input, either on the fly (dynamic) or fixed from
    calibration (dynamic: false, stored as the layer's `input_scale`).
    symmetric: absmax scaling (int8 codes in [-127, 127]); false: min/max with a zero point (int8 only).
    outlier_threshold (LLM.int8, Dettmers et al. 2022, arXiv:2208.07339): input features whose magnitude
    reaches it are computed in 16-bit floating point and the rest in int8. outliers: dynamic picks the
    columns per batch (as bitsandbytes does); static fixes them from calibration (`outlier_cols`).
    outlier_scaling: what the per-row int8 scale of the remaining features sees. exclude_columns (the
    paper's decomposition) takes the row absmax over the non-outlier features only; exclude_elements
    (bitsandbytes' implementation) leaves out only the elements at or above the threshold, so the
    sub-threshold values of an outlier column still set the row scale, and quantizes from float16.
    """

    dtype: Literal["int8", "int4", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"] = "int8"
    granularity: Literal["token", "tensor", "group"] = "token"
    dynamic: bool = True
    symmetric: bool = True
    outlier_threshold: float | None = None
    outliers: Literal["dynamic", "static"] = "dynamic"
    outlier_scaling: Literal["exclude_columns", "exclude_elements"] = "exclude_columns"
    # granularity group (microscaling activations): block scales computed on the fly per `group_size` input
    # features, encoded as `scale_dtype`. NVFP4 (float8_e4m3) also has one fp32 scale for the tensor: calibrated
    # (dynamic: false, the layer's input_scale holds amax / (448 * 6), compressed-tensors' input_global_scale
    # inverted) or taken from each input (dynamic: true). MX (e8m0) block scales need nothing else.
    group_size: int | None = None
    scale_dtype: Literal["float8_e4m3", "e8m0"] | None = None

    def __post_init__(self):
        if self.dtype not in ACT_DTYPES:
            raise ValueError(f"activation dtype={self.dtype!r}; use one of {list(ACT_DTYPES)}")
        if self.granularity not in ("token", "tensor", "group"):
            raise ValueError(f"activation granularity={self.granularity!r}; use 'token', 'tensor' or 'group'")
        if self.granularity == "group":
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 2:
                raise ValueError(f"group activations need an integer group_size >= 2, got {self.group_size!r} "
                                 "(NVFP4: 16, MX: 32)")
            if self.scale_dtype not in MICRO_SCALE_DTYPES:
                raise ValueError("group activations are microscaled: set scale_dtype float8_e4m3 (NVFP4) or e8m0 (MX)")
            if (why := _micro_problem(self.dtype, "group", self.scale_dtype)) is not None:
                raise ValueError(f"activations: {why}")
            if self.scale_dtype == "e8m0" and not self.dynamic:
                raise ValueError("MX activation scales are computed per block on the fly; set dynamic: true")
        else:
            if self.group_size is not None or self.scale_dtype is not None:
                raise ValueError("group_size / scale_dtype for activations need granularity: group")
            if self.dtype == "fp4_e2m1":
                raise ValueError("fp4_e2m1 activations need block scales: granularity: group, group_size 16, "
                                 "scale_dtype float8_e4m3 (NVFP4) or group_size 32, scale_dtype e8m0 (MXFP4)")
        if not self.dynamic and self.granularity not in ("tensor", "group"):
            raise ValueError("static activation scales (dynamic: false) are per tensor; set granularity: tensor "
                             "or dynamic: true")
        if not self.dynamic and not self.symmetric:
            raise ValueError("static activation scales are symmetric (absmax); remove symmetric: false")
        if not self.symmetric and self.dtype != "int8":
            raise ValueError(f"{self.dtype} activations are symmetric; remove symmetric: false")
        if self.outlier_threshold is not None:
            if self.dtype != "int8" or not self.symmetric or self.granularity != "token" or not self.dynamic:
                raise ValueError("outlier_threshold (LLM.int8) goes with dynamic symmetric int8 per-token activations")
            if not self.outlier_threshold > 0:
                raise ValueError(f"outlier_threshold must be > 0 (LLM.int8 uses 6.0), got {self.outlier_threshold}")
        if self.outlier_scaling not in ("exclude_columns", "exclude_elements"):
            raise ValueError(f"outlier_scaling={self.outlier_scaling!r}; use 'exclude_columns' (the paper) or "
                             "'exclude_elements' (bitsandbytes)")
        if self.outliers not in ("dynamic", "static"):
            raise ValueError(f"outliers={self.outliers!r}; use 'dynamic' (per batch) or 'static' (from calibration)")

    @property
    def qmax(self) -> float:
        """The largest code magnitude: what a per-tensor (static) scale maps the absmax onto. For NVFP4 that is
        448 * 6 (the global scale takes the tensor's absmax to e4m3's top times e2m1's)."""
        if self.scale_dtype == "float8_e4m3":
            return 448.0 * FLOAT_MAX[self.dtype]
        if self.dtype in FLOAT_MAX:
            return FLOAT_MAX[self.dtype]
        return 7.0 if self.dtype == "int4" else 127.0

    @property
    def name(self) -> str:
        if self.granularity == "group":
            how = "dyn" if self.dynamic else "static-global"
            return f"a-{self.dtype}-g{self.group_size}-{self.scale_dtype}-{how}"
        if self.outlier_threshold is not None:
            rule = "-bnb" if self.outlier_scaling == "exclude_elements" else ""
            return f"a8-llmint8-{self.outliers}-t{self.outlier_threshold:g}{rule}"
        how = "dyn" if self.dynamic else "static"
        return f"a-{self.dtype}-{self.granularity}-{how}{'' if self.symmetric else '-asym'}"


@dataclass(frozen=True)
class QuantScheme:
    """Integer weight format.

    granularity  scale shape for a weight [out, in]
    -----------  ------------------------------------
    tensor       []                (one scale)
    channel      [out, 1]          (one per output row)
    group        [out, in // group_size]
    block        [out // group_size, in // group_size]   (square tiles, fp8 only: DeepSeek-V3's 128x128)

    symmetric=True is absmax scaling: q = round(w / s), s = absmax / (2**(b-1) - 1),
    codes in [-2**(b-1), 2**(b-1) - 1]. symmetric=False is zero-point (min/max) scaling:
    q = round(w / s) + z, s = (max - min) / (2**b - 1), codes in [0, 2**b - 1]; the range
    always contains 0 so that zero weights stay exact.

    fp8 dtypes store w / s as real float8 values (torch.float8_e4m3fn / float8_e5m2, saturating at the
    format's largest finite value), s = absmax / fp8_max; they are symmetric.
    `act` (None = weight-only) says how the input is quantized for the matmul (W8A8, fp8 W8A8, LLM.int8).
    zero_point_dtype (asymmetric integer grids): uint8 holds integer zero points, the layout every checkpoint
    format and kernel reads; float16 holds fractional ones (HQQ's), w = (q - z) * s with z not on the grid.
    """

    dtype: Literal["int8", "int7", "int6", "int5", "int4", "int3", "int2", "fp8_e4m3", "fp8_e5m2", "fp4_e2m1"] = "int4"
    granularity: Literal["tensor", "channel", "group", "block"] = "group"
    group_size: int | None = 128
    symmetric: bool = True
    scale_dtype: Literal["float16", "bfloat16", "float32", "float8_e4m3", "e8m0"] = "float16"
    act: ActScheme | None = None
    zero_point_dtype: Literal["uint8", "float16"] = "uint8"

    def __post_init__(self):
        if self.dtype not in BITS:
            raise ValueError(f"dtype={self.dtype!r} is not supported; use one of {sorted(BITS)}")
        if self.granularity not in ("tensor", "channel", "group", "block"):
            raise ValueError(f"granularity={self.granularity!r}; use 'tensor', 'channel', 'group' or 'block'")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype={self.scale_dtype!r}; use one of {list(SCALE_DTYPES)}")
        if (why := _micro_problem(self.dtype, self.granularity, self.scale_dtype)) is not None:
            raise ValueError(why)
        if self.is_float and not self.symmetric:
            raise ValueError(f"{self.dtype} weights are symmetric (absmax scaled); remove symmetric: false")
        if self.zero_point_dtype not in ("uint8", "float16"):
            raise ValueError(f"zero_point_dtype={self.zero_point_dtype!r}; use 'uint8' (integer zero points) or "
                             "'float16' (fractional, HQQ)")
        if self.zero_point_dtype == "float16" and (self.symmetric or self.is_float):
            raise ValueError("zero_point_dtype: float16 (fractional zero points) needs an asymmetric integer scheme; "
                             "set symmetric: false, or remove zero_point_dtype")
        if self.granularity == "block" and not self.is_float:
            raise ValueError("granularity='block' (square tiles) is for fp8 weights; integer schemes use 'group'")
        if self.act is not None and self.act.outlier_threshold is not None and \
                (self.dtype != "int8" or self.granularity != "channel" or not self.symmetric):
            raise ValueError("LLM.int8 (act.outlier_threshold) needs int8 symmetric per-channel weights")
        if self.granularity in ("group", "block"):
            if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size < 2:
                raise ValueError(f"granularity={self.granularity!r} needs an integer group_size >= 2, got "
                                 f"{self.group_size!r} (common: 32, 64, 128)")
        elif self.group_size is not None:
            # A group size with another granularity is almost always a typo in a recipe: refuse it.
            raise ValueError(f"group_size={self.group_size} only applies to granularity 'group' or 'block' "
                             f"(got granularity={self.granularity!r}); remove group_size or set granularity: group")

    @property
    def bits(self) -> int:
        return BITS[self.dtype]

    @property
    def is_float(self) -> bool:
        """fp8 and fp4 formats: the stored values are floats, not integer codes."""
        return self.dtype in FLOAT_MAX

    @property
    def fp8_max(self) -> float:
        """The largest element of a float grid (448 for e4m3, 6 for e2m1)."""
        return FLOAT_MAX[self.dtype]

    @property
    def is_micro(self) -> bool:
        """A microscaling format (NVFP4, MXFP4, MXFP8): block scales in float8_e4m3 or e8m0."""
        return self.scale_dtype in MICRO_SCALE_DTYPES

    @property
    def has_global_scale(self) -> bool:
        """NVFP4: one fp32 scale per tensor above the e4m3 block scales."""
        return self.scale_dtype == "float8_e4m3"

    @property
    def micro_name(self) -> str | None:
        """NVFP4 / MXFP4 / MXFP8 for the standard microscaling layouts, None otherwise."""
        if self.scale_dtype == "float8_e4m3":
            return "NVFP4" if self.group_size == 16 else None
        if self.scale_dtype == "e8m0" and self.group_size == 32:
            return {"fp4_e2m1": "MXFP4", "fp8_e4m3": "MXFP8"}[self.dtype]
        return None

    @property
    def qmin(self) -> int:
        return -(2 ** (self.bits - 1)) if self.symmetric else 0

    @property
    def qmax(self) -> int:
        return 2 ** (self.bits - 1) - 1 if self.symmetric else 2 ** self.bits - 1

    @property
    def name(self) -> str:
        gran = {"tensor": "tensor", "channel": "channel", "block": f"b{self.group_size}"}.get(
            self.granularity, f"g{self.group_size}")
        base = f"{self.dtype}-{gran}-{'sym' if self.symmetric else 'asym'}"
        base += {"float8_e4m3": "-e4m3scale", "e8m0": "-e8m0scale"}.get(self.scale_dtype, "")
        base += "-fz16" if self.zero_point_dtype == "float16" else ""
        return base if self.act is None else f"{base}+{self.act.name}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "QuantScheme":
        act = d.get("act")
        return cls(**{**d, "act": None if act is None else ActScheme(**act)})


def scheme(dtype: str, granularity: str = "group", group_size: int | None = 128, symmetric: bool = True,
           scale_dtype: str = "float16", act: ActScheme | None = None) -> QuantScheme:
    """Build a scheme, dropping group_size when the granularity has none."""
    return QuantScheme(dtype, granularity, group_size if granularity in ("group", "block") else None, symmetric,
                       scale_dtype, act)


def replace_granularity(s: QuantScheme, granularity: str, group_size: int | None = None) -> QuantScheme:
    """The same format with another granularity (e.g. one group seen as a channel)."""
    return replace(s, granularity=granularity, group_size=group_size if granularity in ("group", "block") else None)


# Presets. Names follow compressed-tensors where one exists, so vLLM docs apply.
W4A16 = QuantScheme("int4", "group", 128, True)
W4A16_G64 = replace(W4A16, group_size=64)  # SmolLM2-135M: 576 % 128 != 0
W4A16_ASYM_G64 = replace(W4A16_G64, symmetric=False)
W8A16 = QuantScheme("int8", "channel", None, True)
W8A16_ASYM = replace(W8A16, symmetric=False)
W3A16_G64 = QuantScheme("int3", "group", 64, True)
# 8-bit weights and activations. int8 weights per output channel; compressed-tensors' W8A8 is per-token dynamic.
A8_TOKEN = ActScheme("int8", "token", dynamic=True)
W8A8 = QuantScheme("int8", "channel", None, True, "float32", A8_TOKEN)
W8A8_STATIC = replace(W8A8, act=ActScheme("int8", "tensor", dynamic=False))
W8A8_ASYM = QuantScheme("int8", "channel", None, False, "float32", ActScheme("int8", "token", symmetric=False))
LLM_INT8 = replace(W8A8, act=replace(A8_TOKEN, outlier_threshold=6.0))  # bitsandbytes' default threshold
LLM_INT8_STATIC = replace(W8A8, act=replace(A8_TOKEN, outlier_threshold=6.0, outliers="static"))
LLM_INT8_BNB = replace(W8A8, act=replace(A8_TOKEN, outlier_threshold=6.0, outlier_scaling="exclude_elements"))
# fp8 (e4m3). Names follow compressed-tensors: FP8 = per-tensor weights + static per-tensor activations,
# FP8_DYNAMIC = per-channel weights + dynamic per-token activations, FP8_BLOCK = 128x128 weight tiles.
FP8_W8A16 = QuantScheme("fp8_e4m3", "channel", None, True, "float32")
FP8 = QuantScheme("fp8_e4m3", "tensor", None, True, "float32", ActScheme("fp8_e4m3", "tensor", dynamic=False))
FP8_DYNAMIC = replace(FP8_W8A16, act=ActScheme("fp8_e4m3", "token"))
FP8_BLOCK = QuantScheme("fp8_e4m3", "block", 128, True, "float32", ActScheme("fp8_e4m3", "token"))
FP8_E5M2_DYNAMIC = QuantScheme("fp8_e5m2", "channel", None, True, "float32", ActScheme("fp8_e5m2", "token"))

# Microscaling formats (compressed-tensors' preset names). NVFP4: e2m1 values, an e4m3 scale per 16 and an fp32
# scale per tensor, activations the same with block scales on the fly and a calibrated global scale (what
# compressed-tensors calls dynamic "local"). MX: a power-of-two (e8m0) scale per 32; activations dynamic.
NVFP4A16 = QuantScheme("fp4_e2m1", "group", 16, True, "float8_e4m3")
NVFP4 = replace(NVFP4A16, act=ActScheme("fp4_e2m1", "group", dynamic=False, group_size=16, scale_dtype="float8_e4m3"))
MXFP4A16 = QuantScheme("fp4_e2m1", "group", 32, True, "e8m0")
MXFP4 = replace(MXFP4A16, act=ActScheme("fp4_e2m1", "group", group_size=32, scale_dtype="e8m0"))
MXFP8A16 = QuantScheme("fp8_e4m3", "group", 32, True, "e8m0")
MXFP8 = replace(MXFP8A16, act=ActScheme("fp8_e4m3", "group", group_size=32, scale_dtype="e8m0"))
# the W4A4 integer baseline the NVFP4 W4A4 row is compared with: int4 g16 weights, int4 per-token activations
W4A4_INT = QuantScheme("int4", "group", 16, True, "float16", ActScheme("int4", "token"))

PRESETS: dict[str, QuantScheme] = {
    "W4A16": W4A16,
    "W4A16_G64": W4A16_G64,
    "W4A16_ASYM_G64": W4A16_ASYM_G64,
    "W8A16": W8A16,
    "W8A16_ASYM": W8A16_ASYM,
    "W3A16_G64": W3A16_G64,
    "W8A8": W8A8,
    "W8A8_STATIC": W8A8_STATIC,
    "W8A8_ASYM": W8A8_ASYM,
    "LLM_INT8": LLM_INT8,
    "LLM_INT8_STATIC": LLM_INT8_STATIC,
    "LLM_INT8_BNB": LLM_INT8_BNB,
    "FP8_W8A16": FP8_W8A16,
    "FP8": FP8,
    "FP8_DYNAMIC": FP8_DYNAMIC,
    "FP8_BLOCK": FP8_BLOCK,
    "FP8_E5M2_DYNAMIC": FP8_E5M2_DYNAMIC,
    "NVFP4A16": NVFP4A16,
    "NVFP4": NVFP4,
    "MXFP4A16": MXFP4A16,
    "MXFP4": MXFP4,
    "MXFP8A16": MXFP8A16,
    "MXFP8": MXFP8,
    "W4A4_INT": W4A4_INT,
}


def get_preset(name: str) -> QuantScheme:
    if name not in PRESETS:
        raise ValueError(f"unknown scheme preset {name!r}; known presets: {sorted(PRESETS)} "
                         "(or give a mapping: {dtype: int4, granularity: group, group_size: 64, symmetric: true})")
    return PRESETS[name]

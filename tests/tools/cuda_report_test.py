#!/usr/bin/env python3
"""tools/cuda_report.py: the occupancy it derives and its reading of cuobjdump's output."""
import shutil
import sys
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import cuda_report as cr  # noqa: E402


def kernel(arch, regs, threads, shared=0):
    return cr.Kernel(arch, "k", regs, 0, shared, 0, threads)


class Occupancy(unittest.TestCase):
    # Worked by hand with the CUDA occupancy calculator's rules for compute capability 8.0 and 9.0.
    def test_registers(self):
        self.assertEqual(cr.occupancy(kernel("sm_80", 64, 256)), (32, "regs"))
        self.assertEqual(cr.occupancy(kernel("sm_80", 128, 256)), (16, "regs"))
        # 130 registers round up to 136: 4352 a warp, three warps in each 16K partition.
        self.assertEqual(cr.occupancy(kernel("sm_80", 130, 256)), (8, "regs"))
        self.assertEqual(cr.occupancy(kernel("sm_90a", 255, 128)), (8, "regs"))
        self.assertEqual(cr.occupancy(kernel("sm_90a", 168, 128)), (12, "regs"))

    def test_threads_and_cta_cap(self):
        self.assertEqual(cr.occupancy(kernel("sm_80", 32, 256)), (64, "threads"))
        self.assertEqual(cr.occupancy(kernel("sm_90a", 24, 1024)), (64, "threads"))
        self.assertEqual(cr.occupancy(kernel("sm_80", 32, 32)), (32, "ctas"))

    def test_shared_memory(self):
        # With the 1 KB the driver reserves per CTA: three CTAs of 48 KB in A100's 164 KB, four
        # of 49 KB in H100's 228 KB. 33587 B a CTA would fit five times in 164 KB, but it takes
        # 33664 (128 B units): four.
        self.assertEqual(cr.occupancy(kernel("sm_80", 32, 128, 48 * 1024)), (12, "shared"))
        self.assertEqual(cr.occupancy(kernel("sm_90a", 32, 128, 49 * 1024)), (16, "shared"))
        self.assertEqual(cr.occupancy(kernel("sm_80", 32, 128, 33587 - 1024)), (16, "shared"))

    def test_unknown(self):
        self.assertEqual(cr.occupancy(kernel("sm_80", 32, None)), (0, "?"))
        self.assertEqual(cr.occupancy(kernel("sm_75", 32, 256)), (0, "?"))


RES_USAGE = """
Fatbin ptx code:
================
arch = sm_90a
code version = [9,0]

Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

Resource usage:
 Common:
  GLOBAL:300 CONSTANT[4]:240
 Function _ZN6qflash7kernels15expert_ffn_cuda12group_kernelINS_4arch5Sm90aEEEvPKiiiiibiPNS1_4TileEPiS9_S9_S9_:
  REG:50 STACK:0 SHARED:5280 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z1kPfPKf:
  REG:32 STACK:16744 SHARED:0 LOCAL:0 CONSTANT[0]:368 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

ELF = """
Fatbin elf code:
================
arch = sm_90a

.nv.info._ZN6qflash7kernels15expert_ffn_cuda12group_kernelINS_4arch5Sm90aEEEvPKiiiiibiPNS1_4TileEPiS9_S9_S9_
	<0x1>
	Attribute:	EIATTR_CUDA_API_VERSION
	Format:	EIFMT_SVAL
	Value:	0x82 
	<0x13>
	Attribute:	EIATTR_MAX_THREADS
	Format:	EIFMT_SVAL
	Value:	0x400 0x1 0x1 
	<0x14>
	Attribute:	EIATTR_CRS_STACK_SIZE
	Format:	EIFMT_SVAL
	Value:	0x0 
.nv.info._Z1kPfPKf
	<0x1>
	Attribute:	EIATTR_CUDA_API_VERSION
	Format:	EIFMT_SVAL
	Value:	0x82 
"""


PTX = """
.version 9.0
.target sm_80
.extern .shared .align 16 .b8 _ZN2ns4smemE[];
.func (.param .b32 func_retval0) helper(
)
{
mov.u32 %r1, _ZN2ns4smemE;
}
.visible .entry _Z6staticPf(
.param .u64 _Z6staticPf_param_0
)
{
.shared .align 4 .b8 _ZZ6staticPfE4tile[64];
mov.u32 %r1, _ZZ6staticPfE4tile;
}
.visible .entry _Z4dynsPf(
.param .u64 _Z4dynsPf_param_0
)
{
mov.u32 %r2, _ZN2ns4smemE;
}
"""


class Parsing(unittest.TestCase):
    def test_resources_and_launch_bounds(self):
        found = cr.parse_resources(RES_USAGE.splitlines())
        group = "_ZN6qflash7kernels15expert_ffn_cuda12group_kernelINS_4arch5Sm90aEEEvPKiiiiibiPNS1_4TileEPiS9_S9_S9_"
        self.assertEqual(set(found), {("sm_90a", group), ("sm_90a", "_Z1kPfPKf")})
        k = found[("sm_90a", group)]
        self.assertEqual((k.regs, k.stack, k.shared, k.local), (50, 0, 5280, 0))
        self.assertEqual(found[("sm_90a", "_Z1kPfPKf")].stack, 16744)
        # A kernel without __launch_bounds__ has no EIATTR_MAX_THREADS.
        self.assertEqual(cr.parse_max_threads(ELF.splitlines()), {("sm_90a", group): 1024})

    def test_dynamic_shared(self):
        self.assertEqual(cr.parse_dynamic_shared(PTX.splitlines()), {"_Z4dynsPf"})


    @unittest.skipUnless(shutil.which("c++filt"), "needs c++filt (binutils)")
    def test_short_names(self):
        enums = {"WeightFormat": {1: "Bf16", 7: "Int4"}}
        sym = "_ZN6qflash7kernels11linear_cuda13linear_kernelINS_4arch4Sm80ELNS_12WeightFormatE7ELb1EEEvNS1_6ParamsE"
        mma = "_ZN6qflash7kernels11linear_cuda3mma10mma_kernelINS_4arch4Sm80ELi4ELi2EEEvNS2_6ParamsE"
        names = cr.short_names([sym, mma, "_Z1kPfPKf"], enums)
        self.assertEqual(names[sym], ("linear", "linear_kernel<Int4, true>"))
        self.assertEqual(names[mma], ("linear/mma", "mma_kernel<4, 2>"))
        self.assertEqual(names["_Z1kPfPKf"], ("(global)", "k"))

    def test_enum_names(self):
        enums = cr.enum_names(Path(__file__).resolve().parents[2])
        self.assertEqual(enums["WeightFormat"][1], "Bf16")
        self.assertEqual(enums["WeightFormat"][7], "Int4")


if __name__ == "__main__":
    unittest.main()

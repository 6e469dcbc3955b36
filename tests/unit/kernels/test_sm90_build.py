"""What the sm_90a decode kernels compile to, checked on the built extension (no GPU needed).

Register spills turned up three times while tuning the kernel (each time from a change that looked
harmless); in its main loop they would add local-memory traffic to every page.  So the SASS of
every instantiation must stay free of local loads and stores and must contain the FP8 (QGMMA)
and BF16 (HGMMA) tensor-core instructions the design relies on.  Skips when the extension or its
sm_90a code is not built, or no ``cuobjdump`` is found (CUDA toolkit or Triton's bundled copy).
"""

import os
import re
import shutil
import subprocess

import pytest

from vllm_snapmla._native import missing_reason


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                           "cuobjdump")
    return bundled if os.access(bundled, os.X_OK) else None


def _dump(option: str, what: str) -> str:
    """``cuobjdump OPTION -arch sm_90a`` of the built extension; skips without one or the other."""
    try:
        import vllm_snapmla._C as native
    except ImportError:
        pytest.skip(missing_reason())
    tool = _cuobjdump()
    if tool is None:
        pytest.skip(f"no cuobjdump (CUDA toolkit or triton) to read the {what} with")
    return subprocess.run([tool, option, "-arch", "sm_90a", native.__file__],
                          capture_output=True, text=True, timeout=300).stdout


_NO_KERNEL = "the extension has no sm_90a decode kernel (SNAPMLA_ARCHS without 90a)"
# The 64-row decode_kernel<schedule> and the narrow decode_narrow_kernel<rows>.
_DECODE_KERNEL = re.compile(r"decode(_narrow)?_kernel")


@pytest.fixture(scope="module")
def launch_registers() -> dict[str, int]:
    """Registers per thread each sm_90a decode kernel launches with (``cuobjdump -res-usage``)."""
    usage = _dump("-res-usage", "resource usage")
    found = {name: int(regs) for name, regs in
             re.findall(r"Function (\S*decode\S*_kernel\S*):\s*REG:(\d+)", usage)
             if _DECODE_KERNEL.search(name)}
    if not found:
        pytest.skip(_NO_KERNEL)
    return found


@pytest.fixture(scope="module")
def sass_functions() -> list[tuple[str, str]]:
    """(mangled name, SASS text) of every sm_90a function of the extension, dumped once."""
    sass = _dump("-sass", "SASS")
    return re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S)


@pytest.fixture(scope="module")
def decode_kernels(sass_functions) -> dict[str, str]:
    """SASS text of each sm_90a decode kernel instantiation, by mangled name."""
    kernels = {name: body for name, body in sass_functions if _DECODE_KERNEL.search(name)}
    if not kernels:
        pytest.skip(_NO_KERNEL)
    return kernels


def test_every_variant_is_built(decode_kernels):
    # the 64-row kernel's free and split-roles schedules, the narrow kernel's 16 and 32 rows
    kinds = sorted(re.search(r"(decode(?:_narrow)?_kernel)ILi(\d+)E", name).groups()
                   for name in decode_kernels)
    assert kinds == [("decode_kernel", "0"), ("decode_kernel", "1"),
                     ("decode_narrow_kernel", "16"), ("decode_narrow_kernel", "32")], kinds


def test_no_register_spills(decode_kernels):
    for name, body in decode_kernels.items():
        local = re.findall(r"\b(LDL|STL)\b", body)
        assert not local, f"{name}: {len(local)} local-memory instructions (register spills)"


def test_tensor_core_instructions(decode_kernels):
    for name, body in decode_kernels.items():
        counts = tuple(len(re.findall(pattern, body)) for pattern in (
            r"QGMMA\.64x32x32\.F32\.E4M3\.E4M3", r"QGMMA\.64x64x32\.F32\.E4M3\.E4M3",
            r"QGMMA\.64x128x32\.F32\.E4M3\.E4M3", r"HGMMA\.64x64x16\.F32\.BF16",
            r"LDSM\.16\.MT88\.4", r"STSM\.16\.M88\.4"))
        # Per page, as (m64n32k32, m64n64k32, m64n128k32 e4m3, m64n64k16 bf16) WGMMAs: RoPE QK
        # 64 / 16 BF16 steps.  Content QK 512 / 32 FP8 steps per 32-token half (n32), or
        # per 64-token page (n64) in kScheduleSplitRoles (1).  PV 64 / 32 steps per piece:
        # 4 promoted 64-column quarters (n64); kScheduleSplitRoles has one PV per warpgroup,
        # WG1's 3 pieces of 64 columns and WG2's 10 of 32, and both page loops in two copies
        # (one per ring stage).
        # Then the V^T build of a 256-column half, 8 ldmatrix.x4.trans and 8 stmatrix.x4, in
        # two paths (full and partial pages): once in the free schedule, in each of WG2's two
        # loop copies in split-roles.
        if "narrow" in name:
            continue   # test_narrow_tensor_core_instructions
        if "ILi1E" in name:
            expected = (2 * 10 * 2, 2 * (16 + 3 * 2), 0, 2 * 4, 2 * 16, 2 * 16)
        else:
            expected = (32, 8, 0, 4, 16, 16)
        assert counts == expected, (name, counts)


def test_narrow_tensor_core_instructions(decode_kernels):
    for name, body in decode_kernels.items():
        if "narrow" not in name:
            continue
        rows = int(re.search(r"narrow_kernelILi(\d+)E", name).group(1))
        counts = tuple(len(re.findall(pattern, body)) for pattern in (
            rf"QGMMA\.64x{rows}x32\.F32\.E4M3\.E4M3", rf"HGMMA\.64x{rows}x16\.F32\.BF16",
            r"[QH]GMMA\.64x(?!{rows}x)".replace("{rows}", str(rows)),
            r"LDSM\.16\.MT88\.4", r"STSM\.16\.M88\.4"))
        # Per page, with N = the rows (S^T = K Q^T): content QK 512 / 32 FP8 steps and PV 8
        # M tiles of O^T x 2 k-steps of 32 tokens, all m64nNk32 e4m3 (16 + 16); RoPE QK 64 / 16
        # BF16 steps; no WGMMA of another N.  V^T comes from registers: the 32-row form
        # transposes with one ldmatrix.x4.trans per M tile and k-step (16), the 16-row form with
        # plain loads and byte transposes (0); neither writes V^T back (no stmatrix).
        expected = (16 + 16, 4, 0, 16 if rows == 32 else 0, 0)
        assert counts == expected, (name, counts)


def test_setmaxnreg_budgets_fit_the_register_pool(decode_kernels, launch_registers):
    # setmaxnreg moves registers within the CTA's launch pool (3 warpgroups x the launch count):
    # the consumers' .inc waits until the producer's .dec has freed enough, so a budget over the
    # pool hangs every launch (as 32 + 2 x 240 > 3 x 168 did in a version of one kernel).
    for name, body in decode_kernels.items():
        dealloc = [int(v, 16) for v in
                   re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", body)]
        alloc = [int(v, 16) for v in
                 re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, (0x[0-9a-f]+)", body)]
        assert len(dealloc) == 1 and len(alloc) == 1, (name, dealloc, alloc)
        pool = 3 * launch_registers[name.rstrip(":")]
        assert dealloc[0] + 2 * alloc[0] <= pool, (name, dealloc[0], alloc[0], pool)


# What may run before griddepcontrol.wait: reads of constant banks (kernel parameters) and
# special registers, register moves and integer arithmetic; nothing that touches memory or
# branches (a branch could skip the wait).
_BEFORE_WAIT = {"LDC", "ULDC", "S2R", "S2UR", "CS2R", "MOV", "UMOV", "IMAD", "UIMAD", "IADD3",
                "UIADD3", "LEA", "ULEA", "SHF", "USHF", "LOP3", "ULOP3", "NOP"}


@pytest.fixture(scope="module")
def combine_kernels(sass_functions) -> dict[str, str]:
    """SASS text of the sm_90a split-combine kernels, by mangled name."""
    kernels = {name: body for name, body in sass_functions
               if re.search(r"combine(_wide)?_kernel", name)}
    if not kernels:
        pytest.skip("the extension has no sm_90a combine kernel (SNAPMLA_ARCHS without 90a)")
    return kernels


def test_every_combine_variant_is_built(combine_kernels):
    assert len(combine_kernels) == 2, sorted(combine_kernels)


@pytest.mark.parametrize("kind", ["decode", "combine"])
def test_dependent_kernels_wait_for_the_launch_ahead(kind, request):
    # Each decode kernel is launched as a programmatic dependent of the launch ahead of it, and
    # the combine of the decode kernel (csrc/dependent_launch.h): their CTAs may start while
    # that kernel still writes the query or the partials, so every thread must execute
    # griddepcontrol.wait (ACQBULK) before any memory access.
    for name, body in request.getfixturevalue(f"{kind}_kernels").items():
        code = [line.split("*/", 1)[1].split(";")[0].strip() for line in body.splitlines()
                if re.search(r"/\*[0-9a-f]{4,}\*/", line)]
        waits = [i for i, ins in enumerate(code) if "ACQBULK" in ins.split()]
        assert len(waits) == 1 and code[waits[0]] == "ACQBULK", (name, [code[i] for i in waits])
        before = [ins for ins in code[:waits[0]]
                  if ins.split()[0].split(".")[0] not in _BEFORE_WAIT]
        assert not before, (name, before)

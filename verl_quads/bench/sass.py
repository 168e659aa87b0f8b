"""Offline sm_90 SASS of a Triton kernel (no GPU): compile with triton's bundled ptxas, disassemble with the wheel's
``cuobjdump``, and find the longest loop closed by a backward branch (a decode kernel's K loop; the main loop of a
software-pipelined kernel). Used by ``verl-quads bench rollout --sass-count`` and the GEMV probes' load counts
(:mod:`verl_quads.bench.gemv_probe`)."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_sm90(fn, signature: dict, constexprs: dict, divisible: tuple[str, ...], num_warps: int,
                 num_stages: int):
    """``triton.compile`` of jit function ``fn`` for sm_90: ``signature`` maps argument names to Triton types
    ("*bf16", "i32", "constexpr", ...), ``divisible`` names the arguments specialized as multiples of 16 (pointers
    always are). Returns the compiled kernel (``.asm["cubin"]``, ``["ptx"]``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i, nm in enumerate(signature)
             if signature[nm][0] == "*" or nm in divisible}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def sass_and_loop(kern) -> tuple[list[str], list[str]]:
    """(every SASS instruction of the compiled kernel's cubin, the instructions of its longest backward-branch
    loop), as text without addresses."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    body: list[str] = []
    for addr, text in ins:
        hit = re.search(r"BRA.*0x([0-9a-f]+)", text)
        if hit and int(hit.group(1), 16) < addr:
            loop = [t for a, t in ins if int(hit.group(1), 16) <= a <= addr]
            body = loop if len(loop) > len(body) else body
    return [t for _, t in ins], body

"""Where a compiled FlyDSL kernel's buffer loads land, read from its LLVM IR on CPU (no GPU).

FlyDSL lowers a kernel's index arithmetic to straight-line integer LLVM IR over the workgroup and
workitem ids and the tensors' runtime (shape, stride) structs. `buffer_load_offsets` evaluates that
arithmetic for given ids and tensors and returns the byte offset of every buffer load, grouped by the
kernel argument the buffer was made from: what the kernel would read, checkable against what the
tensors hold. Instructions it does not model (floating point, phis, ...) are skipped; a load whose
offset depends on one of them is reported as None.
"""

from __future__ import annotations

import re

import torch

_DEFINE = re.compile(r"define amdgpu_kernel void @(\w+)\((.*)\)[^{]*\{")
_PARAM = re.compile(r"(ptr addrspace\(1\)|<\{.*?\}>\s*\}>|<\{.*?\}>|i32|i64) (%\d+)")
_INST = re.compile(r"\s*(%[\w.]+) = (.*)")
_INT = re.compile(r"-?\d+")


def _wrap(v: int, bits: int) -> int:
    v &= (1 << bits) - 1
    return v - (1 << bits) if v >> (bits - 1) else v


def _tdiv(a: int, b: int) -> int:
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def _leading(t: torch.Tensor) -> int:
    """FlyDSL's unit-stride axis of a torch argument (MemRefSpec.mark_layout_dynamic: the first stride 1)."""
    return next(i for i, s in enumerate(t.stride()) if s == 1)


def kernel_ir(ll: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """(kernel name, [(param type, param name)], body lines) of the one amdgpu kernel in `ll`."""
    lines = ll.splitlines()
    for i, line in enumerate(lines):
        m = _DEFINE.match(line)
        if m:
            params = [(ty.split()[0], name) for ty, name in _PARAM.findall(m.group(2))]
            body = []
            for rest in lines[i + 1:]:
                if rest.startswith("}"):
                    break
                body.append(rest)
            return m.group(1), params, body
    raise ValueError("no amdgpu kernel in the IR")


def buffer_load_offsets(ll: str, args: tuple, block: tuple[int, int, int], thread: int = 0) -> dict[int, list]:
    """{launcher argument index: [byte offset of each buffer load through it, in program order]}."""
    _, params, body = kernel_ir(ll)
    env: dict[str, object] = {}
    ptr_arg: dict[str, int] = {}
    p = iter(params)
    for index, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            (_, ptr), (_, lay) = next(p), next(p)
            lead = _leading(a)
            ptr_arg[ptr] = index
            env[lay] = (list(a.shape), [s for i, s in enumerate(a.stride()) if i != lead])
        else:
            _, name = next(p)
            env[name] = int(a)
    rsrc: dict[str, int] = {}
    loads: dict[int, list] = {}

    def val(tok: str):
        tok = tok.strip()
        if tok.startswith("%"):
            return env.get(tok)
        return int(tok) if _INT.fullmatch(tok) else None

    ids = {"workgroup.id.x": block[0], "workgroup.id.y": block[1], "workgroup.id.z": block[2],
           "workitem.id.x": thread}
    for line in body:
        m = _INST.match(line)
        if m is None:
            continue
        dst, rhs = m.groups()
        op = rhs.split()[0]
        out = None
        if op == "extractvalue":
            mm = re.match(r"extractvalue .* (%\d+), (\d+), (\d+)$", rhs)
            if mm and mm.group(1) in env:
                out = env[mm.group(1)][int(mm.group(2))][int(mm.group(3))]
        elif op in ("sext", "zext", "trunc"):
            mm = re.match(r"\w+ i\d+ (\S+) to i(\d+)", rhs)
            v = val(mm.group(1))
            if v is not None:
                out = _wrap(v, int(mm.group(2))) if op != "zext" else v & ((1 << int(mm.group(2))) - 1)
        elif op in ("add", "sub", "mul", "srem", "sdiv", "shl", "ashr", "lshr", "and", "or", "xor"):
            mm = re.match(r"\w+(?: nuw| nsw| exact)* i(\d+) ([^,]+), (.+)$", rhs)
            bits, a, b = int(mm.group(1)), val(mm.group(2)), val(mm.group(3))
            if a is not None and b is not None:
                u = (1 << bits) - 1
                out = {"add": lambda: a + b, "sub": lambda: a - b, "mul": lambda: a * b,
                       "srem": lambda: a - b * _tdiv(a, b), "sdiv": lambda: _tdiv(a, b), "shl": lambda: a << b,
                       "ashr": lambda: a >> b, "lshr": lambda: (a & u) >> b, "and": lambda: a & b,
                       "or": lambda: a | b, "xor": lambda: a ^ b}[op]()
                out = _wrap(out, bits)
        elif op == "call" or rhs.startswith("call"):
            mm = re.search(r"@llvm\.amdgcn\.(workgroup\.id\.[xyz]|workitem\.id\.x)\(", rhs)
            if mm:
                out = ids[mm.group(1)]
            elif "@llvm.amdgcn.make.buffer.rsrc" in rhs:
                mm = re.search(r"\(ptr addrspace\(1\) (%\d+)", rhs)
                if mm and mm.group(1) in ptr_arg:
                    rsrc[dst] = ptr_arg[mm.group(1)]
            elif "@llvm.amdgcn.raw.ptr.buffer.load" in rhs:
                mm = re.search(r"\(ptr addrspace\(8\) (%[\w.]+), i32 ([^,]+), i32 ([^,]+),", rhs)
                if mm and mm.group(1) in rsrc:
                    v, s = val(mm.group(2)), val(mm.group(3))
                    loads.setdefault(rsrc[mm.group(1)], []).append(None if v is None or s is None else v + s)
            else:
                mm = re.search(r"@llvm\.(smin|smax)\.i(\d+)\(i\d+ ([^,]+), i\d+ ([^)]+)\)", rhs)
                if mm:
                    a, b = val(mm.group(3)), val(mm.group(4))
                    if a is not None and b is not None:
                        out = min(a, b) if mm.group(1) == "smin" else max(a, b)
        if out is not None:
            env[dst] = out
    return loads


def compiled_ir(launcher, *args) -> str:
    """The LLVM IR (FlyDSL's 21_llvm_ir dump) of a launcher's one kernel, compiled for gfx950 on CPU."""
    import contextlib
    import io
    import tempfile
    from pathlib import Path

    import flydsl.compiler as flyc

    from dspark_sidecar.kernels.flydsl import toolchain

    with tempfile.TemporaryDirectory(prefix="flydsl-ir-") as tmp, toolchain.compile_only():
        with toolchain.scoped_env({"FLYDSL_DUMP_IR": "1", "FLYDSL_DUMP_DIR": tmp}):
            with contextlib.redirect_stdout(io.StringIO()):
                flyc.compile(launcher, *args)
        dumps = sorted(Path(tmp).rglob("*llvm_ir.ll"))
        if len(dumps) != 1:
            raise RuntimeError(f"expected one LLVM IR dump, got {[str(d) for d in dumps]}")
        return dumps[0].read_text()

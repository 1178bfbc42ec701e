"""Ahead-of-time compilation of the routing kernel to PTX / cubin, without a GPU.

``triton.compile`` with an explicit ``GPUTarget`` needs no driver, so every architecture's PTX
is produced and checked on any machine (the tests do it on CPU). What TensorRT's AOT plugin
needs is recorded next to it: kernel name, launch parameters, shared memory, and the kernel's
parameter list.

Two Triton facts matter for TensorRT: (1) a kernel that needs *global scratch* memory cannot
be launched by TensorRT (it passes only inputs, scalars and outputs), so such a kernel is
refused; (2) Triton >= 3.3 appends two pointer parameters (global and profile scratch) to every
kernel. When the kernel body never reads them (checked), they are removed from the PTX entry,
so the PTX signature is exactly TensorRT's argument list; ptxas then assembles that PTX.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from moepipe.errors import EnvironmentMissing, UnsupportedError
from moepipe.plugins import TRITON_VERSION

# name -> compute capability; the PTX targets are Triton's arch-specific ones (sm_90a, sm_100a)
ARCHS = {"sm_80": 80, "sm_90": 90, "sm_100": 100}
# (name, Triton type) of the kernel's runtime arguments, in TensorRT's order
SIGNATURE = (("logits", "*fp32"), ("router_bias", "*fp32"), ("correction_bias", "*fp32"),
             ("num_tokens", "i32"), ("ids", "*i32"), ("weights", "*fp32"),
             ("counts_partial", "*i32"))
_KERNEL_ARGS = ("logits_ptr", "router_bias_ptr", "correction_bias_ptr", "T", "ids_ptr",
                "weights_ptr", "counts_ptr")


@dataclass
class CompiledRouting:
    """One specialisation of the kernel for one architecture."""

    arch: str
    name: str
    ptx: str
    cubin: bytes | None
    ptx_target: str
    num_warps: int
    block_x: int
    grid_x: int
    shared_mem: int
    global_scratch: int
    params: list[str]
    constexprs: dict = field(default_factory=dict)
    triton_version: str = ""

    def record(self) -> dict:
        """What a build records about this kernel (JSON; the PTX itself by hash and size)."""
        return {
            "arch": self.arch, "kernel": self.name, "ptx_target": self.ptx_target,
            "launch": {"grid_x": self.grid_x, "block_x": self.block_x,
                       "shared_mem": self.shared_mem, "num_warps": self.num_warps},
            "global_scratch": self.global_scratch, "params": self.params,
            "ptx_sha256": hashlib.sha256(self.ptx.encode()).hexdigest(),
            "ptx_bytes": len(self.ptx), "cubin_bytes": len(self.cubin or b""),
            "constexprs": self.constexprs, "triton": self.triton_version,
        }


def _triton():
    try:
        import triton
    except ImportError as exc:
        raise EnvironmentMissing("OpenAI Triton is not installed",
                                 f"pip install 'triton=={TRITON_VERSION}'") from exc
    if triton.__version__ != TRITON_VERSION:
        raise EnvironmentMissing(f"Triton {triton.__version__} is installed; the routing "
                                 f"kernel is built and tested with {TRITON_VERSION}",
                                 f"pip install 'triton=={TRITON_VERSION}'")
    return triton


def _entry_params(ptx: str, name: str) -> list[str]:
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if not match:
        raise UnsupportedError(f"kernel {name} not found in its PTX")
    return [p.strip() for p in match.group(1).split(",") if p.strip()]


def _typed_params(ptx: str, name: str) -> list[str]:
    """``name:ptx type`` of each entry parameter, checked against ``SIGNATURE``."""
    types = [p.split()[1] for p in _entry_params(ptx, name)]
    want = [".u64" if typ.startswith("*") else ".u32" for _, typ in SIGNATURE]
    if types != want:
        raise UnsupportedError(f"kernel {name} has PTX parameters {types}, expected {want}")
    return [f"{arg}:{typ}" for (arg, _), typ in zip(SIGNATURE, types, strict=False)]


def strip_scratch_params(ptx: str, name: str, keep: int) -> str:
    """Remove the entry parameters after the first ``keep`` (Triton's scratch pointers) when
    the kernel body never reads them; refuse when it does."""
    params = _entry_params(ptx, name)
    extra = params[keep:]
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    for p in extra:
        pname = p.split()[-1]
        if re.search(r"\b" + re.escape(pname) + r"\b", body):
            raise UnsupportedError(f"kernel {name} reads its scratch parameter {pname}",
                                   "TensorRT passes only inputs, scalars and outputs")
    if not extra:
        return ptx
    head = ",\n\t".join(params[:keep])
    return re.sub(r"(\.entry\s+" + re.escape(name) + r"\s*\().*?(\))",
                  lambda m: m.group(1) + "\n\t" + head + "\n" + m.group(2), ptx, count=1,
                  flags=re.S)


def ptxas_path(arch: str) -> str:
    """The ptxas that ships with Triton for ``arch`` (Triton's own choice: a newer one for
    Blackwell)."""
    _triton()
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(ARCHS[arch]).path


def assemble(ptx: str, arch: str, ptx_target: str) -> bytes:
    """PTX -> cubin with Triton's bundled ptxas (what a driver would JIT on the GPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        proc = subprocess.run([ptxas_path(arch), f"--gpu-name={ptx_target}", str(src),
                               "-o", str(out)], capture_output=True, text=True, timeout=300)
        if proc.returncode:
            raise UnsupportedError(f"ptxas rejected the routing kernel: {proc.stderr.strip()}")
        return out.read_bytes()


def compile_routing(spec, arch: str, *, cubin: bool = True) -> CompiledRouting:
    """Compile the kernel specialised for ``spec`` (a ``RoutingSpec``) for ``arch``
    (``sm_80``, ``sm_90``, ``sm_100``) without a GPU."""
    if arch not in ARCHS:
        raise UnsupportedError(f"architecture {arch!r} is not a routing-kernel target",
                               f"targets: {', '.join(ARCHS)}")
    triton = _triton()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moepipe.plugins.kernel import constexprs, launch_config, moe_route

    config = launch_config(spec)
    consts = constexprs(spec, config)
    signature = {arg: typ for arg, (_, typ) in zip(_KERNEL_ARGS, SIGNATURE, strict=True)}
    signature.update({name: "constexpr" for name in consts})
    kernel = triton.compile(ASTSource(fn=moe_route, signature=signature, constexprs=consts),
                            target=GPUTarget("cuda", ARCHS[arch], 32),
                            options={"num_warps": config.num_warps})
    meta = kernel.metadata
    if meta.global_scratch_size or getattr(meta, "profile_scratch_size", 0):
        raise UnsupportedError(
            f"the routing kernel for {arch} needs {meta.global_scratch_size} bytes of global "
            "scratch", "TensorRT's AOT plugin cannot provide scratch memory; this is a bug")
    ptx = strip_scratch_params(kernel.asm["ptx"], meta.name, len(SIGNATURE))
    found = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    if found is None:
        raise UnsupportedError(f"the routing kernel's PTX for {arch} names no .target")
    target = found.group(1)
    return CompiledRouting(
        arch=arch, name=meta.name, ptx=ptx, cubin=assemble(ptx, arch, target) if cubin else None,
        ptx_target=target, num_warps=meta.num_warps, block_x=meta.num_warps * 32,
        grid_x=config.num_programs, shared_mem=meta.shared, global_scratch=meta.global_scratch_size,
        params=_typed_params(ptx, meta.name), constexprs=consts,
        triton_version=triton.__version__)


def write_kernels(spec, archs, out: Path, *, cubin: bool = True) -> list[dict]:
    """Compile ``spec`` for each of ``archs`` into ``out``: ``moe_route.<arch>.ptx`` (and
    ``.cubin``) plus ``kernels.json`` with every kernel's record."""
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for arch in archs:
        kernel = compile_routing(spec, arch, cubin=cubin)
        (out / f"{kernel.name}.{arch}.ptx").write_text(kernel.ptx)
        if kernel.cubin is not None:
            (out / f"{kernel.name}.{arch}.cubin").write_bytes(kernel.cubin)
        records.append(kernel.record())
    (out / "kernels.json").write_text(json.dumps({"spec": spec.to_dict(), "kernels": records},
                                                 indent=2) + "\n")
    return records


def load_kernel(folder: Path, spec, arch: str) -> CompiledRouting:
    """A kernel :func:`write_kernels` compiled ahead of time (e.g. on a machine without a GPU),
    for TensorRT's ``aot_impl``: refused unless it was compiled for exactly ``spec`` and this
    kernel version's constants, with the pinned Triton."""
    from moepipe.plugins.launch import constexprs, launch_config

    path = Path(folder) / "kernels.json"
    if not path.is_file():
        raise UnsupportedError(f"{folder}: no kernels.json",
                               "compile with `python -m moepipe.plugins.aot --spec ... --out DIR`")
    manifest = json.loads(path.read_text())
    record = next((k for k in manifest["kernels"] if k["arch"] == arch), None)
    want = constexprs(spec)
    if manifest["spec"] != spec.to_dict() or record is None or record["constexprs"] != want \
            or record["triton"] != TRITON_VERSION:
        raise UnsupportedError(f"{folder}: no precompiled routing kernel for {arch} and this "
                               "routing mode", "compile it again for this model")
    ptx = (Path(folder) / f"{record['kernel']}.{arch}.ptx").read_text()
    if hashlib.sha256(ptx.encode()).hexdigest() != record["ptx_sha256"]:
        raise UnsupportedError(f"{folder}: {record['kernel']}.{arch}.ptx does not match "
                               "kernels.json", "compile it again")
    launch = record["launch"]
    config = launch_config(spec)
    return CompiledRouting(arch=arch, name=record["kernel"], ptx=ptx, cubin=None,
                           ptx_target=record["ptx_target"], num_warps=launch["num_warps"],
                           block_x=launch["block_x"], grid_x=config.num_programs,
                           shared_mem=launch["shared_mem"],
                           global_scratch=record["global_scratch"], params=record["params"],
                           constexprs=want, triton_version=record["triton"])


def main(argv: list[str] | None = None) -> int:
    """``python -m plugins.aot --spec JSON [--arch sm_90 ...] --out DIR`` (no GPU needed)."""
    import argparse

    from moepipe.arch.routing import RoutingSpec
    from moepipe.errors import MoepipeError

    parser = argparse.ArgumentParser(prog="python -m plugins.aot",
                                     description="Compile the routing kernel to PTX/cubin.")
    parser.add_argument("--spec", required=True, help="RoutingSpec as JSON")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-cubin", action="store_true")
    args = parser.parse_args(argv)
    try:
        spec = RoutingSpec.from_dict(json.loads(args.spec))
        write_kernels(spec, args.arch or list(ARCHS), args.out, cubin=not args.no_cubin)
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
